"""The step-time model: a pure function of the scheduled step, matching
the figures docs/step-time-model.md states, overridable per scenario."""

from __future__ import annotations

import pytest
from helpers.scenarios import scenario

from sim.config import ConfigError
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.step_time import StepTimeConfig, StepTimeModel


class _DefaultModel:
    """The default model, built when a test first uses it (not at import:
    a model built at import would escape mutation testing, which swaps the
    code after the test modules are imported)."""

    def __getattr__(self, name: str):
        return getattr(StepTimeModel(StepTimeConfig()), name)


MODEL = _DefaultModel()


def _decode(n: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(
        step_index=1,
        scheduled=tuple(
            ScheduledRequest(
                request_id=f"d{i}",
                num_scheduled_tokens=4,
                num_computed_tokens=context,
                num_spec_tokens=3,
                num_prompt_tokens_left=0,
            )
            for i in range(n)
        ),
    )


def _prefill(tokens: int, context: int = 0) -> SchedulerOutput:
    return SchedulerOutput(
        step_index=1,
        scheduled=(
            ScheduledRequest(
                request_id="p",
                num_scheduled_tokens=tokens,
                num_computed_tokens=context,
                num_spec_tokens=0,
                num_prompt_tokens_left=tokens,
            ),
        ),
    )


@pytest.mark.parametrize(
    "step, expected_ms",
    [
        (_decode(1, 12_000), 14.2),
        (_decode(8, 12_000), 29.8),
        (_decode(16, 12_000), 46.3),
        (_decode(8, 100_000), 33.4),
        (_prefill(8192), 3486),
    ],
    ids=["decode-1", "decode-8", "decode-16", "decode-8-long", "prefill-8192"],
)
def test_the_documented_figures(step, expected_ms):
    assert MODEL.step_time_s(step) * 1000 == pytest.approx(expected_ms, rel=0.005)


def test_more_work_never_takes_less_time():
    assert MODEL.step_time_s(_decode(4, 12_000)) < MODEL.step_time_s(_decode(8, 12_000))
    assert MODEL.step_time_s(_decode(8, 1_000)) < MODEL.step_time_s(_decode(8, 100_000))
    assert MODEL.step_time_s(_prefill(2048)) < MODEL.step_time_s(_prefill(8192))
    assert MODEL.step_time_s(_prefill(8192)) < MODEL.step_time_s(_prefill(8192, context=100_000))
    assert MODEL.step_time_s(SchedulerOutput(step_index=1, scheduled=())) == 0.0


def test_two_micro_batches_fill_the_pipeline():
    """Two prefills run on both stages at once; one leaves a stage idle."""
    one = MODEL.step_time_s(_prefill(4096))
    two = SchedulerOutput(
        step_index=1,
        scheduled=tuple(
            ScheduledRequest(
                request_id=f"p{i}",
                num_scheduled_tokens=2048,
                num_computed_tokens=0,
                num_spec_tokens=0,
                num_prompt_tokens_left=2048,
            )
            for i in range(2)
        ),
    )
    assert MODEL.step_time_s(two) < 0.6 * one


def test_scenario_overrides_every_coefficient(tmp_path):
    sc = scenario(tmp_path, step_time={"memory_efficiency": 0.7, "step_overhead_s": 0.001})
    faster = StepTimeModel(sc.step_time_config())
    assert faster.step_time_s(_decode(8, 12_000)) < MODEL.step_time_s(_decode(8, 12_000))
    with pytest.raises(ConfigError, match="unknown key 'memory_eficiency'"):
        scenario(tmp_path, step_time={"memory_eficiency": 0.7})


# --------------------------------------------------- one term at a time
# Every coefficient zero (or negligible) but the ones a test names: TP = PP
# = 1, no overhead, 1,000 B/s at efficiency 0.5 (500 B/s a stage), compute
# and interconnect so fast they vanish. Each test then checks one term of
# docs/step-time-model.md's formula against a hand computation.
_QUIET = dict(
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    step_overhead_s=0.0,
    gpu_memory_bandwidth_bytes_per_s=1000.0,
    memory_efficiency=0.5,
    gpu_peak_flops=1e30,
    compute_efficiency=1.0,
    weight_bits=8.0,
    dense_params=0.0,
    active_params_per_token=1e-9,
    num_moe_layers=0,
    experts_per_token=0,
    num_attention_layers=0,
    kv_bytes_per_token=0.0,
    compressed_key_bytes_per_token=0.0,
    attention_flops_per_token_pair=0.0,
    num_gdn_layers=0,
    gdn_state_bytes=0.0,
    ple_state_bytes=0.0,
    hidden_size=1,
    activation_bytes=1,
    interconnect_bandwidth_bytes_per_s=1e30,
    allreduce_latency_s=0.0,
    pp_send_latency_s=0.0,
)


def _quiet(**changes) -> StepTimeModel:
    return StepTimeModel(StepTimeConfig(**{**_QUIET, **changes}))


def _prefills(*chunks: tuple[int, int]) -> SchedulerOutput:
    """(scheduled tokens, computed tokens) per prefill chunk."""
    return SchedulerOutput(
        step_index=1,
        scheduled=tuple(
            ScheduledRequest(
                request_id=f"p{i}",
                num_scheduled_tokens=n,
                num_computed_tokens=computed,
                num_spec_tokens=0,
                num_prompt_tokens_left=n,
            )
            for i, (n, computed) in enumerate(chunks)
        ),
    )


def test_weights_are_read_at_the_memory_efficiency():
    """1,000 dense params at 4 bits = 500 B; 1,000 B/s x 0.5 = 500 B/s: 1 s."""
    model = _quiet(dense_params=1000.0, weight_bits=4.0)
    assert model.step_time_s(_decode(1, 100)) == pytest.approx(1.0, rel=1e-9)


def test_recurrent_state_is_read_and_written_per_request():
    """Per request 2 x (2 GDN layers x 50 B + 100 B PLE) = 400 B; two
    requests 800 B at 500 B/s: 1.6 s."""
    model = _quiet(num_gdn_layers=2, gdn_state_bytes=50.0, ple_state_bytes=100.0)
    assert model.step_time_s(_decode(2, 100)) == pytest.approx(1.6, rel=1e-9)


def test_linear_flops_at_the_compute_efficiency():
    """2 FLOPs x 250 active params x 4 tokens = 2,000 FLOPs at 1,000 FLOP/s
    x 0.5 = 500 FLOP/s: 4 s."""
    model = _quiet(gpu_peak_flops=1000.0, compute_efficiency=0.5, active_params_per_token=250.0)
    assert model.step_time_s(_decode(1, 100)) == pytest.approx(4.0, rel=1e-9)


def test_attention_pairs_of_decodes_and_of_every_prefill():
    """One attention layer, 1 FLOP per pair, 1,000 FLOP/s, top-k 100, one
    compressed state per 4 tokens. A decode of 4 tokens at context 300
    attends min(300, 100) = 100 keys each: 400 pairs, 0.4 s. Two prefill
    chunks in one step: 10 new tokens from 0 see on average (10 + 1) / 2 =
    5.5 keys: 10 x (5.5 + 5.5 / 4) = 68.75 pairs; 20 new tokens after 100
    see 100 + 10.5 = 110.5 keys, top-k clipped to 100: 20 x (100 + 110.5 /
    4) = 2,552.5 pairs. Together 2,621.25 pairs: 2.62125 s."""
    model = _quiet(
        gpu_peak_flops=1000.0,
        num_attention_layers=1,
        attention_flops_per_token_pair=1.0,
        qsa_topk_tokens=100,
        compressed_tokens_per_state=4,
    )
    assert model.step_time_s(_decode(1, 300)) == pytest.approx(0.4, rel=1e-9)
    assert model.step_time_s(_prefills((10, 0), (20, 100))) == pytest.approx(2.62125, rel=1e-9)


def test_kv_reads_of_a_decode():
    """One attention layer: a decode of 4 tokens at context 300 reads 300
    compressed keys (1 B each) and min(300, 100) = 100 raw entries (2 B
    each) per token: 4 x 500 = 2,000 B at 500 B/s: 4 s."""
    model = _quiet(
        num_attention_layers=1,
        compressed_key_bytes_per_token=1.0,
        kv_bytes_per_token=2.0,
        qsa_topk_tokens=100,
    )
    assert model.step_time_s(_decode(1, 300)) == pytest.approx(4.0, rel=1e-9)


@pytest.mark.parametrize(
    "tp, expected_s",
    [
        # 5 tokens x 1,000 x 2 B = 10,000 B messages at 10,000 B/s (1 s).
        # TP 4: 2 all-reduces x 3 layers x (0.01 s + 2 x 3/4 x 1 s) = 9.06 s,
        # plus the PP hand-off 0.02 + 1 = 1.02 s: 10.08 s.
        (4, 10.08),
        # TP 1: no all-reduce at all, only the hand-off.
        (1, 1.02),
    ],
)
def test_interconnect_all_reduces_and_hand_off(tp, expected_s):
    model = _quiet(
        tensor_parallel_size=tp,
        num_gdn_layers=2,
        num_attention_layers=1,
        hidden_size=1000,
        activation_bytes=2,
        interconnect_bandwidth_bytes_per_s=10_000.0,
        allreduce_latency_s=0.01,
        pp_send_latency_s=0.02,
    )
    five_tokens = _prefills((5, 0))
    assert model.step_time_s(five_tokens) == pytest.approx(expected_s, rel=1e-9)
