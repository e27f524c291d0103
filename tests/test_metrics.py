"""The metric registry (issue 8): every frame column is registered and
every registered column is produced; the lists that used to be kept by
hand (gate directions, the comparison table, the running totals) come from
it; its vLLM names are vLLM's own; and the scenario's scheduler and
allocator sections reach the simulation field by field."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import get_type_hints

import pandas as pd
import pytest
from helpers.scenarios import run, scenario

from sim import metrics
from sim.analysis import frames, gates
from sim.engine import Simulation
from sim.engine_assembly import allocator_options, scheduler_config
from sim.metrics import FRAMES
from sim.scenario import AllocatorSection, SchedulerSection
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.sched.stats import Columns, SchedulerGauges, SchedulerStats, flat_columns

TINY = {
    "trace": "synthetic",
    "num_requests": 6,
    "arrival": {"process": "poisson", "rate_per_s": 2.0},
    "prompt": {"distribution": "fixed", "tokens": 3000},
    "output": {"distribution": "fixed", "tokens": 20},
}


def registry_problems(frame_by_name: dict[str, pd.DataFrame]) -> list[str]:
    """Columns a frame has that the registry lacks, and the other way round,
    and a column order that differs from the registry's."""
    problems = []
    for name, frame in frame_by_name.items():
        registered = metrics.columns(name)  # type: ignore[arg-type]
        problems += [f"{name}: {c} not registered" for c in metrics.unregistered(name, frame.columns)]  # type: ignore[arg-type]
        problems += [f"{name}: {c} registered, not produced" for c in registered if c not in frame.columns]
        if not problems and tuple(frame.columns) != registered:
            problems.append(f"{name}: column order {list(frame.columns)} is not the registry's")
    return problems


@pytest.fixture(scope="module")
def tiny_frames(tmp_path_factory) -> dict[str, pd.DataFrame]:
    return run(tmp_path_factory.mktemp("tiny"), workload=TINY).frames()


def test_every_frame_column_is_registered_and_produced(tiny_frames) -> None:
    assert set(tiny_frames) == set(FRAMES)
    assert registry_problems(tiny_frames) == []
    # CONTROL: a column the registry does not know, and one it misses.
    extra = {**tiny_frames, "steps": tiny_frames["steps"].assign(num_mystery_blocks=0)}
    assert registry_problems(extra) == ["steps: num_mystery_blocks not registered"]
    fewer = {**tiny_frames, "samples": tiny_frames["samples"].drop(columns="num_free_blocks")}
    assert registry_problems(fewer) == ["samples: num_free_blocks registered, not produced"]


def test_an_unregistered_step_field_fails_at_the_first_step(tmp_path, monkeypatch) -> None:
    """CONTROL for the typed record: a field the scheduler adds without
    registering it cannot reach a frame silently."""

    @dataclass(kw_only=True, slots=True)
    class MysteryStats(SchedulerStats):
        num_mystery_blocks: int = 0

    real = Scheduler.make_stats

    def with_extra(self, output, outcome):
        stats = real(self, output, outcome)
        return MysteryStats(**{name: getattr(stats, name) for name in SchedulerStats.__dataclass_fields__})

    monkeypatch.setattr(Scheduler, "make_stats", with_extra)
    with pytest.raises(KeyError, match="unregistered \\['num_mystery_blocks'\\]"):
        run(tmp_path, workload=TINY, layouts=["off"])


def _leaf_fields(cls: type) -> list[str]:
    hints = get_type_hints(cls)
    names: list[str] = []
    for spec in fields(cls):
        kind = hints[spec.name]
        names += _leaf_fields(kind) if is_dataclass(kind) else [spec.name]
    return names


def test_the_step_record_is_the_scheduler_stats_plus_the_clock() -> None:
    assert sorted(["time_s", "step_time_s", *_leaf_fields(SchedulerStats)]) == sorted(metrics.STEP_RECORD)
    # The samples are the scheduler's gauges (the one builder) at a time.
    assert set(metrics.SAMPLE_RECORD) - {"time_s", *metrics.SAMPLED_TOTALS} <= set(
        _leaf_fields(SchedulerGauges)
    )


