"""The step-time model: per micro-batch per stage, each term against a hand
count from the released shapes (docs/step-time-model.md), the pipeline
recurrence by hand, overridable per scenario. The rig's published figures
are in tests/test_published.py."""

from __future__ import annotations

import math

import pytest
from helpers.scenarios import scenario

from sim.config import ConfigError
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.step_time import StepTimeConfig, StepTimeModel, expected_max_of_normals, split


def _model(**changes) -> StepTimeModel:
    return StepTimeModel(StepTimeConfig(**{"layer_partition": (25, 23), **changes}))


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


def _prefill(tokens: int, context: int = 0, request_id: str = "p") -> SchedulerOutput:
    item = ScheduledRequest(
        request_id=request_id,
        num_scheduled_tokens=tokens,
        num_computed_tokens=context,
        num_spec_tokens=0,
        num_prompt_tokens_left=tokens,
    )
    return SchedulerOutput(step_index=1, scheduled=(item,))


def test_stage_weights_per_rank_by_hand():
    """Stage 0 (layers 0-24: 19 GDN, 6 QSA, the PLE module), one TP rank of
    two, bytes as the W4A16 checkpoint stores them. Per GDN layer: INT8
    qkv/z/out 57,671,680 / 2; BF16 a, b, conv, A_log, dt_bias, norm 286,944
    x 2 / 2; shared expert 4,917,760 x 2 / 2; router 1,310,720 x 2 and the
    hyper-connections 13,209,600 x 2 on every rank: 63,081,184 B. Per QSA
    layer: BF16 q, k, v, o and norms 49,807,872 x 2 / 2, the indexer
    1,638,656 x 2 on every rank, shared, router, hyper-connections:
    87,043,584 B. The PLE module 32,839,680 x 2 on every rank."""
    stage0 = _model()._stages[0]
    assert (stage0.num_gdn, stage0.num_qsa) == (19, 6)
    assert stage0.dense_bytes == 19 * 63_081_184 + 6 * 87_043_584 + 65_679_360
    # Control: the last stage has no PLE module and 17 GDN + 6 QSA layers.
    stage1 = _model()._stages[1]
    assert stage1.dense_bytes == 17 * 63_081_184 + 6 * 87_043_584


def test_distinct_experts_touched():
    """One token routes to its top-10; 1,024 tokens touch nearly all 512:
    512 x (1 - (502/512)^1024)."""
    model = _model()
    assert model._distinct_experts(1) == pytest.approx(10)
    assert model._distinct_experts(1024) == pytest.approx(512 * (1 - (502 / 512) ** 1024))
    # One expert: 4,915,200 x 4.125 bits / 8.
    assert model._expert_bytes == pytest.approx(4_915_200 * 4.125 / 8)


def test_the_busiest_rank_sets_the_expert_reads():
    """Expert parallel over two ranks: one token's 10 experts land 5 per
    rank on average, hypergeometric variance 10 x 1/2 x 1/2 x 502/511, and
    the busier of two ranks is E[max of 2 normals] = 1/sqrt(pi) deviations
    above the mean. A 1,024-token chunk touches (nearly) all 512: 256 a
    rank, no spread. Control: a mean-only model (5) is what the step would
    take if the ranks never waited for each other."""
    model = _model()
    busiest = 5 + math.sqrt(10 * 0.25 * 502 / 511) / math.sqrt(math.pi)
    assert model._busiest_rank_experts(1) == pytest.approx(busiest)
    assert model._busiest_rank_experts(1) > 5.8
    assert model._busiest_rank_experts(1024) == pytest.approx(256, abs=1e-3)
    assert expected_max_of_normals(4) == pytest.approx(
        1.029375, abs=1e-5
    )  # tables of normal order statistics


def test_qsa_reads_compressed_keys_and_the_top_k():
    """A decode of 4 tokens at context 100,000, one QSA layer, one rank:
    (100,004 / 4) BF16 keys of 128, and 2,048 selected FP8 K and V of one KV
    head of 256."""
    model = _model()
    from sim.step_time import _batch

    batch = _batch(_decode(1, 100_000).scheduled, model.arch)
    assert model._kv_bytes(batch) == pytest.approx(100_004 / 4 * 128 * 2 + 2048 * 2 * 256)


def test_prefill_cost_is_near_flat_in_context():
    """QSA attends to 2,048 keys whatever the context; only the indexer's
    scores grow. A 1,024-token chunk at 250K costs < 15 % more than at 10K;
    control: a full-attention model's quadratic term would be 25x."""
    model = _model()
    for stage in (0, 1):
        near, far = (
            model.stage_s(_prefill(1024, 10_000), stage),
            model.stage_s(_prefill(1024, 250_000), stage),
        )
        assert 1.0 < far / near < 1.15


