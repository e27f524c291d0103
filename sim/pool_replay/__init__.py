"""Pool replay (not trace replay, which is ``sim.serving``): the simulated
block tables written into one rank's real KV pool, to prove the bytes follow
the allocator's bookkeeping.

The pool is allocated with torch the way the worker allocates it (vLLM's
``allocate_kv_cache`` and the layers' ``bind_kv_cache``, through
``views.py``), on the CPU or a CUDA device. The simulation runs
unchanged; the replay is the observer its scheduler and KV-cache manager
call (``SchedulerObserver``, ``BlockObserver``: each step scheduled, each
output, each free, each prefix hit; it reads the scheduler's fence clock)
and, at every step:

- zeroes the pages of the ring slots claimed that step (the fork's ring-tag
  path, fed by ``take_new_ring_block_ids``; the replay clears the whole slot
  page, a superset of the tag words);
- writes a fingerprint of (request, group, layer, position) into exactly the
  cells the block table maps for the tokens computed that step: one token row
  of every attention layer, one compressed-key state row per
  ``tokens_per_state`` tokens, the ring row ``position % capacity`` and the
  whole state page of every Mamba layer (GDN and PLE);
- reads back what it wrote.

Before writing it checks that every cell lies inside the pool block (for a
ring, inside the slot) its block id names, that the block is held by the
writer alone, and that no fenced block (freed while a step that may still
read it is in flight) is written. It verifies the bytes against a shadow of
who wrote each cell at every free (the freed request's pages), at every
prefix hit (the hit request reads what the earlier request wrote, at the
right positions), when a fence passes (the fenced pages still hold their
owner's fingerprint) and at the end (every cell of the pool). A violation
raises ``PoolCorruption`` naming the step, the request, the group, the layer
and the byte range.

Deliberate simplifications (docs/fidelity.md): a Mamba layer's state is
written to the block of the last token computed each step (the worker's
align-mode copies and internal prefill checkpoints are not replayed; a hit on
a state page the replay never wrote is not verified), and the fence clock is
the scheduler's model of steps in flight (``max_concurrent_batches``).

Parts: ``fingerprints`` (what a cell holds), ``views`` (the pool allocated
and bound as the worker does), ``plan`` (the pool's geometry from the
views), ``verify`` (the checks), ``replay`` (the observer and the entry
point), ``report`` (what it wrote and verified), ``devices`` (where the pool
lives).
"""

from sim.pool_replay.devices import pool_bytes_for, resolve_device
from sim.pool_replay.fingerprints import PoolCorruption, describe_word
from sim.pool_replay.replay import PoolReplay, replay_pool, with_pool_bytes
from sim.pool_replay.report import PoolReplayReport

__all__ = [
    "PoolCorruption",
    "PoolReplay",
    "PoolReplayReport",
    "describe_word",
    "pool_bytes_for",
    "replay_pool",
    "resolve_device",
    "with_pool_bytes",
]