def test_columns_place_values_by_their_names_in_any_order() -> None:
    """Rows given as names and values: each value lands in its own column
    whichever order the names come in (a new order is a new mapping), and a
    name given twice is refused."""
    store = Columns(("a", "b"))
    store.append_values(("a", "b"), (1, 2))
    store.append_values(("b", "a"), (3, 4))
    store.append_values(("a", "b"), (5, 6))
    assert store.to_dict() == {"a": [1, 4, 5], "b": [2, 3, 6]}
    with pytest.raises(KeyError, match="row does not match"):
        store.append_values(("a", "a", "b"), (7, 8, 9))
    with pytest.raises(ValueError, match="1 values for 2 columns"):  # refused whole: no ragged column
        store.append_values(("a", "b"), (7,))
    assert store.to_dict() == {"a": [1, 4, 5], "b": [2, 3, 6]}


def test_only_records_flatten():
    with pytest.raises(TypeError, match="int is not a record"):
        flat_columns(3)


def test_columns_refuse_a_row_of_another_shape() -> None:
    store = Columns(("a", "b"))
    store.append({"b": 2, "a": 1})
    assert store.to_dict() == {"a": [1], "b": [2]} and len(store) == 1
    with pytest.raises(KeyError, match="missing \\['b'\\]"):
        store.append({"a": 1})


def test_hand_kept_lists_come_from_the_registry() -> None:
    assert gates.DIRECTIONS is metrics.DIRECTIONS
    assert frames.GAIN_METRICS is metrics.GAIN_METRICS
    summary = set(metrics.columns("summary"))
    assert set(metrics.DIRECTIONS) <= summary and set(metrics.GAIN_METRICS) <= set(metrics.DIRECTIONS)
    steps = metrics.columns("steps")
    for counter, total in metrics.CUMULATIVE.items():
        assert counter in steps and total in steps and metrics.metric("steps", counter).kind == "counter"
    # The gates read the directions as the product owner set them (issue 3).
    assert metrics.DIRECTIONS["num_admitted"] == "higher"
    assert metrics.DIRECTIONS["num_preemptions"] == "lower"
    assert metrics.DIRECTIONS["num_steps"] == "either"
    assert "stalled" not in metrics.DIRECTIONS  # a flag, not a gated number


def test_summary_follows_the_registry_order(tiny_frames) -> None:
    assert tuple(tiny_frames["summary"].columns) == metrics.columns("summary")
    # CONTROL: a summary value computed but not registered is refused.
    with pytest.raises(AssertionError, match="unregistered"):
        frames.in_registry_order("summary", {**dict.fromkeys(metrics.columns("summary")), "bogus": 1})


