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


def hybrid_block_size(
    mamba_page_bytes: int, attn_page_bytes_per_token: int, alignment: int, requested: int | None = None
) -> int:
    """Smallest multiple of ``alignment`` whose attention page holds the
    largest Mamba state page (vLLM's hybrid block-size rule, non-"all" modes).

    A requested ``--block-size`` becomes the alignment when it is larger
    (``Platform._align_hybrid_block_size`` takes the max of the kernel's
    block and the configured one), so it is kept when the Mamba page fits
    and doubled, tripled, ... when it does not; the result is then a
    multiple of the kernel alignment.

    >>> hybrid_block_size(1_634_304, 512, 16)   # Flash-Next, fp32 SSM state
    3200
    >>> hybrid_block_size(847_872, 512, 16)     # fp16 SSM state
    1664
    >>> hybrid_block_size(1_732_992, 512, 16)   # fp32 with RecoverSSM's replay record
    3392
    >>> hybrid_block_size(1_732_992, 512, 16, requested=4096)  # the fork's --block-size 4096
    4096
    >>> hybrid_block_size(1_732_992, 512, 16, requested=2048)  # too small: two of them
    4096
    """
    step = max(alignment, requested or 0)
    block = step * cdiv(mamba_page_bytes, step * attn_page_bytes_per_token)
    return alignment * cdiv(block, alignment)


def uses_recoverssm(model: ModelConfig, deployment: DeploymentConfig) -> bool:
    """The fork's predicate (patch 0072): ``--use-replayssm`` with MTP drafts.
    Without drafts the fork falls back to the stock state path (patch 0085)."""
    return deployment.use_replayssm and model.mtp.num_speculative_tokens > 0


def recoverssm_replay_shape(model: ModelConfig, deployment: DeploymentConfig) -> tuple[int, int, int]:
    """The per-layer replay record RecoverSSM adds to a GDN state page
    (patch 0072, fp32): per value head on this rank, per position of the
    verify window (K drafts + 1), the correction (V floats), the normalised
    key (K floats) and the log-decay (1 float).

    >>> from sim.paths import DEFAULT_MODEL
    >>> from sim.config import load_model
    >>> recoverssm_replay_shape(load_model(DEFAULT_MODEL), DeploymentConfig())
    (24, 4, 257)
    """
    gdn = model.gdn
    return (
        gdn.num_value_heads // deployment.tensor_parallel_size,
        model.mtp.num_speculative_tokens + 1,
        gdn.value_head_dim + gdn.key_head_dim + 1,
    )


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
    shapes = tuple(
        MambaStateShapeCalculator.gated_delta_net_state_shape(
            deployment.tensor_parallel_size,
            gdn.num_key_heads,
            gdn.num_value_heads,
            gdn.key_head_dim,
            gdn.value_head_dim,
            gdn.conv_kernel,
            k,
        )
    )
    dtypes: tuple[torch.dtype, ...] = (
        TORCH_DTYPES[gdn.conv_state_dtype],
        TORCH_DTYPES[model.ssm_state_dtype],
    )
    recoverssm = uses_recoverssm(model, deployment)
    if recoverssm:
        shapes += (recoverssm_replay_shape(model, deployment),)
        dtypes += (torch.float32,)
    # RecoverSSM verifies drafts from one checkpoint: no per-draft state
    # blocks for any Mamba layer (patch 0071, MambaBase.get_kv_cache_spec).
    spec_blocks = 0 if recoverssm else k
    gdn_spec = MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=block_size,
        page_size_padded=padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=model.mamba_cache_mode,
        num_speculative_blocks=spec_blocks,
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
        num_speculative_blocks=spec_blocks,
    )
    return gdn_spec, ple_spec


def layer_specs(model: ModelConfig, deployment: DeploymentConfig) -> LayerSpecs:
    """Every spec of the model at the hybrid block size, Mamba pages padded."""
    attn_per_token = _attention_spec(model, deployment, 1).page_size_bytes
    gdn, ple = _mamba_specs(model, deployment, -1, None)
    mamba_page = max(s.page_size_bytes for s in (gdn, ple) if s is not None)
    block = hybrid_block_size(
        mamba_page, attn_per_token, model.kernel_block_alignment, requested=deployment.block_size
    )
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
