"""vLLM's own ``Scheduler``, built from a real ``VllmConfig``: the second
scheduler backend ``kvsim conform`` compares kvsim's scheduler with.

Imported only by the conformance backend (``sim.conformance``); nothing else
in kvsim imports this module, so a vLLM whose ``Scheduler`` cannot be built
this way (the fork's, a future version) breaks ``kvsim conform`` only.

A real ``VllmConfig`` needs a model directory. Flash-Next's model module
cannot be imported here (it needs ``compressed_tensors``), and the Scheduler
reads only generic model fields (``max_model_len``, runner type, multimodal
support), so the config is built from a small stand-in HF ``config.json``
(no weights) whose architecture, MiMo, maps to an importable target and an
importable MTP draft model (``MiMoMTPModel``), which lets the MTP speculative
config validate. The KV cache groups are not the model's: the Scheduler is
given kvsim's scheduler-side ``KVCacheConfig`` of the deployment's plan.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config import SchedulerConfig as VllmSchedulerConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from sim.vllm_bridge import (
    KVCacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    get_request_block_hasher,
    init_none_hash,
    kv_cache_utils,
)
from sim.vllm_bridge.fork_server import register_stand_in_models, stand_in_model_dir

__all__ = [
    "DraftTokenIds",
    "ModelRunnerOutput",
    "Scheduler",
    "VllmSchedulerSettings",
    "build_vllm_config",
    "build_vllm_scheduler",
    "make_request",
]


@dataclass(frozen=True, kw_only=True)
class VllmSchedulerSettings:
    """The engine arguments the comparison starts vLLM's engine with."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    scheduler_reserve_full_isl: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    block_size: int
    num_speculative_tokens: int
    enable_prefix_caching: bool
    mtp_hash_mode: Literal["eagle-drop", "lookahead"]
    # --prefix-match-unit (None: hits on the block).
    prefix_match_unit: int | None = None


@contextlib.contextmanager
def _vllm_log_level() -> Iterator[None]:
    """vLLM's loggers at the level the bridge asked for (its logging set-up
    is not applied in this process, so its config warnings would print)."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
    try:
        yield
    finally:
        logger.setLevel(level)


def build_vllm_config(settings: VllmSchedulerSettings) -> VllmConfig:
    """A real ``VllmConfig``: model, TP x PP, scheduler, cache (align mode,
    prefix caching), MTP with K drafts. ``eagle-drop`` is vLLM's
    ``disable_lookahead_block_hashes=True``; ``lookahead`` its default."""
    with _vllm_log_level():
        return _build_vllm_config(settings)


def _build_vllm_config(settings: VllmSchedulerSettings) -> VllmConfig:
    register_stand_in_models()
    model = ModelConfig(
        model=stand_in_model_dir(settings.max_model_len),
        skip_tokenizer_init=True,
        max_model_len=settings.max_model_len,
        dtype="bfloat16",
    )
    parallel = ParallelConfig(
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
    )
    # A model without drafts is started without --speculative-config
    # (vLLM's SpeculativeConfig refuses zero speculative tokens).
    speculative = (
        SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=settings.num_speculative_tokens,
            target_model_config=model,
            target_parallel_config=parallel,
            disable_lookahead_block_hashes=settings.mtp_hash_mode == "eagle-drop",
        )
        if settings.num_speculative_tokens
        else None
    )
    return VllmConfig(
        model_config=model,
        parallel_config=parallel,
        cache_config=CacheConfig(
            block_size=settings.block_size,
            mamba_cache_mode="align",
            enable_prefix_caching=settings.enable_prefix_caching,
            prefix_match_unit=settings.prefix_match_unit,
        ),
        scheduler_config=VllmSchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            scheduler_reserve_full_isl=settings.scheduler_reserve_full_isl,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        speculative_config=speculative,
    )


def build_vllm_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, scheduler_cls: type[Any] | None = None
) -> Scheduler:
    """vLLM's ``Scheduler`` (or ``scheduler_cls``, e.g. the one the config
    selects) over ``kv_cache_config``, built the way its engine core builds
    it (the pool size set on the cache config first)."""
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size = vllm_config.cache_config.block_size
    # The hash block (the prefix-match unit) as the engine core resolves it.
    _, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    with _vllm_log_level():
        return (scheduler_cls or Scheduler)(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )


def request_block_hasher(vllm_config: VllmConfig, hash_block_size: int | None = None) -> Any:
    """The block hasher vLLM's engine core gives every request (on the
    scheduler's hash block; the block size when not given)."""
    cache = vllm_config.cache_config
    caching_hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
    init_none_hash(caching_hash_fn)
    return get_request_block_hasher(
        hash_block_size or cache.block_size, caching_hash_fn, vllm_config.num_hash_lookahead_tokens
    )


def make_request(
    *, request_id: str, prompt_token_ids: list[int], max_tokens: int, arrival_s: float, block_hasher: Any
) -> Request:
    """A request as vLLM's input processor would hand it over (trace replay:
    EOS ignored, ``max_tokens`` = the trace's output length)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival_s,
        block_hasher=block_hasher,
    )
