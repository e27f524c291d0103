"""Per-worker KV-cache specs of a Flash-Next-shaped model, built with vLLM's
own spec classes.

What the fork's workers report from ``get_kv_cache_spec`` at boot: for every
rank (TP x PP), one spec per cache-owning layer. The block size is raised the
way vLLM's ``Platform._align_hybrid_block_size`` raises it for hybrid models
(an attention page must cover the largest Mamba state page, and every Mamba
page is padded to the attention page): 3,200 tokens at fp32 SSM state and
1,664 at fp16 for Flash-Next, as the fork's boot logs say.

Layer names follow the fork's module names, so a group listing reads like the
fork's own (``language_model.model.layers.3.self_attn.attn``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sim.config import DeploymentConfig, ModelConfig, check_partition
from sim.vllm_bridge import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaAttentionBackendEnum,
    MambaSpec,
    MambaStateShapeCalculator,
    MLAAttentionSpec,
    cdiv,
    get_kv_quant_mode,
)

TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.uint8,  # fp8 KV is stored as bytes, scaled per tensor
}

LAYER_PREFIX = "language_model.model.layers"
MTP_PREFIX = "mtp.layers"


def hybrid_block_size(mamba_page_bytes: int, attn_page_bytes_per_token: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` whose attention page holds the
    largest Mamba state page (vLLM's hybrid block-size rule, non-"all" modes).

    >>> hybrid_block_size(1_634_304, 512, 16)   # Flash-Next, fp32 SSM state
    3200
    >>> hybrid_block_size(847_872, 512, 16)     # fp16 SSM state
    1664
    """
    return alignment * cdiv(mamba_page_bytes, alignment * attn_page_bytes_per_token)


@dataclass(frozen=True, kw_only=True)
class LayerSpecs:
    """The specs of one model at one block size, shared by every layer."""

    block_size: int
    attention: FullAttentionSpec
    compressed_keys: MLAAttentionSpec
    draft_attention: FullAttentionSpec
    draft_compressed_keys: MLAAttentionSpec
    ring: CircularBufferSpec
    draft_ring: CircularBufferSpec
    gdn: MambaSpec
    ple: MambaSpec | None


def _attention_spec(model: ModelConfig, deployment: DeploymentConfig, block_size: int) -> FullAttentionSpec:
    attn = model.qsa.attention
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=max(1, attn.num_kv_heads // deployment.tensor_parallel_size),
        head_size=attn.head_size,
        head_size_v=attn.head_size,
        dtype=TORCH_DTYPES[attn.kv_cache_dtype],
        kv_quant_mode=get_kv_quant_mode("fp8_e4m3" if attn.kv_cache_dtype == "fp8_e4m3" else "auto"),
    )


def _mamba_specs(
    model: ModelConfig, deployment: DeploymentConfig, block_size: int, padded: int | None
) -> tuple[MambaSpec, MambaSpec | None]:
    k = model.mtp.num_speculative_tokens
    gdn = model.gdn
    gdn_spec = MambaSpec(
        shapes=tuple(
            MambaStateShapeCalculator.gated_delta_net_state_shape(
                deployment.tensor_parallel_size,
                gdn.num_key_heads,
                gdn.num_value_heads,
                gdn.key_head_dim,
                gdn.value_head_dim,
                gdn.conv_kernel,
                k,
            )
        ),
        dtypes=(TORCH_DTYPES[gdn.conv_state_dtype], TORCH_DTYPES[model.ssm_state_dtype]),
        block_size=block_size,
        page_size_padded=padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=model.mamba_cache_mode,
        num_speculative_blocks=k,
    )
    if model.ple is None:
        return gdn_spec, None
    ple = model.ple
    ple_spec = MambaSpec(
        shapes=tuple(
            MambaStateShapeCalculator.short_conv_state_shape(
                tp_world_size=1 if ple.tp_replicated else deployment.tensor_parallel_size,
                intermediate_size=ple.intermediate_size,
                conv_kernel=ple.conv_kernel,
                num_spec=k,
            )
        ),
        dtypes=(TORCH_DTYPES[ple.state_dtype],),
        block_size=block_size,
        page_size_padded=padded,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        mamba_cache_mode=model.mamba_cache_mode,
        tp_replicated=ple.tp_replicated,
        num_speculative_blocks=k,
    )
    return gdn_spec, ple_spec


