"""The one package that imports vLLM (this module, and `scheduler` for `kvsim conform`).

Everything kvsim drives of vLLM (its spec classes, its planner, its
``BlockPool``/``KVCacheManager``/managers, its ``Request``) is imported here
and re-exported, so the rest of kvsim never touches vLLM directly and an
engineer can see at a glance which internals kvsim depends on.

It also prepares the process for importing vLLM on a CPU-only machine, reports
which vLLM is installed (upstream, or the fork with the side-cache layout), and
is the only place that builds vLLM's engine-config object.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


def _prepare_environment() -> None:
    """Set what vLLM needs before its first import on a CPU-only machine.

    ``VLLM_TARGET_DEVICE=cpu`` lets config code infer a device; a fresh cache
    root keeps a stale compile cache from hiding a missing module; the log
    level keeps vLLM's INFO lines out of kvsim's own output.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="kvsim-vllm-cache-")


_prepare_environment()

# ruff: noqa: E402  (imports must follow the environment set-up above)
import vllm
from vllm.distributed.kv_events import BlockRemoved
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core import kv_cache_planning as planning
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.core.single_type_kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    compute_layout_strides,
    get_kv_quant_mode,
    get_mamba_prefill_checkpoint_position,
    iter_layer_specs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.request import Request, RequestStatus

__all__ = [
    "AttentionSpec",
    "BlockPool",
    "CircularBufferManager",
    "CircularBufferSpec",
    "FullAttentionManager",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheSpecRegistry",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaAlignedSplit",
    "MambaAttentionBackendEnum",
    "MambaManager",
    "MambaSpec",
    "MambaStateShapeCalculator",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SingleTypeKVCacheManager",
    "UniformTypeKVCacheSpecs",
    "VllmInfo",
    "BlockRemoved",
    "cdiv",
    "clear_vllm_env_cache",
    "check_stop",
    "compute_layout_strides",
    "engine_config",
    "get_kv_quant_mode",
    "get_mamba_prefill_checkpoint_position",
    "get_request_block_hasher",
    "init_none_hash",
    "iter_layer_specs",
    "kv_cache_utils",
    "planning",
    "sha256",
    "vllm_info",
    "watch_hash_insertions",
    "worker_api",
]

# The fork's patch 0088 adds these; upstream 0.33.0 has none of them.
_FORK_MARKERS = ("_apply_side_cache_layout", "_choose_ring_slots")
SIDE_CACHE_SWITCH = "VLLM_E2_SIDE_CACHE_LAYOUT"


@dataclass(frozen=True, kw_only=True)
class VllmInfo:
    version: str
    path: str
    has_side_cache_layout: bool

    @property
    def flavour(self) -> str:
        return "fork (side-cache layout built in)" if self.has_side_cache_layout else ("upstream")

    def describe(self) -> str:
        return f"vllm {self.version} ({self.flavour}) from {self.path}"


def fork_planning_module() -> Any | None:
    """The fork's module that holds its side-cache layout pass, if installed."""
    for module in (kv_cache_utils, planning):
        if all(hasattr(module, name) for name in _FORK_MARKERS):
            return module
    return None


def clear_vllm_env_cache() -> None:
    """Make vLLM re-read its environment switches (it caches them)."""
    cache_clear = getattr(getattr(vllm.envs, "__getattr__", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def vllm_info() -> VllmInfo:
    return VllmInfo(
        version=str(getattr(vllm, "__version__", "unknown")),
        path=os.path.dirname(vllm.__file__ or ""),
        has_side_cache_layout=fork_planning_module() is not None,
    )


def engine_config(
    *,
    max_model_len: int,
    max_num_seqs: int,
    num_speculative_tokens: int,
    pipeline_parallel_size: int,
    tensor_parallel_size: int,
    kv_cache_layout: str = "BLNHC",
    num_gpu_blocks_override: int | None = None,
    mamba_cache_mode: str = "align",
    kv_transfer_config: Any = None,
    hisparse_config: Any = None,
    decode_context_parallel_size: int = 1,
    total_num_hidden_layers: int = 48,
    block_size: int = 16,
    prefix_match_unit: int | None = None,
    enable_prefix_caching: bool = True,
) -> SimpleNamespace:
    """The engine-config object vLLM's planner and capacity code read.

    A real ``VllmConfig`` needs a model checkpoint and a device; the planner
    only reads the attributes below, so kvsim hands it this stand-in (the
    approach vLLM's and the fork's own CPU tests take). Every attribute here
    is one the 0.33.0 planner reads.
    """
    cache = _cache_config(
        block_size=block_size,
        prefix_match_unit=prefix_match_unit,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_layout=kv_cache_layout,
        num_gpu_blocks_override=num_gpu_blocks_override,
        mamba_cache_mode=mamba_cache_mode,
    )
    return SimpleNamespace(
        cache_config=cache,
        num_prefill_lookahead_tokens=0,
        speculative_config=_mtp_config(num_speculative_tokens) if num_speculative_tokens else None,
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False,
            max_num_encoder_input_tokens=0,
            max_num_seqs=max_num_seqs,
        ),
        attention_config=SimpleNamespace(hisparse_config=hisparse_config),
        model_config=SimpleNamespace(
            original_max_model_len=max_model_len,
            max_model_len=max_model_len,
            hf_config=SimpleNamespace(model_type="qwen4_exp"),
            get_total_num_hidden_layers=lambda: total_num_hidden_layers,
            supports_kv_cache_grouping=False,
        ),
        device_config=SimpleNamespace(device_type="cuda"),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
        ),
        kv_transfer_config=kv_transfer_config,
    )


