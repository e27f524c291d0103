"""Serving: ``kvsim serve`` (a live server backed by the simulator) and
trace replay (``kvsim replay``: a scenario's trace sent to a live server).

No twin in vLLM. ``live_engine`` drives the simulator's scheduler, allocator,
model runner and step-time model on a (scaled) wall clock; ``server`` puts
vLLM's HTTP surface (``/v1/completions``, ``/v1/models``, ``/health``,
``/metrics``, the last from ``server_metrics``) in front of it. ``client``
sends a scenario's requests to any such server at their arrival times and
scrapes ``/metrics``; ``launch`` starts and stops the server a trace replay
runs against; ``recording`` turns what the client saw into the frames ``kvsim
run`` writes.

Not the pool replay (``sim.pool_replay``: block tables written into a
real KV pool).

Layer: above ``sim.analysis`` (it uses its frame functions); the simulator
(engine, scheduler, allocator) never imports this package.
"""

# ``kvsim serve`` answers each request with this header: when its engine took
# the request in (the server's virtual seconds). A replay records it, so a
# calibration simulates the order and times the server saw, not the trace's
# (a burst's bodies are read in another order than sent). vLLM reports no such
# thing: its response ids are random and its log stamps whole seconds.
ARRIVAL_HEADER = "X-Kvsim-Arrival-S"