def test_all_reduce_and_hand_off_by_hand():
    """Per layer: 40 us of kernel gaps + 2 all-reduces of 1,024 x 2,560 x 2 B
    over a ring of two (factor 1) at 20 GB/s after 18 us. Hand-off: the four
    hyper-connection streams, 1,024 x 10,240 x 2 B, after 30 us."""
    model = _model()
    assert model._layer_fixed_s(1024) == pytest.approx(40e-6 + 2 * (18e-6 + 1024 * 2560 * 2 / 20e9))
    assert model.handoff_s(_prefill(1024)) == pytest.approx(30e-6 + 1024 * 10240 * 2 / 20e9)
    assert _model(tensor_parallel_size=1)._layer_fixed_s(1024) == pytest.approx(40e-6)


class _HandStages(StepTimeModel):
    """Stage 0 takes 3 s, stage 1 2 s, the hand-off 1 s, per micro-batch."""

    def stage_s(self, output, stage):
        return (3.0, 2.0)[stage]

    def handoff_s(self, output):
        return 1.0


def test_pipeline_recurrence_by_hand():
    """Three micro-batches: the first leaves stage 0 at 3, stage 1 at 3 + 1 +
    2 = 6; the second leaves stage 0 at 6, stage 1 at max(7, 6) + 2 = 9; the
    third at 12. Control: one after the other would take 3 x 6 = 18."""
    model = _HandStages(StepTimeConfig(layer_partition=(25, 23)))
    assert model.pipeline_s([_prefill(1)] * 3) == 12.0
    assert model.pipeline_s([_prefill(1)]) == 6.0


def test_a_synchronous_step_pipelines_its_requests_in_pp_micro_batches():
    model = _model()
    two = SchedulerOutput(
        step_index=1, scheduled=_prefill(512, 0, "a").scheduled + _prefill(512, 0, "b").scheduled
    )
    parts = split(two, 2)
    assert [p.scheduled for p in parts] == [two.scheduled[:1], two.scheduled[1:]]
    assert model.step_time_s(two) == pytest.approx(model.pipeline_s(parts))
    one = _prefill(1024)
    assert model.step_time_s(one) == pytest.approx(
        model.stage_s(one, 0) + model.handoff_s(one) + model.stage_s(one, 1)
    )


def test_more_work_never_takes_less_time():
    model = _model()
    assert model.step_time_s(_decode(4, 12_000)) < model.step_time_s(_decode(8, 12_000))
    assert model.step_time_s(_decode(8, 1_000)) < model.step_time_s(_decode(8, 100_000))
    assert model.step_time_s(_prefill(256)) < model.step_time_s(_prefill(1024))
    assert model.step_time_s(SchedulerOutput(step_index=1, scheduled=())) == 0.0


def test_the_ple_push_transport_waits_one_round_trip_on_the_first_stage():
    """Push (v1, the TP4 lane): the stage holding the PLE layer waits 1.3 ms
    for the offload process instead of pulling the rows itself: a decode of
    4 tokens no longer pulls 4 x 16 heads x 160 B of FP8 rows at 31.5 GB/s x
    0.3. The last stage does not move; the push costs 7 % of the release
    check's 18.7 ms step, the middle of the fork's pull-over-push 4-10 %."""
    pull, push = _model(), _model(ple_transport="push")
    pulled_s = 4 * 16 * 160 / (31.5e9 * 0.3)
    delta = push.stage_s(_decode(1, 4096), 0) - pull.stage_s(_decode(1, 4096), 0)
    assert delta == pytest.approx(1.3e-3 - pulled_s)
    assert push.stage_s(_decode(1, 4096), 1) == pull.stage_s(_decode(1, 4096), 1)
    assert 1.04 <= push.step_time_s(_decode(1, 4096)) / pull.step_time_s(_decode(1, 4096)) <= 1.10


