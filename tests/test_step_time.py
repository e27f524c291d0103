"""The step-time model: a pure function of the scheduled step, matching
the figures docs/step-time-model.md states, overridable per scenario."""

from __future__ import annotations

import pytest
from sim_helpers import scenario

from sim.config import ConfigError
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.step_time import StepTimeConfig, StepTimeModel

MODEL = StepTimeModel(StepTimeConfig())


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
