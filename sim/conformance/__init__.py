"""Conformance: kvsim's scheduler, step for step, against vLLM's own
``Scheduler`` on the same trace, clock and acceptance draws.

``backends`` holds the two backends behind one small interface, ``driver``
the clock both run under and the step-by-step comparison. The vLLM backend
is built by ``sim.vllm_bridge.scheduler``, imported only here, on first use:
nothing else in kvsim depends on it. No twin in vLLM.
"""