def test_the_unfused_forward_prices_a_chunk_a_block_boundary_cut_short():
    """v2.5.0's release candidate (unfused GDN forward, computed 3,392-token
    block, 1,024-token budget): a block is chunks of 1,024, 1,024, 1,024 and
    320, the last cut by the boundary at 3,392. That chunk costs 5.7 ms more
    on each GDN layer: 19 x 5.7 = 108.3 ms on stage 0 (layers 0-24, a QSA
    layer every fourth: 3, 7, ..., 23), 17 x 5.7 = 96.9 ms on stage 1.
    Controls: the same chunk on the fused forward, a full chunk ending on a
    4,096 boundary, the 10,000-token prompt's 144-token last chunk and a
    decode cost nothing more."""
    block = {"block_size": 3392, "max_num_batched_tokens": 1024}
    fused, unfused = _model(**block), _model(**block, gdn_forward="unfused")
    cut = _prefill(320, context=3072)
    assert unfused.stage_s(cut, 0) - fused.stage_s(cut, 0) == pytest.approx(19 * 5.7e-3)
    assert unfused.stage_s(cut, 1) - fused.stage_s(cut, 1) == pytest.approx(17 * 5.7e-3)
    at_4096 = {"block_size": 4096, "max_num_batched_tokens": 1024}
    full = _prefill(1024, context=3072)
    assert _model(**at_4096, gdn_forward="unfused").stage_s(full, 0) == _model(**at_4096).stage_s(full, 0)
    for uncut in (_prefill(144, context=6784), _prefill(1024, context=1024), _decode(1, 3388)):
        for stage in (0, 1):
            assert unfused.stage_s(uncut, stage) == fused.stage_s(uncut, stage)
    # Without the block (a model built outside an engine) nothing is cut.
    assert _model(gdn_forward="unfused").stage_s(cut, 0) == _model().stage_s(cut, 0)


def test_the_engine_tells_the_clock_the_planners_block(tmp_path):
    """A deployment without ``block_size`` gets the planner's (the rig with
    RecoverSSM: 3,392, the v2.5.0 card's "computed 3,392-token block"); one
    that names it keeps it."""
    from sim.engine_assembly import plan_for, step_time_model

    computed = scenario(tmp_path, "computed", rig=True, deployment={"block_size": None})
    assert computed.step_time_config().block_size is None
    plan = plan_for(computed, "on")
    assert plan.block_size == 3392
    assert step_time_model(computed, plan).config.block_size == 3392
    named = scenario(tmp_path, "named", rig=True, deployment={"block_size": 4096})
    assert step_time_model(named, plan_for(named, "on")).config.block_size == 4096


def test_the_linear_clock():
    """``seconds_per_token``: overhead + tokens x rate, the work spread over
    the stages and the overhead on the last."""
    model = _model(seconds_per_token=0.001, step_overhead_s=0.2)
    assert model.step_time_s(_prefill(1000)) == pytest.approx(1.2)
    assert model.stage_s(_prefill(1000), 0) == pytest.approx(0.5)
    assert model.handoff_s(_prefill(1000)) == 0.0


def test_scenario_overrides_and_names(tmp_path):
    sc = scenario(tmp_path, step_time={"memory_efficiency": 0.9, "step_overhead_s": 0.0})
    faster = StepTimeModel(sc.step_time_config())
    assert faster.step_time_s(_decode(8, 12_000)) < _model().step_time_s(_decode(8, 12_000))
    with pytest.raises(ConfigError, match="unknown key 'memory_eficiency'"):
        scenario(tmp_path, step_time={"memory_eficiency": 0.7})
    with pytest.raises(ConfigError, match="step_time.gpu: unknown gpu 'h100'"):
        scenario(tmp_path, step_time={"gpu": "h100"})
    with pytest.raises(ConfigError, match="step_time.quantization: unknown quantization 'int3'"):
        scenario(tmp_path, step_time={"quantization": "int3"})
    with pytest.raises(ConfigError, match="ple_transport"):
        scenario(tmp_path, step_time={"ple_transport": "carrier-pigeon"})
    with pytest.raises(ConfigError, match="layer_partition: 1 stages for pp 2"):
        scenario(tmp_path, step_time={"layer_partition": [48]})


def test_a_stage_reads_its_own_micro_batch_after_another_stage_read_a_different_one():
    """The model computes a micro-batch's figures once for all its stages
    (speed); interleaved micro-batches of equal size but different contexts
    still get each their own time, as a fresh model gives them. (Control: a
    figure kept by size rather than by micro-batch gives the first batch's
    time to the second.)"""
    short, long = _decode(8, 1_000), _decode(8, 200_000)
    outputs = {"short": short, "long": long}
    expected = {name: [_model().stage_s(output, s) for s in (0, 1)] for name, output in outputs.items()}
    model = _model()
    seen = {"short": [], "long": []}
    for stage in (0, 1):
        for name, output in outputs.items():
            seen[name].append(model.stage_s(output, stage))
    assert seen == expected
    assert expected["short"] != expected["long"]