def _vllm_metric_types() -> dict[str, str]:
    """vLLM's own Prometheus metric names and types, read from its source
    (an independent source: the registry must not invent names)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    found: dict[str, str] = {}
    loggers = (root / "v1/metrics/loggers.py").read_text()
    for kind, name in re.findall(
        r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_]+)\"", loggers
    ):
        found[name] = kind
    spec_decode = (root / "v1/spec_decode/metrics.py").read_text()
    for name in re.findall(r"\(\"(vllm:spec_decode_[a-z_]+)\",", spec_decode):
        found[name] = "counter"  # listed in counter_specs
    return found


def test_registered_vllm_names_are_vllms_with_their_types() -> None:
    vllm = _vllm_metric_types()
    assert vllm["vllm:num_requests_running"] == "gauge"  # the reader works
    named = [m for ms in FRAMES.values() for m in ms if m.vllm_name is not None]
    assert len(named) >= 10
    for m in named:
        assert vllm.get(m.vllm_name) == m.vllm_kind, m.name  # type: ignore[arg-type]
    # CONTROL: a misspelt or mistyped name would not be found as registered.
    assert "vllm:num_requests_runing" not in vllm and vllm["vllm:num_preemptions"] != "gauge"


def test_look_up_by_vllm_name() -> None:
    """A scraped counter series carries ``_total`` (Prometheus's rule)."""
    (frame, found), (sampled_frame, sampled) = metrics.by_vllm_name("vllm:num_preemptions_total")
    assert (frame, found.name, found.kind, found.total) == (
        "steps",
        "num_preemptions",
        "counter",
        "num_preemptions_total",
    )
    # The samples carry the running total a replay scrapes from that counter.
    assert (sampled_frame, sampled.name, sampled.kind) == ("samples", "num_preemptions_total", "total")
    assert [(f, m.name) for f, m in metrics.by_vllm_name("vllm:kv_cache_usage_perc")] == [
        ("steps", "kv_cache_usage_perc"),
        ("samples", "kv_cache_usage_perc"),
    ]
    assert metrics.by_vllm_name("vllm:kv_cache_usage_perc_total") == []  # a gauge has no _total
    with pytest.raises(KeyError, match="not a registered summary column"):
        metrics.metric("summary", "num_mystery")


# ------------------------------------------------ configs from the sections
# A value unlike the default for each scheduler section field.
_NOT_DEFAULT = {bool: lambda v: not v, int: lambda v: v + 3}


def test_every_scheduler_section_field_reaches_the_scheduler(tmp_path) -> None:
    defaults = SchedulerSection()
    section = defaults.model_dump()
    assert section.pop("mtp_hash_mode") == "eagle-drop"
    changed = {name: _NOT_DEFAULT[type(value)](value) for name, value in section.items()}
    overrides = [f"scheduler.{name}={str(value).lower()}" for name, value in changed.items()]
    overrides.append("scheduler.mtp_hash_mode=lookahead")
    sc = scenario(tmp_path, overrides=overrides, workload=TINY, deployment={"max_num_seqs": 5})
    sim = Simulation(sc, "on", workload=None)  # type: ignore[arg-type]
    for name, value in changed.items():
        assert getattr(sim.scheduler.config, name) == value, name
    # The hashing mode arrives as what vLLM derives for it: hashes one token
    # past the block (MTP K=3, one module), no EAGLE drop.
    assert sim.scheduler.config.mtp_hashing.num_hash_lookahead_tokens == 1
    assert not sim.scheduler.config.mtp_hashing.use_eagle_block_drop
    assert sim.scheduler.config.max_num_seqs == 5
    assert sim.scheduler.config.num_speculative_tokens == sc.load_model().mtp.num_speculative_tokens


def test_a_scheduler_field_the_scheduler_lacks_is_an_error(tmp_path) -> None:
    """CONTROL: a section field with no scheduler twin fails loudly, where a
    hand copy of the fields would have dropped it."""

    class Wider(SchedulerSection):
        brand_new_flag: bool = True

    sc = scenario(tmp_path, workload=TINY).model_copy(update={"scheduler": Wider()})
    sim = Simulation(scenario(tmp_path, workload=TINY), "off", workload=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="brand_new_flag"):
        scheduler_config(sc, sc.load_model(), sim.plan)
    # Every scheduler field is either a section field or one the engine derives.
    derived = {"max_num_seqs", "max_model_len", "block_size", "num_speculative_tokens", "mtp_hashing"}
    # ... or one the fork section sets (the fork's base, vLLM 0.30.0).
    derived |= {"threshold_caps_lone_request", "caches_after_sampling"}
    named = set(SchedulerSection.model_fields) - {"mtp_hash_mode"}  # the name mtp_hashing derives from
    assert {f.name for f in fields(SchedulerConfig)} == named | derived


def test_every_allocator_section_field_reaches_the_manager(tmp_path) -> None:
    sc = scenario(
        tmp_path,
        overrides=["fork=upstream", "allocator.enable_prefix_caching=false"],
        workload=TINY,
    )
    assert set(allocator_options(sc.allocator)) == {"enable_caching"}
    manager = Simulation(sc, "on", workload=None).kv_cache_manager  # type: ignore[arg-type]
    assert manager.enable_caching is False
    assert manager.num_retained_checkpoints() == 0 and not any(
        type(m).__name__ == "RetainingMambaManager" for m in manager.managers
    )

    class Wider(AllocatorSection):
        brand_new_switch: bool = True

    with pytest.raises(KeyError, match="brand_new_switch"):  # CONTROL
        allocator_options(Wider())
