"""Which of the fork's decision-changing patches a run applies: one switch
each for 0023, 0086/0087, 0093, 0095/0096 and 0097, and two base-version
rules (not patches).

No twin in vLLM: the fork (``halt95/qwen38-flash-next-3090s``, release
v2.5.1) reads one environment switch for its Mamba checkpoint retention and
has no switch for its other patches; kvsim gives each modelled patch a key so
a scenario can run the fork as shipped (the defaults), upstream vLLM 0.33.0
(``ForkPatches.upstream()``: every patch off), or the fork with any patch
off. ``docs/fidelity.md`` has a row per patch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class ForkPatches:
    """One switch per modelled patch, named after the fork's own switch
    where it has one, else after the patch's subject; default = as shipped.
    """

    # VLLM_E2_MAMBA_RETAIN_CHECKPOINT (patches 0086, 0087; default 1): a
    # running request keeps its newest hashed Mamba checkpoint, freed last,
    # and full-sequence admission reserves it.
    mamba_retain_checkpoint: bool = True
    # Patch 0093 (same fork switch, its own key here so it can be turned off
    # alone): with a hash unit finer than the block, a partial hit's
    # copy-on-write source and a running request's moved prompt tail are
    # held as its checkpoint, and admission reserves the swap. No effect
    # without mamba_retain_checkpoint, as in the fork.
    mamba_hold_partial_tail: bool = True
    # Patch 0023 (port of vLLM #48532): a deferred free returns a request's
    # blocks in the same per-group order as an immediate free.
    deferred_free_eviction_order: bool = True
    # Patches 0095 and 0096: a waiting request's prefix hit is pinned (up to
    # 16 waiters) until it is admitted or freed; pins yield before anyone
    # is preempted. Active with prefix caching and no KV connector.
    waiter_pins: bool = True
    # Patch 0097: a finished turn's hashed blocks stay referenced (up to 16
    # turns) until its next turn is admitted on them; graces yield first.
    # The fork activates graces only with a prefix-match unit finer than
    # the block (at unit == block they are inactive, as shipped).
    grace_pins: bool = True
    # Not a patch: the fork's base, vLLM 0.30.0, caps a prefill at
    # long_prefill_token_threshold even for the only request; 0.33.0 lets a
    # lone request use the whole budget (nobody to starve). Found by
    # ``kvsim conform --fork`` on the long-chunked shape (issue 37).
    threshold_caps_lone_request: bool = True
    # Not a patch either: vLLM 0.30.0's synchronous Scheduler caches a
    # request's blocks only when allocate_slots commits them (the scheduled
    # tokens less the drafts); 0.33.0 also caches after each sampled step
    # with drafts, so a block filled by a request's last step before it is
    # preempted or finishes is hashed there and not in the fork. (Both
    # versions' AsyncScheduler cache after each output.) Found by ``kvsim
    # conform --fork`` on the heavy-preemption shape (issue 37).
    caches_at_allocation_only: bool = True

    @classmethod
    def upstream(cls) -> ForkPatches:
        """vLLM 0.33.0 as released: every patch off."""
        return cls(**{f.name: False for f in fields(cls)})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# The fork as shipped (v2.5.1): every modelled patch on.
AS_SHIPPED = ForkPatches()