def layer_specs(model: ModelConfig, deployment: DeploymentConfig) -> LayerSpecs:
    """Every spec of the model at the hybrid block size, Mamba pages padded."""
    attn_per_token = _attention_spec(model, deployment, 1).page_size_bytes
    gdn, ple = _mamba_specs(model, deployment, -1, None)
    mamba_page = max(s.page_size_bytes for s in (gdn, ple) if s is not None)
    block = hybrid_block_size(mamba_page, attn_per_token, model.kernel_block_alignment)
    attn_page = block * attn_per_token
    gdn, ple = _mamba_specs(model, deployment, block, attn_page)
    attention = _attention_spec(model, deployment, block)
    keys = model.qsa.compressed_keys
    compressed = MLAAttentionSpec(
        block_size=block,
        num_kv_heads=1,
        head_size=keys.head_size,
        dtype=TORCH_DTYPES[keys.dtype],
        tokens_per_state=keys.tokens_per_state,
    )
    ring_cfg = model.qsa.raw_key_ring
    ring = CircularBufferSpec(
        block_size=ring_cfg.capacity_tokens,
        num_kv_heads=1,
        head_size=ring_cfg.head_size,
        head_size_v=0,
        dtype=TORCH_DTYPES[ring_cfg.dtype],
    )
    # The worker marks the MTP module's layers as draft layers (is_draft); the
    # flag is excluded from spec equality, so grouping is unchanged.
    return LayerSpecs(
        block_size=block,
        attention=attention,
        compressed_keys=compressed,
        draft_attention=replace(attention, is_draft=True),
        draft_compressed_keys=replace(compressed, is_draft=True),
        ring=ring,
        draft_ring=replace(ring, is_draft=True),
        gdn=gdn,
        ple=ple,
    )


def _qsa_layer(prefix: str, specs: LayerSpecs, draft: bool) -> dict[str, KVCacheSpec]:
    return {
        f"{prefix}.self_attn.indexer.raw_key_cache": specs.draft_ring if draft else specs.ring,
        f"{prefix}.self_attn.indexer.compressed_key_cache": specs.draft_compressed_keys
        if draft
        else specs.compressed_keys,
        f"{prefix}.self_attn.attn": specs.draft_attention if draft else specs.attention,
    }


def stage_specs(
    model: ModelConfig, specs: LayerSpecs, first: int, last: int, with_mtp: bool
) -> dict[str, KVCacheSpec]:
    """Specs of the layers ``first <= i < last`` (plus MTP on the last stage)."""
    out: dict[str, KVCacheSpec] = {}
    for index in range(first, last):
        prefix = f"{LAYER_PREFIX}.{index}"
        if model.ple is not None and index == model.ple.layer:
            assert specs.ple is not None
            out[f"{prefix}.ple"] = specs.ple
        if model.is_qsa_layer(index):
            out.update(_qsa_layer(prefix, specs, draft=False))
        else:
            out[f"{prefix}.linear_attn"] = specs.gdn
    if with_mtp:
        for offset in range(model.mtp.num_layers):
            prefix = f"{MTP_PREFIX}.{model.num_layers + offset}"
            out.update(_qsa_layer(prefix, specs, draft=True))
    return out


def build_worker_specs(
    model: ModelConfig, deployment: DeploymentConfig
) -> tuple[LayerSpecs, list[dict[str, KVCacheSpec]]]:
    """One spec dict per rank, in vLLM's rank order (rank = pp * TP + tp)."""
    check_partition(model, deployment)
    specs = layer_specs(model, deployment)
    workers: list[dict[str, KVCacheSpec]] = []
    first = 0
    num_stages = deployment.pipeline_parallel_size
    for stage, num_layers in enumerate(deployment.layer_partition):
        stage_dict = stage_specs(model, specs, first, first + num_layers, stage == num_stages - 1)
        workers.extend(stage_dict for _ in range(deployment.tensor_parallel_size))
        first += num_layers
    return specs, workers
