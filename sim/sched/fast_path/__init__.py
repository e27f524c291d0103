"""The fast path: the scheduler work kvsim skips because it changes nothing
(vLLM's scheduler makes every call). The allocator's door
(``FastPathKVCacheManager``) decides every call that may change the
allocator; ``FastPath`` holds the memos of the scheduler's own loops and the
steady lanes. ``audit = True`` makes every skipped call anyway and asserts it
changed nothing. The twelve rules ("rule N"), argued, with the tests that go
red when each is broken: ``docs/fast-path.md``."""
