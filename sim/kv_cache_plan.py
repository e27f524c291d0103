"""Plan the KV-cache pool of a model for one layout, the way the fork's engine
does at boot, and summarise it in the figures its boot log prints.

Old layout (switch 0): vLLM's own planner, nothing of kvsim's in the
arithmetic. New layout (switch 1, the fork's default): kvsim's side-cache
layout pass (``sim.fork.side_cache_layout``, patch 0088) on top of the planner's groups. When the
installed vLLM is the fork and already has the pass, its result is used.
"""

from __future__ import annotations

import inspect
import os
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

from sim.config import ConfigError, DeploymentConfig, ModelConfig
from sim.fork import side_cache_layout as side
from sim.fork.side_cache_rings import group_slots_per_block
from sim.kv_cache_interface import first_layer_spec, group_layer_specs
from sim.model_specs import LayerSpecs, build_worker_specs
from sim.vllm_bridge import (
    SIDE_CACHE_SWITCH,
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    clear_vllm_env_cache,
    engine_config,
    fork_planning_module,
    kv_cache_utils,
    planning,
)


@dataclass(frozen=True, kw_only=True)
class GroupSummary:
    index: int
    kind: str  # "gdn", "gdn+ple", "ple", "ring", "attention"
    layers_per_stage: tuple[int, ...]
    slots_per_block: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "layers_per_stage": list(self.layers_per_stage),
            "slots": self.slots_per_block,
        }


@dataclass(frozen=True, kw_only=True)
class KVCachePlan:
    """One layout's pool, as every rank would build it."""

    side_cache_layout: bool  # what was asked for
    applied: bool  # whether the side-cache layout is in effect
    source: str  # "vllm planner" / "kvsim side-cache layout" / "fork"
    engine: Any = field(repr=False)
    layer_specs: LayerSpecs = field(repr=False)
    worker_configs: list[KVCacheConfig] = field(repr=False)
    stage_ranks: tuple[int, ...]  # one rank per PP stage (TP rank 0)
    block_size: int
    # The prefix-hit grid (vLLM's hash_block_size, resolved from
    # --prefix-match-unit by ``resolve_kv_cache_block_sizes`` with prefix
    # caching on); the block size when no unit is set.
    hash_block_size: int
    block_bytes_per_stage: tuple[int, ...]
    num_blocks: int
    blocks_per_request: int
    kv_cache_tokens: int
    max_concurrency: float
    ring_slots_per_block: int
    groups: tuple[GroupSummary, ...]
    notes: tuple[str, ...]

    @property
    def label(self) -> str:
        return "on" if self.applied else "off"

    def scheduler_config(self) -> KVCacheConfig:
        """The scheduler's view: rank 0's config, one spec per group."""
        return kv_cache_utils.generate_scheduler_kv_cache_config(self.worker_configs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "side_cache_layout": self.applied,
            "source": self.source,
            "block_size": self.block_size,
            "hash_block_size": self.hash_block_size,
            "block_bytes_per_stage": list(self.block_bytes_per_stage),
            "num_blocks": self.num_blocks,
            "blocks_per_request": self.blocks_per_request,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": round(self.max_concurrency, 4),
            "ring_slots_per_block": self.ring_slots_per_block,
            "groups": [g.to_dict() for g in self.groups],
            "notes": list(self.notes),
        }


def build_engine(
    model: ModelConfig,
    deployment: DeploymentConfig,
    num_gpu_blocks_override: int | None = None,
    block_size: int | None = None,
) -> Any:
    """The engine-config stand-in; ``block_size`` is the resolved block (the
    planner's, after the hybrid alignment), as vLLM's cache config holds it."""
    return engine_config(
        block_size=block_size or deployment.block_size or 16,
        prefix_match_unit=deployment.prefix_match_unit,
        max_model_len=deployment.max_model_len,
        max_num_seqs=deployment.max_num_seqs,
        num_speculative_tokens=model.mtp.num_speculative_tokens,
        pipeline_parallel_size=deployment.pipeline_parallel_size,
        tensor_parallel_size=deployment.tensor_parallel_size,
        kv_cache_layout=deployment.kv_cache_layout,
        num_gpu_blocks_override=num_gpu_blocks_override,
        mamba_cache_mode=model.mamba_cache_mode,
        kv_transfer_config={"connector": "configured"} if deployment.kv_connector else None,
        hisparse_config={"enabled": True} if deployment.hisparse else None,
        decode_context_parallel_size=deployment.decode_context_parallel_size,
        total_num_hidden_layers=model.num_layers,
    )


