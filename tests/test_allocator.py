"""Allocation through vLLM's real KVCacheManager for both layouts: the fork's
patch 0088 section 2 re-expressed against kvsim's API (issue: allocation)."""

from __future__ import annotations

import pytest
from helpers.allocator import (
    ATTENTION,
    PLE,
    decode,
    group_index,
    held_blocks,
    mamba_group_indices,
    prefill,
    request,
    tiny_manager,
    tokens,
)

from sim.fork.side_cache_rings import RingCircularBufferManager, RingSlotPool
from sim.kv_cache_manager import KVCacheManager
from sim.vllm_bridge import BlockPool

K = 3


def _pattern(blocks) -> tuple:
    """A block table with ids renamed by first appearance (null = -1), so two
    layouts can be compared position by position."""
    names: dict[int, int] = {}
    return tuple(-1 if b.is_null else names.setdefault(b.block_id, len(names)) for b in blocks)


def _ring(manager: KVCacheManager) -> RingCircularBufferManager:
    [ring] = manager.ring_managers
    return ring


def _trajectory(manager: KVCacheManager, accept_seed: int = 7) -> list:
    """A: prefill + MTP decode across block boundaries with varying accepts,
    finish; A2 resumes A (prefix hit); cold B beside it, freed through the
    deferred path, resumed as B2. After every step: the block-table pattern
    of the attention group, of the PLE layer's group and of every GDN group,
    the ring table width; and every hit length."""
    groups = manager.kv_cache_config.kv_cache_groups
    ple_gid = group_index(manager, PLE)
    gdn_gids = [i for i, g in enumerate(groups) if any(n.endswith("linear_attn") for n in g.layer_names)]
    attn_gid = group_index(manager, ATTENTION)
    ring_gid = manager.managers.index(_ring(manager))
    log: list = []
    live: list = []

    def trace() -> None:
        for req in live:
            blocks = manager.coordinator.get_blocks(req.request_id)
            if blocks[attn_gid]:
                log.append(
                    (
                        req.request_id,
                        _pattern(blocks[attn_gid]),
                        _pattern(blocks[ple_gid]),
                        tuple(sorted(_pattern(blocks[g]) for g in gdn_gids)),
                        len(blocks[ring_gid]),
                    )
                )

    a = request("A", tokens(1, 150))
    live.append(a)
    log.append(("hitA", prefill(manager, a, trace=trace)))
    decode(manager, a, 30, accepted=lambda s: (s * accept_seed) % 4, trace=trace)
    manager.free(a)
    live.remove(a)
    a2 = request("A2", list(a.all_token_ids) + tokens(3, 40))
    live.append(a2)
    log.append(("hitA2", prefill(manager, a2, trace=trace)))
    b = request("B", tokens(4, 120))
    live.append(b)
    log.append(("hitB", prefill(manager, b, trace=trace)))
    decode(manager, a2, 6, accepted=lambda s: s % 4, trace=trace)
    decode(manager, b, 3, trace=trace)
    popped = manager.pop_blocks_for_free(b)  # deferred free (the fence)
    live.remove(b)
    manager.block_pool.free_blocks(reversed(popped))  # the scheduler's drain
    b2 = request("B2", list(b.all_token_ids) + tokens(5, 10))
    live.append(b2)
    log.append(("hitB2", prefill(manager, b2, trace=trace)))
    for req in (a2, b2):
        manager.free(req)
    return log


def test_ple_block_table_and_hits_match_the_old_layout():
    """The PLE layer's table (null/live positions, which entries share a block
    across steps) and every hybrid hit are the same as when it had its own
    group, so its kernels read the same state positions. A large pool keeps
    eviction out of the comparison; retained checkpoints on in both."""
    runs = {}
    for on in (False, True):
        manager = tiny_manager(on)
        runs[on] = _trajectory(manager)
        assert manager.block_pool.get_num_free_blocks() == 399  # nothing leaked
    assert len(runs[True]) > 50
    assert runs[True] == runs[False]
    hits = {e[0]: e[1] for e in runs[True] if isinstance(e[1], int)}
    assert hits["hitA"] == 0 and hits["hitB"] == 0
    assert hits["hitA2"] > 0 and hits["hitB2"] > 0  # real hits were compared
    # CONTROL: a different accept pattern gives different tables, and the
    # comparison sees it.
    assert _trajectory(tiny_manager(True), accept_seed=1) != runs[True]


