"""Drive a KV-cache manager by hand, as a scheduler would: aligned prefill
chunks, MTP decode with draft acceptance, finish, deferred free. The one
"prefill N tokens / decode a step" driver of the tests (the allocator tests
and, through ``helpers.fork``, the fork's patch tests); the simulator's
scheduler has its own, full loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from sim.allocator_invariants import check_allocator
from sim.config import DeploymentConfig, load_model
from sim.fork.patches import ForkPatches
from sim.fork.retention import RetainingMambaManager
from sim.fork.side_cache_rings import RingCircularBufferManager
from sim.kv_cache_manager import KVCacheManager, build_kv_cache_manager
from sim.kv_cache_plan import KVCachePlan, plan_kv_cache
from sim.vllm_bridge import (
    KVCacheBlock,
    MambaAlignedSplit,
    MambaManager,
    Request,
    SamplingParams,
    get_request_block_hasher,
    sha256,
)

TINY_MODEL = Path(__file__).parents[1] / "data" / "tiny-flash-next.yaml"
BLOCK = 32
K = 3
MAX_LEN = 512  # small, so small test pools pass the boot memory check
PLE = "language_model.model.layers.2.ple"
ATTENTION = "language_model.model.layers.3.self_attn.attn"

_PLANS: dict[bool, KVCachePlan] = {}


def tiny_plan(on: bool) -> KVCachePlan:
    if on not in _PLANS:
        model = load_model(TINY_MODEL)
        _PLANS[on] = plan_kv_cache(
            model, DeploymentConfig(max_model_len=MAX_LEN), side_cache_layout=on, num_gpu_blocks_override=400
        )
    return _PLANS[on]


def tiny_manager(on: bool, num_blocks: int = 400, *, retain: bool = True) -> KVCacheManager:
    return build_kv_cache_manager(
        tiny_plan(on), fork=ForkPatches(mamba_retain_checkpoint=retain), num_gpu_blocks=num_blocks
    )


def request(rid: str, tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=4096)
    params.update_from_generation_config({}, eos_token_id=100000)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 10000 + i for i in range(n)]


# vLLM's Mamba-aligned chunking, as the scheduler cuts prefill chunks.
ALIGNED_SPLIT = MambaAlignedSplit(block_size=BLOCK, max_num_scheduled_tokens=8192)
Trace = Callable[[], None] | None
# (request, tokens it may take, its prefix hit) -> tokens to schedule.
Split = Callable[[Request, int, int], int]


def _after_step(manager: KVCacheManager, trace: Trace, check: bool) -> None:
    manager.new_step_starts()
    if check:
        check_allocator(manager)
    if trace is not None:
        trace()


def prefill(
    manager: KVCacheManager,
    req: Request,
    budget: int = 40,
    trace: Trace = None,
    may_stall: bool = False,
    check: bool = True,
    *,
    split: Split = ALIGNED_SPLIT,
    chunks: list[int] | None = None,
    admission_gate: bool = True,
) -> int | None:
    """Prefill in scheduler-sized chunks cut by ``split`` (vLLM's
    Mamba-aligned split unless given; each chunk's size appended to
    ``chunks``); returns the prefix hit it was admitted with. The first
    chunk passes vLLM's whole-sequence admission gate unless
    ``admission_gate`` is off (the fork's patch tests call
    ``allocate_slots`` without it). None if admission is refused (or, with
    ``may_stall``, if a later chunk does not fit: the request is then
    freed, as a scheduler would preempt it)."""
    computed, num_hit, _ = manager.get_computed_blocks(req)
    first = True
    while req.num_computed_tokens < req.num_tokens:
        hit = num_hit if first else 0
        start = req.num_computed_tokens + hit
        num_new = split(req, min(req.num_tokens - start, budget), hit)
        assert num_new > 0, "the split scheduled nothing"
        blocks = manager.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=computed if first else None,
            num_lookahead_tokens=K,
            full_sequence_must_fit=first and admission_gate,
        )
        if blocks is None:
            assert first or may_stall, "a later prefill chunk did not fit"
            manager.free(req)
            return None
        req.num_computed_tokens = start + num_new
        if chunks is not None:
            chunks.append(num_new)
        first = False
        _after_step(manager, trace, check)
    return num_hit


def decode(
    manager: KVCacheManager,
    req: Request,
    steps: int,
    accepted: Callable[[int], int] = lambda step: 0,
    trace: Trace = None,
    check: bool = True,
) -> None:
    """MTP decode: 1 + K slots per step, ``accepted(step)`` drafts kept."""
    next_token = 50000 + len(req.output_token_ids)
    if req.num_computed_tokens == req.num_tokens:
        req.append_output_token_ids(next_token)
        next_token += 1
    for step in range(steps):
        req.spec_token_ids = [next_token + i for i in range(K)]
        assert manager.allocate_slots(req, 1 + K, num_lookahead_tokens=K) is not None
        num_accepted = accepted(step)
        req.spec_token_ids = []
        req.num_computed_tokens += 1 + num_accepted
        req.append_output_token_ids(list(range(next_token, next_token + num_accepted + 1)))
        next_token += num_accepted + 1
        _after_step(manager, trace, check)


# ---------------------------------------------------------- inspection
def group_index(manager: KVCacheManager, layer_name: str) -> int:
    return next(
        i for i, g in enumerate(manager.kv_cache_config.kv_cache_groups) if layer_name in g.layer_names
    )


def mamba_group_indices(manager: KVCacheManager) -> list[int]:
    return [i for i, m in enumerate(manager.managers) if isinstance(m, MambaManager)]


def held_blocks(manager: KVCacheManager, deferred: Iterable[Sequence[KVCacheBlock]] = ()) -> int:
    """Pool blocks held by anyone (the seed's ``_held``), null excluded:
    table entries, retained checkpoints, ring slot pages, fenced frees."""
    pool = manager.block_pool
    blocks: list[KVCacheBlock] = [b for blocks in deferred for b in blocks]
    for mgr in manager.managers:
        blocks += [b for table in mgr.req_to_blocks.values() for b in table]
        if isinstance(mgr, RetainingMambaManager):
            blocks += mgr.retained_blocks()
        if isinstance(mgr, RingCircularBufferManager) and mgr.slot_pool is not None:
            blocks += mgr.slot_pool.pages()
    return len({b.block_id for b in blocks if not b.is_null and b.pool is pool})