def plan_kv_cache(
    model: ModelConfig,
    deployment: DeploymentConfig,
    *,
    side_cache_layout: bool,
    num_gpu_blocks_override: int | None = None,
) -> KVCachePlan:
    """Plan the pool for one layout; bad input is a one-line ``ConfigError``.

    vLLM checks a deployment with ``assert`` too (``divide``: heads not
    divisible by the tensor-parallel size); those become the one-line error,
    naming the deployment's parallel fields, like the planner's ValueErrors."""
    try:
        layer_specs, workers = build_worker_specs(model, deployment)
        engine = build_engine(model, deployment, num_gpu_blocks_override, layer_specs.block_size)
        memory = [deployment.kv_cache_memory_bytes] * len(workers)
        if fork_planning_module() is not None:
            configs, applied, notes, source = _plan_with_fork(engine, workers, memory, side_cache_layout)
        else:
            configs, applied, notes, source = _plan_upstream(engine, workers, memory, side_cache_layout)
        hash_block_size = _hash_block_size(engine, configs)
    except ConfigError:
        raise
    except ValueError as error:  # the planner's own "does not fit" checks
        raise ConfigError(f"deployment: {_without_advice(error)}") from None
    except AssertionError as error:
        if not _raised_in_vllm(error):
            raise  # kvsim's own assertion: a bug, not bad input
        raise ConfigError(
            f"deployment: tensor_parallel_size {deployment.tensor_parallel_size}, pipeline_parallel_size "
            f"{deployment.pipeline_parallel_size}: vLLM cannot shard {model.name!r} this way "
            f"({_without_advice(error) or 'an assertion failed'})"
        ) from None
    plan = _summarise(engine, layer_specs, configs, deployment, side_cache_layout, applied, notes, source)
    return replace(plan, hash_block_size=hash_block_size)


def _hash_block_size(engine: Any, configs: list[KVCacheConfig]) -> int:
    """vLLM's ``resolve_kv_cache_block_sizes`` on the scheduler's view, as
    the engine core resolves it before building the scheduler. A unit that
    does not divide a prefix-cacheable block, or that cuts a compressed-key
    state, is its ValueError (a one-line ``ConfigError`` above)."""
    scheduler_view = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
    _, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(scheduler_view, engine)
    return int(hash_block_size)


def _raised_in_vllm(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}vllm{os.sep}" in frames[-1].filename


def _without_advice(error: Exception) -> str:
    """vLLM's message up to its generic advice (which names engine flags)."""
    text = " ".join(str(error).split())
    return text.split(" Try increasing")[0].split(" See https")[0]


def _plan_upstream(
    engine: Any, workers: list[dict], memory: list[int], side_cache_layout: bool
) -> tuple[list[KVCacheConfig], bool, list[str], str]:
    kv_cache_layout = engine.cache_config.get_resolved_kv_cache_layout()
    groups = planning.get_global_kv_cache_groups(engine, workers)
    relevant = _has_side_caches(workers)
    blocker = side.side_cache_layout_blocker(engine)
    if not (side_cache_layout and relevant and blocker is None):
        configs = planning.get_kv_cache_configs(engine, workers, memory, groups)
        notes = []
        if side_cache_layout and relevant and blocker is not None:
            notes.append(f"side-cache layout not applicable: {blocker}")
        return configs, False, notes, "vllm planner"
    groups, notes = side.fold_replicated_mamba_groups(groups, workers, kv_cache_layout)
    configs = planning.get_kv_cache_configs(engine, workers, memory, groups)
    slots = side.choose_ring_slots([c.kv_cache_groups for c in configs], kv_cache_layout)
    configs = [side.pack_ring_slots(c, slots, kv_cache_layout) for c in configs]
    notes += [f"QSA ring group {i} packs {s} requests per pool block" for i, s in slots.items()]
    return configs, True, notes, "kvsim side-cache layout on the vllm planner"


def _has_side_caches(workers: list[dict]) -> bool:
    return any(
        (isinstance(spec, MambaSpec) and spec.tp_replicated) or type(spec) is CircularBufferSpec
        for worker in workers
        for spec in worker.values()
    )


def _plan_with_fork(
    engine: Any, workers: list[dict], memory: list[int], side_cache_layout: bool
) -> tuple[list[KVCacheConfig], bool, list[str], str]:
    """The fork's own planner with its switch set (it reads the switch from
    the environment at each call)."""
    fork = fork_planning_module()
    assert fork is not None
    previous = os.environ.get(SIDE_CACHE_SWITCH)
    os.environ[SIDE_CACHE_SWITCH] = "1" if side_cache_layout else "0"
    try:
        clear_vllm_env_cache()
        plan_fn = fork.get_kv_cache_configs
        if len(inspect.signature(plan_fn).parameters) >= 4:
            groups = planning.get_global_kv_cache_groups(engine, workers)
            configs = plan_fn(engine, workers, memory, groups)
        else:
            configs = plan_fn(engine, workers, memory)
    finally:
        if previous is None:
            os.environ.pop(SIDE_CACHE_SWITCH, None)
        else:
            os.environ[SIDE_CACHE_SWITCH] = previous
        clear_vllm_env_cache()
    applied = any(group_slots_per_block(g) > 1 or _is_folded(g) for g in configs[0].kv_cache_groups)
    return configs, applied, ["planned by the installed fork's own side-cache layout"], "fork"


