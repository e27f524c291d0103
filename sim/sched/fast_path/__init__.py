"""The fast path: the scheduler work kvsim skips because it changes nothing.

No twin in vLLM (its scheduler makes every call). Two objects: the
allocator's door (``FastPathKVCacheManager``, ``kv_cache_manager.py``),
the scheduler's ``kv_cache_manager`` when ``simulation.fast_path`` is on,
which decides every call that may change the allocator; and ``FastPath``
(``memos.py``, ``Scheduler.fast_path``), the memos of the scheduler's own
loops and the steady lanes. ``audit = True`` makes every skipped call
anyway and asserts it changed nothing.

The twelve rules ("rule N" below), each with its argument and the tests
that go red when it is broken: ``docs/fast-path.md``, "The rules, argued".
"""
