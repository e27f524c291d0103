"""What the tests share, in one place: drivers, hand models and fixtures.

- ``allocator``: the tiny model's plans and managers, and a request driver;
- ``scenarios``: scenarios written through the user's path, named fixtures;
- ``scheduler``: the tiny scheduler, workload requests, a checked engine, fixed draws;
- ``fast_path``: the fast-path checks' cases, one-request simulations, the audit, frames;
- ``replay_dirs``: results and replay directories written by hand;
- ``fault_server``: a misbehaving OpenAI-style server (also run as a script);
- ``reference_frames``: a script saving and comparing the gate scenarios' frames;
- ``vllm_mutants``: patched copies of vLLM's Scheduler methods for the conformance gates' reference;
- ``fork``: a small hybrid KVCacheManager driven as the fork's retention tests drive it;
- ``pins``: the fork's prefix-hit pins (0095-0097) driven as the fork's tests drive them;
- ``serve``: ``kvsim serve``'s app on 127.0.0.1 in the test's process, closed whatever happens;
- ``values``: hand-made frames for the value tests (``test_values_*.py``).

No test module imports another test module.
"""
