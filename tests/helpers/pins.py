"""Drive the fork's prefix-hit pins (patches 0095-0097) the way the fork's
tests do (``tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py``
of ``halt95/qwen38-flash-next-3090s``, built up by patches 0093-0097).

Two rigs, with the fork tests' sizes:

- a hybrid manager: full attention and one align-mode Mamba group, both at
  block 32, hashed every 8 tokens (the prefix-match unit), MTP K=3 with the
  EAGLE drop, retention interval 0; prompts prefilled in the chunks vLLM's
  Mamba-aligned split cuts, copy-on-write copies released after each step
  (what the scheduler does once a step's copies have run);
- kvsim's scheduler over a full-attention manager at block 16 with the
  graces forced on (the fork's ``_grace_scheduler``: opt-125m, 4 sequences,
  no drafts, no fenced frees).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from helpers import allocator
from helpers.fork import mamba_spec
from sim.fork.patches import AS_SHIPPED, ForkPatches
from sim.fork.pins import PinningKVCacheManager
from sim.kv_cache_manager import KVCacheManager, MTPHashing
from sim.sched.output import ModelRunnerOutput, SchedulerOutput
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.vllm_bridge import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaAlignedSplit,
    Request,
    RequestStatus,
    SamplingParams,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)

BLOCK = 32
UNIT = 8
K = 3
ATTN = 0
MAMBA = 1


def pinning_manager(
    num_blocks: int,
    fork: ForkPatches = AS_SHIPPED,
    *,
    hash_block_size: int = UNIT,
    kv_connector: bool = False,
) -> KVCacheManager:
    """The hybrid rig's manager as ``build_kv_cache_manager`` picks it:
    kvsim's pinning manager when a pin patch is on, else kvsim's own."""
    init_none_hash(sha256)
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], attention), KVCacheGroupSpec(["mamba"], mamba_spec(fork))]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    arguments = dict(
        max_model_len=8192,
        scheduler_block_size=BLOCK,
        hash_block_size=hash_block_size,
        enable_caching=True,
        use_eagle=True,
    )
    config = replace(config, prefix_cache_retention_interval=0)
    if fork.waiter_pins or fork.grace_pins:
        pins = dict(waiter_pins=fork.waiter_pins, grace_pins=fork.grace_pins, kv_connector=kv_connector)
        manager: KVCacheManager = PinningKVCacheManager(config, **arguments, **pins)
    else:
        manager = KVCacheManager(config, **arguments)
    manager.deferred_free_eviction_order = fork.deferred_free_eviction_order
    return manager


def request(request_id: str, tokens: list[int], unit: int = UNIT) -> Request:
    """A request hashed every ``unit`` tokens (the prefix-match unit)."""
    params = SamplingParams(max_tokens=4096)
    params.update_from_generation_config({}, eos_token_id=100_000)
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(unit, sha256),
    )


def tail_tokens(seed: int, n: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n)]


def tail_position(num_prompt_tokens: int) -> int:
    """Where a prompt's partial-tail state is keyed: the last unit
    boundary, one unit lower under the EAGLE drop."""
    return num_prompt_tokens // UNIT * UNIT - UNIT


def follow_up(prev: Request, user_tokens: int, seed: int, suffix: str = "+") -> Request:
    """The next turn: ``prev``'s tokens and new text, sized so its tail lands
    strictly inside a block above its last cacheable block end."""
    while True:
        prompt = len(prev.all_token_ids) + user_tokens
        tail = tail_position(prompt)
        if tail % BLOCK != 0 and prompt - prompt % BLOCK - BLOCK < tail:
            break
        user_tokens += 1
    return request(prev.request_id + suffix, list(prev.all_token_ids) + tail_tokens(seed, user_tokens))


def drain_copies(manager: KVCacheManager) -> None:
    _, retained = manager.take_kv_cache_block_copies()
    manager.block_pool.free_blocks(retained)


def prefill(manager: KVCacheManager, req: Request) -> int:
    """The prompt in the partial-hit split's chunks, no admission gate, the
    copy refs released after each step; returns the admitted hit."""
    split = MambaAlignedSplit(
        block_size=BLOCK, max_num_scheduled_tokens=8192, hash_block_size=UNIT, partial_hash_hits=True
    )
    settle = partial(drain_copies, manager)
    num_hit = allocator.prefill(
        manager, req, 8192, trace=settle, check=False, split=split, admission_gate=False
    )
    assert num_hit is not None, "a prefill chunk did not fit"
    return num_hit


def decode(manager: KVCacheManager, req: Request, steps: int) -> None:
    """MTP decode steps (the last token and K drafts), none accepted."""
    allocator.decode(manager, req, steps, trace=partial(drain_copies, manager), check=False)


def run(manager: KVCacheManager, req: Request, decode_steps: int = 2) -> int:
    num_hit = prefill(manager, req)
    decode(manager, req, decode_steps)
    return num_hit


def finish_and_free(
    manager: KVCacheManager, req: Request, path: str = "immediate", status: RequestStatus | None = None
) -> None:
    """A finished turn's free, now or (a step still in flight) popped now
    and freed when the fence drains."""
    req.status = status or RequestStatus.FINISHED_STOPPED
    if path == "immediate":
        manager.free(req)
    else:
        manager.block_pool.free_blocks(reversed(manager.pop_blocks_for_free(req)))
    drain_copies(manager)


def free_ids(manager: KVCacheManager) -> set[int]:
    return {b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()}


def assert_pool_clean(manager: KVCacheManager, num_blocks: int) -> None:
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == num_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])


# ------------------------------------------------------ the scheduler rig
@dataclass(frozen=True)
class Spec:
    """A request for ``Scheduler.add_request`` with its own token ids."""

    request_id: str
    tokens: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def prompt_token_ids(self) -> list[int]:
        return list(self.tokens)


def grace_scheduler(num_blocks: int, fork: ForkPatches = AS_SHIPPED, *, eagle: bool = False) -> Scheduler:
    """The fork's ``_grace_scheduler``: full attention at block 16, prefix
    caching, 4 sequences, no drafts, frees at once; graces forced on (a
    block-sized unit turns them off by default, as in the fork)."""
    init_none_hash(sha256)
    attention = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["full"], attention)]
    )
    # ``eagle``: lookups drop the last hit block (the fork flags group 0).
    arguments = dict(
        max_model_len=8192, scheduler_block_size=16, hash_block_size=16, enable_caching=True, use_eagle=eagle
    )
    if fork.waiter_pins or fork.grace_pins:
        manager: KVCacheManager = PinningKVCacheManager(
            config, **arguments, waiter_pins=fork.waiter_pins, grace_pins=fork.grace_pins
        )
        manager.enable_grace_pins = fork.grace_pins  # type: ignore[attr-defined]
    else:
        manager = KVCacheManager(config, **arguments)
    scheduler = Scheduler(pins_scheduler_config(16), manager)
    scheduler.split = _AttentionOnlySplit()  # type: ignore[assignment]
    return scheduler


def pins_scheduler_config(block_size: int) -> SchedulerConfig:
    """The fork's grace tests' scheduler: 4 sequences, no drafts, frees at
    once, one batch in flight."""
    return SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        block_size=block_size,
        num_speculative_tokens=0,
        defer_block_free=False,
        max_concurrent_batches=1,
        mtp_hashing=MTPHashing.for_hash_mode("eagle-drop", num_speculative_tokens=0),
    )


class _AttentionOnlySplit:
    """vLLM cuts prefill chunks on Mamba blocks only for a model with Mamba
    layers; the fork's rig (opt-125m) has none, so chunks are left whole."""

    def __call__(self, request: Request, num_new_tokens: int, num_new_local_computed_tokens: int = 0) -> int:
        return num_new_tokens

    def reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        return num_new_tokens


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One step; every scheduled request samples token 7."""
    output = scheduler.schedule()
    sampled = {item.request_id: [7] for item in output.scheduled if _samples(scheduler, item)}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))
    return output


def _samples(scheduler: Scheduler, item: object) -> bool:
    """A chunk that ends the prompt (or a decode) samples a token."""
    req = scheduler.requests[item.request_id]  # type: ignore[attr-defined]
    return req.num_computed_tokens >= req.num_tokens


def finish(scheduler: Scheduler, spec: Spec) -> None:
    scheduler.add_request(spec)
    while spec.request_id in scheduler.requests or any(
        w.request_id == spec.request_id for w in scheduler.waiting
    ):
        step(scheduler)


def _is_waiting(scheduler: Scheduler, request_id: str) -> bool:
    return any(entry.request_id == request_id for entry in scheduler.waiting)