@pytest.mark.parametrize("on", [True, False], ids=["layout-on", "layout-off-control"])
def test_rings_share_one_pool_block(on):
    manager = tiny_manager(on)
    pool = manager.block_pool
    ring = _ring(manager)
    reqs = [request(f"R{i}", tokens(10 + i, 70)) for i in range(5)]
    for req in reqs:
        assert prefill(manager, req) == 0
        decode(manager, req, 2)
    assert pool.get_num_free_blocks() + held_blocks(manager) == 399
    ring_ids = [ring.get_ring_block_ids(r.request_id)[0] for r in reqs]
    assert len(set(ring_ids)) == 5
    assert manager.take_new_ring_block_ids() == ring_ids  # claimed once, in order
    assert manager.take_new_ring_block_ids() == []
    if on:
        slots = ring.slot_pool.slots_per_block
        assert slots > 5 and ring.slot_pool.num_pages == 1  # five rings, one block
        assert {rid // slots for rid in ring_ids} == {ring.slot_pool.pages()[0].block_id}
        assert sorted(rid % slots for rid in ring_ids) == [0, 1, 2, 3, 4]
    else:
        # CONTROL: one pool block per ring.
        assert ring.slot_pool is None
        assert all(pool.blocks[rid].ref_cnt == 1 for rid in ring_ids)
    manager.free(reqs[1])
    popped = manager.pop_blocks_for_free(reqs[3])
    if on:
        assert ring.slot_pool.num_live_slots == 4  # popped, not reusable before the fence
    manager.block_pool.free_blocks(reversed(popped))
    if on:
        assert ring.slot_pool.num_live_slots == 3
        r5 = request("R5", tokens(30, 70))
        prefill(manager, r5)
        assert ring.get_ring_block_ids("R5") == [ring_ids[1]]  # lowest free slot
        manager.free(r5)
    for req in (reqs[0], reqs[2], reqs[4]):
        manager.free(req)
    assert pool.get_num_free_blocks() == 399
    if on:
        assert ring.slot_pool.num_pages == 0


def _running_footprint(on: bool, prompt: int, retain: bool = True) -> int:
    manager = tiny_manager(on, retain=retain)
    req = request("X", tokens(99, prompt))
    prefill(manager, req)
    decode(manager, req, 3)
    return 399 - manager.block_pool.get_num_free_blocks()


def test_footprints_with_and_without_the_retained_checkpoint():
    """The fork: 2 + K per Mamba group (checkpoint included) and a ring block
    per request in the old layout. Upstream (switch off): 1 + K."""
    on, off = _running_footprint(True, 160), _running_footprint(False, 160)
    assert off - on == (2 + K) + 1 - 1  # PLE's 2 + K and the ring, less the shared page
    assert (off, on) == (27, 22)
    # CONTROL: without the retained checkpoint every Mamba group holds one less.
    up_on, up_off = _running_footprint(True, 160, retain=False), _running_footprint(False, 160, retain=False)
    assert (off - up_off, on - up_on) == (4, 3)  # one per Mamba group
    assert up_off - up_on == (1 + K) + 1 - 1


@pytest.mark.parametrize("on", [True, False], ids=["layout-on", "layout-off-control"])
def test_freed_blocks_admit_requests_the_old_layout_refuses(on):
    """Admission under pool pressure through the full-sequence gate. The pool
    is sized to six requests of the new, measured footprint plus less than
    one request's saving: the new layout admits all six, the old cannot."""
    new, old = _running_footprint(True, 160), _running_footprint(False, 160)
    n, margin = 6, old - new - 1
    manager = tiny_manager(on, num_blocks=1 + n * new + margin)
    admitted = []
    for i in range(n):
        req = request(f"C{i}", tokens(200 + i, 160))
        if prefill(manager, req, may_stall=True) is None:
            break
        decode(manager, req, 3)
        admitted.append(req)
    if on:
        assert len(admitted) == n
    else:
        assert len(admitted) < n  # CONTROL: the same pool fits fewer conversations
    for req in admitted:
        manager.free(req)
    assert manager.block_pool.get_num_free_blocks() == n * new + margin


def test_retained_checkpoint_keeps_the_resume_hit_under_pressure():
    """A runs; a long B arrives while A still runs; A finishes and A2 resumes
    it. Upstream has already freed A's checkpoint to the free queue, so B's
    allocations evict it and A2 misses. The fork retains it until A is freed:
    B cannot take it (B does not fit beside A) and A2 hits."""

    def run(retain: bool) -> tuple[bool, int]:
        manager = tiny_manager(False, num_blocks=54, retain=retain)
        a = request("A", tokens(1, 150))
        prefill(manager, a)
        decode(manager, a, 4)
        b = request("B", tokens(2, 200))
        b_ran = prefill(manager, b, may_stall=True) is not None
        manager.free(a)
        a2 = request("A2", list(a.all_token_ids) + tokens(3, 10))
        return b_ran, manager.get_computed_blocks(a2)[1]

    assert run(retain=True) == (False, 96)
    assert run(retain=False) == (True, 0)  # CONTROL: upstream loses the hit


def test_ring_slot_pool_alone():
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    slots = RingSlotPool(pool, slots_per_block=3)
    got = slots.get_new_blocks(4)
    pages = [b.block_id // 3 for b in got]
    assert pages == [pages[0]] * 3 + [pages[3]] and pages[0] != pages[3]
    assert [b.block_id % 3 for b in got] == [0, 1, 2, 0]
    assert slots.num_pages == 2 and pool.get_num_free_blocks() == 3
    pool.free_blocks([got[3]])  # routed through the main pool's free path
    assert slots.num_pages == 1 and pool.get_num_free_blocks() == 4
    pool.free_blocks(got[:2])
    assert slots.has_free_slot() and slots.num_pages == 1
    with pytest.raises(AssertionError, match="twice"):
        slots.free_blocks([got[0]])  # double free is loud
    pool.free_blocks([got[2]])
    assert slots.num_pages == 0 and pool.get_num_free_blocks() == 5


def test_ring_estimate_is_zero_while_a_held_page_has_a_free_slot():
    manager = tiny_manager(True)
    ring = _ring(manager)
    first = request("F", tokens(1, 40))
    assert ring.get_num_blocks_to_allocate("F", 40, [], 0, 0, 40) == 1  # no page yet
    prefill(manager, first)
    assert ring.get_num_blocks_to_allocate("G", 40, [], 0, 0, 40) == 0
    manager.free(first)
    assert ring.get_num_blocks_to_allocate("G", 40, [], 0, 0, 40) == 1


def test_mamba_groups_hold_the_same_tables_after_the_fold():
    manager = tiny_manager(True)
    req = request("M", tokens(7, 130))
    prefill(manager, req)
    decode(manager, req, 5, accepted=lambda s: s % 4)
    tables = manager.coordinator.get_blocks("M")
    patterns = {_pattern(tables[g]) for g in mamba_group_indices(manager)}
    assert len(patterns) == 1  # the PLE-carrying group's table is a GDN table
    manager.free(req)


def _claim_ignoring_the_flag(self, request_id: str, record_for_zeroing: bool = True):
    """The claim before it honoured ``record_for_zeroing`` (the control)."""
    pool = self.slot_pool if self.slot_pool is not None else self.block_pool
    new_blocks = pool.get_new_blocks(1) if not self.req_to_blocks[request_id] else []
    self.req_to_blocks[request_id].extend(new_blocks)
    self.new_ring_block_ids.extend(block.block_id for block in new_blocks)
    return new_blocks


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("broken", [False, True], ids=["claim", "control"])
def test_a_ring_the_external_load_writes_is_not_recorded_for_clearing(
    on: bool, broken: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream (``CircularBufferManager._claim_ring_block``, driven by the
    coordinator's external-KV path) records a new block for zeroing only
    with ``record_for_zeroing``; the fork's ring record must do the same, or
    the worker would clear a ring the load is writing."""
    if broken:
        monkeypatch.setattr(RingCircularBufferManager, "_claim_ring_block", _claim_ignoring_the_flag)
    ring = tiny_manager(on).ring_managers[0]
    ring.allocate_external_computed_blocks("loaded", 0, 64, record_for_zeroing=False)
    ring.allocate_external_computed_blocks("fresh", 0, 64, record_for_zeroing=True)
    recorded = ring.take_new_ring_block_ids()
    expected = ring.get_ring_block_ids("fresh")
    assert len(expected) == 1 and len(ring.get_ring_block_ids("loaded")) == 1
    assert (recorded == expected) != broken


def test_a_slot_pool_needs_two_slots_and_catches_a_double_free_in_a_live_page():
    """S = 1 is no packing (the old layout keeps plain blocks): refused;
    S = 2 is the smallest pool. A slot freed twice while its page lives is
    caught by the page's own record even when its reference was restored."""
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    with pytest.raises(AssertionError, match=r"^a slot pool needs at least two slots per block$"):
        RingSlotPool(pool, slots_per_block=1)
    slots = RingSlotPool(pool, slots_per_block=2)
    first, second = slots.get_new_blocks(2)
    slots.free_blocks([first])
    first.ref_cnt = 1  # a stale holder that still thinks it owns the slot
    with pytest.raises(AssertionError, match=rf"^ring slot {first.block_id} freed twice$"):
        slots.free_blocks([first])
    assert slots.num_pages == 1 and second.ref_cnt == 1


def test_a_request_that_holds_its_ring_needs_no_new_ring_block():
    """Old layout (no slot pool): a request's ring costs one block until it
    holds one, then nothing; an unknown request has no ring ids."""
    manager = tiny_manager(False)
    ring = _ring(manager)
    holder = request("H", tokens(1, 40))
    prefill(manager, holder)
    assert ring.get_num_blocks_to_allocate("H", 44, [], 40, 40, 44) == 0
    assert ring.get_num_blocks_to_allocate("N", 40, [], 0, 0, 40) == 1
    assert ring.get_ring_block_ids("nobody") == []
    manager.free(holder)


def test_skipping_blocks_of_a_request_with_no_table_does_nothing():
    """The retaining manager looks at the table before vLLM's skip: a
    request with no table (nothing allocated yet) retains nothing."""
    manager = tiny_manager(False)
    [retaining, *_] = [m for m in manager.managers if hasattr(m, "_retained_checkpoints")]
    retaining.remove_skipped_blocks("ghost", 100)
    assert retaining.retained_blocks() == [] and not retaining.req_to_blocks.get("ghost")


def test_the_manager_defaults_are_the_forks():
    """Built with no switches: the fork's retained checkpoint is on, prefix
    caching is on; with caching off a repeated prompt never hits."""
    from helpers.allocator import tiny_plan

    from sim.fork.retention import RetainingMambaManager
    from sim.kv_cache_manager import build_kv_cache_manager

    default = build_kv_cache_manager(tiny_plan(False))
    assert any(isinstance(m, RetainingMambaManager) for m in default.managers)
    uncached = build_kv_cache_manager(tiny_plan(False), enable_caching=False)
    for manager, hit in ((default, 96), (uncached, 0)):
        first = request("P", tokens(5, 150))
        prefill(manager, first)
        decode(manager, first, 2)
        manager.free(first)
        assert manager.get_computed_blocks(request("Q", tokens(5, 160)))[1] == hit


def test_group_index_finds_the_layers_group():
    manager = tiny_manager(True)
    index = group_index(manager, ATTENTION)
    assert ATTENTION in manager.kv_cache_config.kv_cache_groups[index].layer_names
    assert index == len(manager.managers) - 1  # full attention is the last group (tiny plan)


def test_a_ring_manager_with_two_slots_per_block_packs_two_rings_per_block():
    """S = 2, the smallest packing: the manager serves rings from a slot
    pool (a whole block per ring is only for S = 1). Hand count: rings of
    requests 0 and 1 are slots 0 and 1 of one pool block (ids 2p and
    2p + 1), request 2's ring opens a second block; 3 blocks of a 6-block
    pool (null block included) leave 3 free, not 2."""
    from dataclasses import replace

    spec = replace(_ring(tiny_manager(True)).kv_cache_spec, slots_per_block=2)
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    ring = RingCircularBufferManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=spec.block_size
    )
    assert ring.slot_pool is not None and ring.slot_pool.slots_per_block == 2
    for rid in ("r0", "r1", "r2"):
        ring.allocate_new_blocks(rid, 1, 1)
    ids = [ring.get_ring_block_ids(rid)[0] for rid in ("r0", "r1", "r2")]
    assert ids[0] % 2 == 0 and ids[1] == ids[0] + 1  # one block, two slots
    assert ids[2] // 2 != ids[0] // 2 and ids[2] % 2 == 0
    assert ring.slot_pool.num_pages == 2 and pool.get_num_free_blocks() == 3


@pytest.mark.parametrize("zeroing", [False, True], ids=["no-zeroing", "zeroing"])
def test_the_ring_records_blocks_for_kv_zeroing_exactly_as_upstream(zeroing: bool) -> None:
    """vLLM's own ``CircularBufferManager`` is the expected value: it never
    records ring blocks for worker-side KV zeroing, with zeroing on or off
    (a ``CircularBufferSpec`` is excluded from ``_record_new_block_ids``;
    rings are cleared through their own record instead). kvsim's ring
    manager (old layout, whole blocks, so ids match block for block)
    records the same: nothing, whatever ``record_for_zeroing`` says."""
    from sim.vllm_bridge import CircularBufferManager

    spec = _ring(tiny_manager(False)).kv_cache_spec
    recorded = []
    for manager_class in (CircularBufferManager, RingCircularBufferManager):
        pool = BlockPool(num_gpu_blocks=6, enable_caching=False, hash_block_size=16)
        ring = manager_class(
            spec,
            block_pool=pool,
            enable_caching=False,
            kv_cache_group_id=0,
            scheduler_block_size=spec.block_size,
            needs_kv_cache_zeroing=zeroing,
        )
        ring.allocate_new_blocks("fresh", 1, 1)
        ring.allocate_external_computed_blocks("loaded", 0, 64, record_for_zeroing=False)
        ring.allocate_new_blocks("second", 1, 1)
        recorded.append(list(ring.new_block_ids))
    upstream, kvsim = recorded
    assert kvsim == upstream == []


def test_kvsims_specs_select_kvsims_managers_in_vllms_registry():
    """``_register`` (run at import of ``sim/fork/side_cache_rings.py`` and
    ``sim/fork/retention.py``) puts kvsim's spec types in vLLM's
    spec registry. Re-run here on a registry without them (mutation tools
    swap code in only after import): vLLM then serves a ``RingSlotsSpec``
    with kvsim's ring manager, a ``RetainedCheckpointMambaSpec`` with the
    retaining Mamba manager and the fork's shipped Mamba spec
    (``PartialTailHoldingMambaSpec``) with its subclass that also holds
    partial tails; without the registration it would serve them with its
    own managers (found through the spec's base classes).
    (The registered ``uniform_type_base_spec`` is not checked: vLLM's
    ``CircularBufferSpec`` and ``MambaSpec`` decide grouping by their own
    ``is_uniform_with_collection``, which does not read it.)"""
    from vllm.v1 import kv_cache_spec_registry as registry

    from sim.fork.retention import (
        PartialTailHoldingMambaManager,
        PartialTailHoldingMambaSpec,
        RetainedCheckpointMambaSpec,
        RetainingMambaManager,
    )
    from sim.fork.retention import _register as register_retention
    from sim.fork.side_cache_rings import RingSlotsSpec
    from sim.fork.side_cache_rings import _register as register_rings
    from sim.kv_cache_interface import convert_spec
    from sim.vllm_bridge import CircularBufferManager, KVCacheSpecRegistry, MambaManager

    manager = tiny_manager(False)
    ring_spec = _ring(manager).kv_cache_spec
    [mamba_spec, *_] = [m.kv_cache_spec for m in manager.managers if hasattr(m, "_retained_checkpoints")]
    assert type(ring_spec) is RingSlotsSpec and type(mamba_spec) is PartialTailHoldingMambaSpec
    retaining_spec = convert_spec(mamba_spec, RetainedCheckpointMambaSpec)
    saved = dict(registry._REGISTRY_KVCACHESPEC_LIST)  # vLLM's module-level registry
    try:
        for spec_class in (RingSlotsSpec, RetainedCheckpointMambaSpec, PartialTailHoldingMambaSpec):
            del registry._REGISTRY_KVCACHESPEC_LIST[spec_class]
        # CONTROL: unregistered, vLLM's own managers would serve them.
        assert KVCacheSpecRegistry.get_manager_class(ring_spec) is CircularBufferManager
        assert KVCacheSpecRegistry.get_manager_class(mamba_spec) is MambaManager
        assert KVCacheSpecRegistry.get_manager_class(retaining_spec) is MambaManager
        register_rings()
        register_retention()
        assert KVCacheSpecRegistry.get_manager_class(ring_spec) is RingCircularBufferManager
        assert KVCacheSpecRegistry.get_manager_class(mamba_spec) is PartialTailHoldingMambaManager
        assert KVCacheSpecRegistry.get_manager_class(retaining_spec) is RetainingMambaManager
    finally:
        registry._REGISTRY_KVCACHESPEC_LIST.clear()
        registry._REGISTRY_KVCACHESPEC_LIST.update(saved)