def _is_folded(group: KVCacheGroupSpec) -> bool:
    kinds = {_layer_kind(spec) for spec in group_layer_specs(group)}
    return kinds == {"gdn", "ple"}


def _layer_kind(spec: Any) -> str:
    if isinstance(spec, MambaSpec):
        return "ple" if spec.tp_replicated else "gdn"
    if isinstance(spec, CircularBufferSpec):
        return "ring"
    return "attention"


def group_kind(group: KVCacheGroupSpec) -> str:
    kinds = {_layer_kind(spec) for spec in group_layer_specs(group)}
    if not kinds:
        return _layer_kind(first_layer_spec(group))
    return "+".join(k for k in ("gdn", "ple", "ring", "attention") if k in kinds)


def _summarise(
    engine: Any,
    layer_specs: LayerSpecs,
    configs: list[KVCacheConfig],
    deployment: DeploymentConfig,
    side_cache_layout: bool,
    applied: bool,
    notes: list[str],
    source: str,
) -> KVCachePlan:
    kv_cache_layout = engine.cache_config.get_resolved_kv_cache_layout()
    stage_ranks = tuple(s * deployment.tensor_parallel_size for s in range(deployment.pipeline_parallel_size))
    capacity = side.get_kv_cache_capacity if source != "fork" else _fork_capacity
    tokens, concurrency = capacity(engine, configs[0])
    groups = tuple(
        GroupSummary(
            index=i,
            kind=group_kind(group),
            layers_per_stage=tuple(len(configs[r].kv_cache_groups[i].layer_names) for r in stage_ranks),
            slots_per_block=group_slots_per_block(group),
        )
        for i, group in enumerate(configs[0].kv_cache_groups)
    )
    return KVCachePlan(
        side_cache_layout=side_cache_layout,
        applied=applied,
        source=source,
        engine=engine,
        layer_specs=layer_specs,
        worker_configs=configs,
        stage_ranks=stage_ranks,
        block_size=layer_specs.block_size,
        hash_block_size=layer_specs.block_size,  # resolved by plan_kv_cache
        block_bytes_per_stage=tuple(
            planning._get_kv_cache_bytes_per_block(configs[r].kv_cache_groups, kv_cache_layout)
            for r in stage_ranks
        ),
        num_blocks=configs[0].num_blocks,
        blocks_per_request=side.blocks_per_max_length_request(engine, configs[0]),
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        ring_slots_per_block=max((g.slots_per_block for g in groups if g.kind == "ring"), default=1),
        groups=groups,
        notes=tuple(notes),
    )


def _fork_capacity(engine: Any, config: KVCacheConfig) -> tuple[int, float]:
    fork = fork_planning_module()
    assert fork is not None
    return fork.get_kv_cache_capacity(engine, config)


def format_plan(plan: KVCachePlan, deployment: DeploymentConfig) -> list[str]:
    """The lines the fork's boot log prints for this layout."""
    switch = "1" if plan.side_cache_layout else "0"
    stages = "  ".join(f"PP{stage} {nbytes:,} B" for stage, nbytes in enumerate(plan.block_bytes_per_stage))
    grid = plan.hash_block_size
    hits = f"; prefix hits on a {grid}-token grid" if grid < plan.block_size else ""
    lines = [
        f"[{plan.label}] side-cache layout {plan.label} ({SIDE_CACHE_SWITCH}={switch}; {plan.source})",
        f"  attention block size: {plan.block_size} tokens (Mamba pages padded to the attention page){hits}",
        f"  block bytes per stage: {stages}",
        f"  num_gpu_blocks: {plan.num_blocks}",
        f"  blocks one {deployment.max_model_len:,}-token request holds: {plan.blocks_per_request}",
        f"  GPU KV cache size: {plan.kv_cache_tokens:,} tokens, Maximum concurrency for "
        f"{deployment.max_model_len:,} tokens per request: {plan.max_concurrency:.2f}x",
        "  groups: "
        + ", ".join(
            f"{g.index}:{g.kind}[{'/'.join(map(str, g.layers_per_stage))}]"
            + (f"x{g.slots_per_block} slots" if g.slots_per_block > 1 else "")
            for g in plan.groups
        ),
    ]
    lines += [f"  side-cache layout: {note}" for note in plan.notes]
    return lines