def _cache_config(*, kv_cache_layout: str, **fields: Any) -> SimpleNamespace:
    """The cache config of ``engine_config``: the resolved block and the
    prefix-hit grid as ``resolve_kv_cache_block_sizes`` reads them, and the
    memory order."""
    resolved = KVCacheLayout[kv_cache_layout]
    return SimpleNamespace(
        **fields,
        kv_cache_layout=kv_cache_layout,
        prefix_cache_retention_interval=0,
        get_resolved_kv_cache_layout=lambda: resolved,
    )


def _mtp_config(num_speculative_tokens: int) -> SimpleNamespace:
    """The speculative config of ``engine_config``: single-module MTP with
    the EAGLE block drop, as the fork serves it."""
    return SimpleNamespace(
        num_speculative_tokens=num_speculative_tokens,
        method="mtp",
        use_multi_module_mtp=lambda: False,
        use_eagle=lambda: True,
        use_eagle_block_drop=lambda: True,
    )


class MambaAlignedSplit:
    """vLLM's own ``Scheduler._mamba_block_aligned_split`` and
    ``Scheduler._reserve_prefill_lookahead``, bound to the few scheduler
    attributes they read (0.33.0), so kvsim's scheduler clips prefill chunks
    exactly where vLLM's does without building a whole ``Scheduler``.

    No prefill checkpoint blocks and no shared-prefix junction: the
    Flash-Next deployment's settings. The hash block (the prefix-match unit)
    and whether the managers take partial hits on it are the caller's, as
    are the MTP hashing (EAGLE block drop or lookahead hashes).
    """

    def __init__(
        self,
        *,
        block_size: int,
        max_num_scheduled_tokens: int,
        long_prefill_token_threshold: int = 0,
        use_eagle_block_drop: bool = True,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead_tokens: int = 0,
        hash_block_size: int | None = None,
        partial_hash_hits: bool = False,
    ) -> None:
        hash_block_size = block_size if hash_block_size is None else hash_block_size
        self._scheduler = SimpleNamespace(
            block_size=block_size,
            hash_block_size=hash_block_size,
            cache_config=SimpleNamespace(block_size=block_size),
            use_eagle_block_drop=use_eagle_block_drop,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead_tokens,
            max_num_scheduled_tokens=max_num_scheduled_tokens,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=long_prefill_token_threshold),
            # Scheduler.__init__'s rule (align mode is the model's only mode).
            mamba_partial_cache_hit=partial_hash_hits and hash_block_size < block_size,
            mamba_shared_prefix_checkpoint=False,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None,
        )

    def __call__(self, request: Request, num_new_tokens: int, num_new_local_computed_tokens: int = 0) -> int:
        # Called unbound on the stand-in: only the attributes above are read.
        return Scheduler._mamba_block_aligned_split(
            self._scheduler,  # type: ignore[arg-type]
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
        )

    def reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """Never end a chunk within the drafter's prefill runway of the end."""
        return Scheduler._reserve_prefill_lookahead(
            self._scheduler,  # type: ignore[arg-type]
            request,
            num_computed_tokens,
            num_new_tokens,
        )


def worker_api() -> SimpleNamespace:
    """vLLM's worker-side names kvsim binds views with, imported on first
    use: only the worker-view checks need them, and importing vLLM's worker
    utilities logs kernel-library warnings on a CPU machine."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer, allocate_kv_cache

    return SimpleNamespace(
        MambaBase=MambaBase,
        AttentionBackend=AttentionBackend,
        AttentionGroup=AttentionGroup,
        KVBlockZeroer=KVBlockZeroer,
        allocate_kv_cache=allocate_kv_cache,
    )


def watch_hash_insertions(block_pool: BlockPool, inserted: Callable[[Any], None]) -> None:
    """Call ``inserted(key)`` after each (hash, block) pair ``block_pool``
    puts into its cached-hash map that the map lacked (a call for a pair it
    holds inserts nothing: vLLM returns at once).

    The one instrumented private of vLLM, and why: vLLM offers no other
    door. Every insertion into ``cached_block_hash_to_block`` (full blocks,
    partial units, a copy-on-write's moved hashes) goes through
    ``BlockPool._insert_block_hash``, the pool is built inside vLLM's
    coordinator (no class to pass in), and its KV events are drained once a
    step and name no moved hash, while the fast path's missed-lookup memo
    (``sim/sched/fast_path/missed_lookups.py``) must see an insertion before the next
    lookup. The map is read through ``block_pool`` each call: a prefix-cache
    reset replaces the map, not this method."""
    insert = block_pool._insert_block_hash

    def watched(key: Any, block: KVCacheBlock, *args: Any, **kwargs: Any) -> None:
        held = block_pool.cached_block_hash_to_block.contain(key, block.block_id)
        insert(key, block, *args, **kwargs)
        if not held:
            inserted(key)

    block_pool._insert_block_hash = watched  # type: ignore[method-assign,assignment]
