"""Qwen3.8-Flash-Next's architecture as released, and its parameters per module.

No twin in vLLM: the step-time model needs what each module weighs, and
this module derives it from the released text config's numbers
(``scenarios/models/flash-next-architecture.yaml``) with the shapes of the
real model definition (transformers 5.20.2 ``modeling_qwen4_exp``, vLLM
0.33.0 ``vllm/models/qwen4_exp/nvidia/mtp.py``). ``tests/test_model_arch.py``
instantiates that definition on the meta device and checks every count here
against it, and against a hand count of one layer of each kind.

Parameters are grouped by how the rig stores them (``QUANT_GROUPS``), so a
quantization scheme can give each group its bytes per parameter.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from sim.config import ConfigError, StrictModel, read_yaml, validate
from sim.paths import SCENARIOS_DIR

DEFAULT_ARCHITECTURE = SCENARIOS_DIR / "models" / "flash-next-architecture.yaml"

# How the deployment stores each group (a quantization scheme maps every
# one to bits per parameter; sim.step_time reads them).
QUANT_GROUPS = (
    "routed_experts",  # one expert: gate, up and down projections
    "shared_expert",  # the gated shared expert and its gate
    "router",
    "gdn_projections",  # in_proj_qkv, in_proj_z, out_proj (INT8 on the rig)
    "gdn_small",  # in_proj_a/b, conv, A_log, dt_bias, norm
    "attention",  # QSA q (with the output gate), k, v, o and their norms
    "indexer",  # QSA indexer projection and norms
    "hyper_connections",  # two gated residuals per layer (TP-replicated)
    "ple_module",  # PLE key/value projections, norms, conv
    "ple_table",  # the hashed n-gram table (host memory on the rig)
    "embed_tokens",  # host memory on the rig
    "lm_head",
    "final_mixer",  # the hyper-connection mixer before the LM head
    "mtp_fusion",  # MTP fc_embedding, fc_hidden, pre-fc norms, its mixer
)


class Architecture(StrictModel):
    """The released text config (Qwen4ExpTextConfig's key names)."""

    name: str
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    full_attention_interval: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    partial_rotary_factor: float = Field(gt=0, le=1)
    indexer_n_heads: int = Field(gt=0)
    indexer_kv_heads: int = Field(gt=0)
    indexer_head_dim: int = Field(gt=0)
    indexer_budget: int = Field(gt=0)
    indexer_compress_ratio: int = Field(gt=0)
    linear_num_key_heads: int = Field(gt=0)
    linear_num_value_heads: int = Field(gt=0)
    linear_key_head_dim: int = Field(gt=0)
    linear_value_head_dim: int = Field(gt=0)
    linear_conv_kernel_dim: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    shared_expert_intermediate_size: int = Field(gt=0)
    hc_count: int = Field(gt=1)
    hc_lowrank: int = Field(gt=0)
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int = Field(gt=0)
    ple_conv_kernel_size: int = Field(gt=0)
    ngram_size: int = Field(gt=1)
    heads_per_ngram: int = Field(gt=0)
    ngram_vocab_size_base: int = Field(gt=0)
    ple_table_rows: int = Field(ge=0)
    mtp_num_hidden_layers: int = Field(ge=0)

    def is_qsa_layer(self, index: int) -> bool:
        """0-based; Qwen4ExpTextConfig: ``(i + 1) % interval == 0`` is attention."""
        return (index + 1) % self.full_attention_interval == 0

    def is_ple_layer(self, index: int) -> bool:
        return index + 1 in self.ple_layer_ids

    @property
    def hc_hidden_size(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram


def load_architecture(path: Path = DEFAULT_ARCHITECTURE) -> Architecture:
    return validate(Architecture, read_yaml(path), str(path))


def _gated_residual(a: Architecture, combine: bool) -> int:
    """One hyper-connection: group norm, low-rank down and up mix, and (in a
    layer) the per-stream inject weights."""
    wide = a.hc_hidden_size
    return wide + 2 * wide * a.hc_lowrank + (wide * a.hc_count if combine else 0)


def _gdn(a: Architecture) -> dict[str, int]:
    key_dim = a.linear_num_key_heads * a.linear_key_head_dim
    value_dim = a.linear_num_value_heads * a.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    heads = a.linear_num_value_heads
    return {
        "gdn_projections": a.hidden_size * conv_dim + 2 * a.hidden_size * value_dim,  # qkv, z, out
        # in_proj_a/b, depthwise conv, A_log, dt_bias, gated norm
        "gdn_small": 2 * a.hidden_size * heads
        + conv_dim * a.linear_conv_kernel_dim
        + 2 * heads
        + a.linear_value_head_dim,
    }


def _qsa(a: Architecture) -> dict[str, int]:
    q_width = a.num_attention_heads * a.head_dim
    kv_width = a.num_key_value_heads * a.head_dim
    return {
        # q doubled for the output gate; k, v; o; q_norm, k_norm
        "attention": a.hidden_size * 2 * q_width
        + 2 * a.hidden_size * kv_width
        + q_width * a.hidden_size
        + 2 * a.head_dim,
        "indexer": a.hidden_size * (a.indexer_n_heads + a.indexer_kv_heads) * a.indexer_head_dim
        + 2 * a.indexer_head_dim,
    }


def _moe(a: Architecture) -> dict[str, int]:
    """``routed_experts`` is ONE expert: the step-time model multiplies by
    the experts a batch touches."""
    return {
        "routed_experts": 3 * a.hidden_size * a.moe_intermediate_size,
        "shared_expert": 3 * a.hidden_size * a.shared_expert_intermediate_size + a.hidden_size,
        "router": a.num_experts * a.hidden_size,
    }


def layer_params(a: Architecture, index: int) -> dict[str, int]:
    """Parameters of decoder layer ``index`` (0-based) by group, the PLE
    module and its table excluded (``ple_params``)."""
    mixer = _gdn(a) if not a.is_qsa_layer(index) else _qsa(a)
    return {**mixer, **_moe(a), "hyper_connections": 2 * _gated_residual(a, combine=True)}


def ple_params(a: Architecture) -> dict[str, int]:
    """One PLE module: projections, three group norms, depthwise conv, and
    its n-gram table (``ple_table``, one row of ``ple_embed_dim / heads``)."""
    wide = a.hc_hidden_size
    return {
        "ple_module": a.ple_embed_dim * wide
        + a.ple_embed_dim * a.hidden_size
        + 3 * wide
        + wide * a.ple_conv_kernel_size,
        "ple_table": a.ple_table_rows * (a.ple_embed_dim // a.ngram_heads),
    }


def mtp_layer_params(a: Architecture) -> dict[str, int]:
    """The MTP module (vLLM's Qwen4ExpMultiTokenPredictor): one QSA decoder
    layer plus the fusion of the backbone hidden with the token embedding
    (fc_embedding, fc_hidden, two pre-fc norms, a final mixer). It shares
    the token embedding and the LM head with the main model."""
    h = a.hidden_size
    fusion = 2 * h * h + h + a.hc_hidden_size + _gated_residual(a, combine=False)
    return {**layer_params(a, a.full_attention_interval - 1), "mtp_fusion": fusion}


def model_params(a: Architecture) -> dict[str, int]:
    """Outside the layers: token embedding, LM head, final mixer."""
    return {
        "embed_tokens": a.vocab_size * a.hidden_size,
        "lm_head": a.vocab_size * a.hidden_size,
        "final_mixer": _gated_residual(a, combine=False),
    }


def total_params(a: Architecture, *, with_table: bool = True) -> int:
    """Every parameter of the main model (all experts; no MTP)."""
    total = sum(model_params(a).values())
    for index in range(a.num_hidden_layers):
        layer = layer_params(a, index)
        total += sum(layer.values()) + (a.num_experts - 1) * layer["routed_experts"]
        if a.is_ple_layer(index):
            ple = ple_params(a)
            total += ple["ple_module"] + (ple["ple_table"] if with_table else 0)
    return total


def active_params_per_token(a: Architecture) -> int:
    """What one token multiplies through in the main model: its top-k
    experts, every dense weight and the LM head (not the token embedding
    or the n-gram table, which are looked up)."""
    total = model_params(a)["lm_head"] + model_params(a)["final_mixer"]
    for index in range(a.num_hidden_layers):
        layer = layer_params(a, index)
        total += sum(layer.values()) + (a.num_experts_per_tok - 1) * layer["routed_experts"]
        if a.is_ple_layer(index):
            total += ple_params(a)["ple_module"]
    return total


def check_tensor_parallel(a: Architecture, tp: int) -> None:
    """vLLM's rule for a TP degree (``ColumnParallelLinear`` shards heads
    whole; ``QKVParallelLinear`` replicates KV heads when there are fewer
    than ranks): every sharded head count divides by ``tp``, and the QSA KV
    heads either divide by ``tp`` or divide it. ``ConfigError`` naming the
    heads otherwise."""
    sharded = {
        "QSA query heads": a.num_attention_heads,
        "GDN key heads": a.linear_num_key_heads,
        "GDN value heads": a.linear_num_value_heads,
    }
    for what, heads in sharded.items():
        if heads % tp:
            raise ConfigError(f"{tp} does not divide the model's {heads} {what} ({a.name})")
    kv = a.num_key_value_heads
    if (kv % tp) if kv >= tp else (tp % kv):
        raise ConfigError(f"{tp} and the model's {kv} QSA KV heads: neither divides the other ({a.name})")
