"""What the tests share, in one place: drivers, hand models and fixtures.

- ``allocator``: the tiny model's plans and managers, and a request driver;
- ``scenarios``: scenarios written through the user's path, named fixtures;
- ``scheduler``: the tiny scheduler, request specs, a checked engine, fixed draws;
- ``fast_path``: the fast-path checks' cases, one-request simulations, the audit, frames;
- ``replay_dirs``: results and replay directories written by hand;
- ``fault_server``: a misbehaving OpenAI-style server (also run as a script);
- ``reference_frames``: a script saving and comparing the gate scenarios' frames;
- ``vllm_mutants``: patched copies of vLLM's Scheduler methods for the conformance gates' reference.

No test module imports another test module.
"""
