"""The parameters kvsim's clock weighs, per module, against the real model
definition (transformers' qwen4_exp text model on the meta device) and a
hand count of one layer of each kind."""

from __future__ import annotations

from collections import Counter

import pytest

from sim import model_arch as m

ARCH = m.load_architecture()

# transformers' parameter name (after "layers.N.") -> kvsim's group.
GROUP_OF = {
    "linear_attn.in_proj_qkv": "gdn_projections",
    "linear_attn.in_proj_z": "gdn_projections",
    "linear_attn.out_proj": "gdn_projections",
    "linear_attn": "gdn_small",
    "self_attn.indexer": "indexer",
    "self_attn": "attention",
    "mlp.experts": "routed_experts",
    "mlp.gate": "router",
    "mlp.shared_expert": "shared_expert",
    "attn_hyper_connection": "hyper_connections",
    "mlp_hyper_connection": "hyper_connections",
    "ple.ple_embedding": "ple_table",
    "ple": "ple_module",
}


def _group(name: str) -> str:
    return next(group for prefix, group in GROUP_OF.items() if name.startswith(prefix))


@pytest.fixture(scope="module")
def meta_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextModel

    a = ARCH
    values = {k: getattr(a, k) for k in m.Architecture.model_fields if k not in _NOT_HF}
    config = transformers.Qwen4ExpTextConfig(
        **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=1,
        output_gate_type="sigmoid",
    )
    with torch.device("meta"):
        return Qwen4ExpTextModel(config)


_NOT_HF = {"name", "partial_rotary_factor", "ple_table_rows", "mtp_num_hidden_layers"}


def _per_layer_groups(model) -> dict[int, Counter]:
    layers: dict[int, Counter] = {}
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            group = _group(rest)
            count = param.numel()
            if group == "routed_experts":
                count //= ARCH.num_experts  # kvsim counts one expert
            layers.setdefault(int(index), Counter())[group] += count
    return layers


def test_every_layer_matches_the_model_definition(meta_model):
    for index, groups in _per_layer_groups(meta_model).items():
        expected = m.layer_params(ARCH, index)
        if ARCH.is_ple_layer(index):
            expected = {**expected, **m.ple_params(ARCH)}
        assert dict(groups) == expected, f"layer {index}"


def test_outside_the_layers_and_the_total(meta_model):
    outside = {n: p.numel() for n, p in meta_model.named_parameters() if not n.startswith("layers.")}
    expected = m.model_params(ARCH)
    assert outside["embed_tokens.weight"] == expected["embed_tokens"]
    assert (
        sum(v for n, v in outside.items() if n.startswith("hyper_connection_mixer"))
        == expected["final_mixer"]
    )
    # transformers' text model has no LM head: it is the embedding's shape.
    total = sum(p.numel() for p in meta_model.parameters()) + expected["lm_head"]
    assert m.total_params(ARCH) == total


def test_hand_count_of_a_gdn_layer():
    # Layer 0, by hand: qkv 2560 x (2x2048 + 6144), z and out 2560 x 6144;
    # a, b 2560 x 48; conv 10240 x 4; A_log, dt_bias 48; norm 128.
    assert m.layer_params(ARCH, 0)["gdn_projections"] == 26_214_400 + 2 * 15_728_640
    assert m.layer_params(ARCH, 0)["gdn_small"] == 2 * 122_880 + 40_960 + 96 + 128
    # Experts: 3 x 2560 x 640 each; shared 3 x 2560 x 640 + gate 2560; router 512 x 2560.
    assert m.layer_params(ARCH, 0)["routed_experts"] == 4_915_200
    assert m.layer_params(ARCH, 0)["shared_expert"] == 4_917_760
    assert m.layer_params(ARCH, 0)["router"] == 1_310_720
    # Two hyper-connections: norm 10240, down 10240 x 320, up 320 x 10240, inject 10240 x 4.
    assert m.layer_params(ARCH, 0)["hyper_connections"] == 2 * (10_240 + 2 * 3_276_800 + 40_960)


def test_hand_count_of_a_qsa_layer():
    # Layer 3: q 2560 x (24 x 256 x 2), k and v 2560 x 512, o 6144 x 2560, norms 2 x 256.
    assert m.layer_params(ARCH, 3)["attention"] == 31_457_280 + 2 * 1_310_720 + 15_728_640 + 512
    # Indexer: 2560 x (4 + 1) x 128, norms 2 x 128.
    assert m.layer_params(ARCH, 3)["indexer"] == 1_638_400 + 256
    assert "gdn_projections" not in m.layer_params(ARCH, 3)


def test_hand_count_of_the_ple_module_and_the_mtp_layer():
    # PLE: key 2560 x 10240, value 2560 x 2560, three norms of 10240, conv 10240 x 4; table rows x 160.
    assert m.ple_params(ARCH) == {
        "ple_module": 26_214_400 + 6_553_600 + 3 * 10_240 + 40_960,
        "ple_table": 320_001_536 * 160,
    }
    # MTP fusion: fc_embedding and fc_hidden 2560 x 2560, norms 2560 + 10240, mixer 10240 + 2 x 3,276,800.
    assert m.mtp_layer_params(ARCH)["mtp_fusion"] == 2 * 6_553_600 + 2_560 + 10_240 + 10_240 + 6_553_600
    assert m.mtp_layer_params(ARCH)["attention"] == m.layer_params(ARCH, 3)["attention"]


def test_the_published_sizes():
    """docs/reference.md of the fork: 125B main model, ~6B active, 51.2B-entry
    table, an MTP head of about 2.6B."""
    assert m.total_params(ARCH, with_table=False) == pytest.approx(125e9, rel=0.01)
    # "Activated" as model cards count it: without the LM head.
    lm_head = m.model_params(ARCH)["lm_head"]
    assert m.active_params_per_token(ARCH) - lm_head == pytest.approx(6e9, rel=0.02)
    assert m.ple_params(ARCH)["ple_table"] == pytest.approx(51.2e9, rel=0.001)
    mtp = m.mtp_layer_params(ARCH)
    assert sum(mtp.values()) + (ARCH.num_experts - 1) * mtp["routed_experts"] == pytest.approx(
        2.6e9, rel=0.03
    )


def test_layer_kinds():
    kinds = ["qsa" if ARCH.is_qsa_layer(i) else "gdn" for i in range(ARCH.num_hidden_layers)]
    assert kinds.count("qsa") == 12 and kinds[3] == kinds[47] == "qsa" and kinds[0] == kinds[2] == "gdn"
    assert [i for i in range(48) if ARCH.is_ple_layer(i)] == [1]
