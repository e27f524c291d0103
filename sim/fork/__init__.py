"""The fork's twins: what ``halt95/qwen38-flash-next-3090s`` (release v2.5.1)
adds to vLLM's scheduler side, one module per patch family, each opening with
the patch numbers it twins (``docs/fork-patches.md`` has a row per patch).

=============  ======================  ========================================
patch          module                  what
=============  ======================  ========================================
(switches)     ``patches.py``          one key per modelled patch (``fork:``)
0088           ``side_cache_layout``   the layout pass: PLE fold, ring slots
0088, 0049     ``side_cache_rings``    ring slot spec, pool and manager; the
                                       ring claim record
0086, 0087,    ``retention``           Mamba checkpoint retention, the
0093, 0094                             partial-tail hold, their spec types
0018, 0023     ``frees``               0018's fence gate; ``KVCacheManager``:
                                       the deferred-free order, retained
                                       checkpoints freed last (0086)
0095-0097      ``pins``                waiter and grace pins on the manager
0095-0097      ``scheduler_pins``      the scheduler's three pin points
0008, 0050     none                    upstream in vLLM 0.33.0, driven as is:
                                       ``MambaManager``'s admission cap
                                       (0008), the in-flight victim check
                                       (0050: ``sim/sched/scheduler.py``
                                       ``_allocate_or_preempt`` and
                                       ``_blocks_can_be_freed``)
=============  ======================  ========================================

Elsewhere by design: the spec patches change the model's layer specs, not
the allocator (0002, 0071, 0072, 0085: ``sim/model_specs.py``; 0036:
``sim/pool_replay/views.py``), and the upstream ports 0060/0063 are vLLM
0.33.0's own code.

The modules sit on the floors of what they twin (``tests/test_layering.py``):
the switches lowest, the layout pass and the single-type managers under the
manager factory (``sim/kv_cache_manager.py``), the pins' scheduler side with
the scheduler. This package imports none of its modules itself.
"""
