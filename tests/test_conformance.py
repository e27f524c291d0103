"""The conformance gate: kvsim's scheduler and vLLM 0.33.0's own Scheduler
(built from a real VllmConfig) take identical steps on five shapes (prefix
hits, heavy preemption, long chunked prompts, and issue 41's edges: a budget
of two blocks, the rig's 4,096-token blocks on a 64-token unit) x both
layouts x both MTP hashing modes; deliberately changed policies make
``kvsim conform`` fail at the step derived from vLLM's trajectory alone, and
so do vLLM-side mutants at the edges (the reference can fail); a vLLM whose
Scheduler cannot be built gives one line and exit 2.

One process (vLLM imported once); the VllmConfig is cheap after the first.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from helpers import vllm_mutants
from helpers.scenarios import conformance_requests, conformance_shape

from sim.cli import main
from sim.conformance.driver import (
    ConformanceResult,
    Trajectory,
    conformance_scenario,
    drive,
    plan_for,
    run_conformance,
    vllm_backend,
)
from sim.paths import SCENARIOS_DIR
from sim.sched.scheduler import Scheduler
from sim.step_time import StepTimeModel

CONFORMANCE = SCENARIOS_DIR / "conformance"
SHAPES = ("prefix-hits", "heavy-preemption", "long-chunked", "block-budget", "rig-blocks")
# The shapes before issue 41: an 8,192-token budget, never a multiple of their block.
OLD_SHAPES = SHAPES[:3]
SIM = Path(__file__).resolve().parents[1] / "sim"


_scenario, _requests = conformance_shape, conformance_requests


def _conform(shape: str, layout: str, mode: str) -> ConformanceResult:
    return run_conformance(_scenario(shape), layout, _requests(shape), mtp_hash_mode=mode)


# Each shape's run, shared by the tests that read vLLM's trajectory.
_REFERENCES: dict[tuple[str, str, str], ConformanceResult] = {}


def _reference(shape: str, layout: str, mode: str) -> ConformanceResult:
    key = (shape, layout, mode)
    if key not in _REFERENCES:
        _REFERENCES[key] = _conform(shape, layout, mode)
    return _REFERENCES[key]


def _vllm_vllm_config_lookahead(mode: str) -> tuple[bool, int, int]:
    """What vLLM's own VllmConfig properties give for MTP K=3 in ``mode``
    (the independent source for both backends' derived hashing)."""
    return {"eagle-drop": (True, 0, 1), "lookahead": (False, 1, 1)}[mode]


# ------------------------------------------------------------------- gate
@pytest.mark.parametrize("mode", ["eagle-drop", "lookahead"])
@pytest.mark.parametrize("layout", ["off", "on"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_step_is_identical(shape, layout, mode):
    # Run afresh (and share): mutation testing forks each mutant's run from
    # a process that already ran this test unmutated, so a cached result
    # would compare the unmutated scheduler.
    result = _REFERENCES[(shape, layout, mode)] = _conform(shape, layout, mode)
    comparison = result.comparison
    assert comparison.num_steps > 0
    assert comparison.first_difference is None, comparison.differing_fields(comparison.first_difference)
    assert comparison.identical_share == 1.0 and comparison.conforms
    expected = _vllm_vllm_config_lookahead(mode)
    for hashing in (result.kvsim_hashing, result.vllm_hashing):
        assert (
            hashing.use_eagle_block_drop,
            hashing.num_hash_lookahead_tokens,
            hashing.num_prefill_lookahead_tokens,
        ) == expected
    # The new layout really runs kvsim's side cache inside vLLM's manager.
    assert result.vllm_ring_slot_packing == (layout == "on")


def _steps(result: ConformanceResult) -> Trajectory:
    return result.comparison.right  # vLLM's trajectory


@pytest.mark.parametrize("mode", ["eagle-drop", "lookahead"])
@pytest.mark.parametrize("layout", ["off", "on"])
def test_the_shapes_exercise_what_they_are_named_for(layout, mode):
    """Each shape shows its behaviour in vLLM's own run, so the gate is
    about something: hits, preemptions, chunked prompts."""
    hits = _steps(_reference("prefix-hits", layout, mode)).steps
    assert sum(s.prefix_cache_hits_tokens for s in hits) >= 5 * 3200
    preemption = _steps(_reference("heavy-preemption", layout, mode)).steps
    # Upstream (conformance runs every fork patch off): 7 to 49 preemptions
    # across the layouts and modes at the shape's 0.8 GB pool.
    assert sum(len(s.preempted) for s in preemption) >= 5
    assert sum(len(s.resumed) for s in preemption) >= 5
    prompts = {r.request_id: r.prompt_len for r in _requests("long-chunked")}
    chunks = [
        (rid, done)
        for s in _steps(_reference("long-chunked", layout, mode)).steps
        for rid, computed, n in s.scheduled_tokens
        if (done := computed + n) < prompts[rid]
    ]
    assert len(chunks) >= 5 * len(prompts)


def _prompts(shape: str) -> dict[str, int]:
    return {r.request_id: r.prompt_len for r in _requests(shape)}


@pytest.mark.parametrize("mode", ["eagle-drop", "lookahead"])
def test_the_edge_shapes_reach_their_edges(mode):
    """Read off vLLM's own run (issue 41). block-budget: a budget of two
    3,200-token blocks, chunks that fill it exactly, mid-prompt chunks
    ending exactly on a block (= hash-unit) boundary, prompts ending on one.
    rig-blocks: 4,096-token blocks on a 64-token unit, agent sessions: each
    follow-up's prefix hit ends on the unit, most inside a block, and chunks
    end on unit boundaries that are no block's (a prompt's tail)."""
    budget, block = 6400, 3200
    steps = _steps(_reference("block-budget", "on", mode)).steps
    prompts = _prompts("block-budget")
    assert budget % block == 0
    chunks = [(rid, c, n) for s in steps for rid, c, n in s.scheduled_tokens if c < prompts[rid]]
    assert any(n == budget for _, _, n in chunks)
    assert any((c + n) % block == 0 and c + n < prompts[rid] for rid, c, n in chunks)
    assert any(c + n == prompts[rid] and prompts[rid] % block == 0 for rid, c, n in chunks)
    steps = _steps(_reference("rig-blocks", "on", mode)).steps
    prompts = _prompts("rig-blocks")
    first_chunks = {}
    for s in steps:
        for rid, c, n in s.scheduled_tokens:
            first_chunks.setdefault(rid, (c, n))
    hits = [c for rid, (c, _) in first_chunks.items() if not rid.endswith("t0000")]
    assert len(hits) >= 8 and all(c % 64 == 0 for c in hits)
    assert sum(1 for c in hits if c % 4096) >= 5
    assert sum(s.prefix_cache_hits_tokens for s in steps) >= sum(hits)
    ends = [c + n for s in steps for rid, c, n in s.scheduled_tokens if c < prompts[rid]]
    assert any(e % 64 == 0 and e % 4096 for e in ends)


# ------------------------------------------------- vLLM-side mutants (issue 41)
# Each is a patched copy of one of vLLM's own Scheduler methods, on the
# reference's scheduler only (tests/helpers/vllm_mutants.py): the gate must
# report a difference on the shape that reaches the edge, and (the point of
# the new shapes) the 8,192 shapes do not.
@pytest.mark.parametrize(
    "mutant, shape",
    [
        (vllm_mutants.budget_one_short, "block-budget"),
        (vllm_mutants.block_end_floored_one_early, "block-budget"),
        (vllm_mutants.tail_on_the_block, "rig-blocks"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
@pytest.mark.parametrize("mode", ["eagle-drop", "lookahead"])
def test_a_vllm_mutant_at_an_edge_fails_the_gate_where_reached(mutant, shape, mode, monkeypatch):
    """The first difference is at the first step whose chunk the mutant
    changes, read off vLLM's unmutated run: the first chunk that fills the
    budget (budget one short), the first mid-prompt chunk ending on a block
    boundary (its end floored from one token before), the first mid-prompt
    chunk ending on a unit that is no block's end: the prompt's tail stop
    (taken on the block instead)."""
    reference = _steps(_reference(shape, "on", mode))
    prompts = _prompts(shape)
    predicates = {
        "budget_one_short": lambda i, s: any(n == 6400 for _, _, n in s.scheduled_tokens),
        "block_end_floored_one_early": lambda i, s: any(
            (c + n) % 3200 == 0 and c + n < prompts[rid] for rid, c, n in s.scheduled_tokens
        ),
        "tail_on_the_block": lambda i, s: any(
            (c + n) % 4096 and c + n < prompts[rid] for rid, c, n in s.scheduled_tokens
        ),
    }
    expected = _first_step(reference, predicates[mutant.__name__])
    mutant().apply(monkeypatch)
    comparison = _conform(shape, "on", mode).comparison
    assert comparison.first_difference == expected
    assert comparison.differing_fields(expected)[0] == "scheduled_tokens"


@pytest.mark.parametrize("shape", OLD_SHAPES)
def test_the_8192_shapes_never_reach_the_budgets_block_edge(shape, monkeypatch):
    """Why the new shapes: vLLM's budget one token short, and its split
    flooring a chunk's end from one token before, pass every shape whose
    budget (8,192) is no multiple of its block (3,200)."""
    vllm_mutants.budget_one_short().apply(monkeypatch)
    assert _conform(shape, "on", "lookahead").comparison.conforms
    monkeypatch.undo()
    vllm_mutants.block_end_floored_one_early().apply(monkeypatch)
    assert _conform(shape, "off", "eagle-drop").comparison.conforms


def test_the_modes_differ_where_vllm_says():
    """Lookahead hashes move chunk ends and hits: the two modes are not the
    same trajectory (else the mode setting would be untested)."""
    drop = _steps(_reference("long-chunked", "on", "eagle-drop")).steps
    lookahead = _steps(_reference("long-chunked", "on", "lookahead")).steps
    assert drop != lookahead


# --------------------------------------------------------------- controls
def _first_step(trajectory: Trajectory, predicate) -> int:
    return next(i + 1 for i, state in enumerate(trajectory.steps) if predicate(i, state))


def _vllm_preemption_candidates(shape: str, layout: str, mode: str) -> list[tuple[int, int]]:
    """(step, how many running requests follow the one being allocated) at
    each preemption vLLM's own Scheduler makes, read off vLLM alone."""
    scenario = conformance_scenario(_scenario(shape), mode)
    backend = vllm_backend(scenario, plan_for(scenario, layout))
    scheduler, seen = backend.scheduler, []
    allocate, preempt = scheduler.kv_cache_manager.allocate_slots, scheduler._preempt_request

    def remember_allocating(request, *args, **kwargs):
        scheduler.allocating = request
        return allocate(request, *args, **kwargs)

    def record_preemption(victim, *args, **kwargs):
        # vLLM has popped the victim: it followed every request still after.
        running = scheduler.running
        after = (
            len(running) - running.index(scheduler.allocating) if victim is not scheduler.allocating else 0
        )
        seen.append((scheduler.num_executed_steps + 1, after))
        return preempt(victim, *args, **kwargs)

    scheduler.kv_cache_manager.allocate_slots = remember_allocating
    scheduler._preempt_request = record_preemption
    drive(backend, _requests(shape), StepTimeModel(scenario.step_time_config()))
    return seen


def test_control_another_preemption_victim(monkeypatch):
    """kvsim preempting the oldest request not yet scheduled in the step
    (not the newest) fails at the first step where vLLM preempted with two
    or more running requests after the one it allocated for."""
    candidates = _vllm_preemption_candidates("heavy-preemption", "on", "eagle-drop")
    expected = next(step for step, after in candidates if after >= 2)

    def oldest_unscheduled_victim(self, request, num_new, step):
        lookahead = self.config.num_speculative_tokens
        while self.kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead) is None:
            later = self.running[self.running.index(request) + 1 :]
            victim = later[0] if later else request
            if not self._blocks_can_be_freed(victim):
                return False
            self.running.remove(victim)
            self._preempt(victim)
            step.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    monkeypatch.setattr(Scheduler, "_allocate_or_preempt", oldest_unscheduled_victim)
    comparison = _conform("heavy-preemption", "on", "eagle-drop").comparison
    assert comparison.first_difference == expected
    assert "preempted" in comparison.differing_fields(expected)


def test_control_one_fewer_accepted_draft(monkeypatch):
    """kvsim dropping one accepted draft once (the first time a request that
    goes on accepted any) fails at that request's next step."""
    reference = _steps(_reference("prefix-hits", "off", "lookahead"))
    applied: list[tuple[int, str]] = []
    original = Scheduler.apply_sampled

    def one_fewer(self, item, sampled, tally):
        # kvsim's scheduler applies each request's output here (steady
        # decodes, kept aside by the lane, are not dropped from).
        request = self.requests.get(item.request_id)
        left = request.max_tokens - request.num_output_tokens if request else 0
        if not applied and item.num_spec_tokens and len(sampled) >= 2 and left > len(sampled) + 1:
            sampled = sampled[:-1]
            applied.append((self.sched_step_seq, item.request_id))
        return original(self, item, sampled, tally)

    monkeypatch.setattr(Scheduler, "apply_sampled", one_fewer)
    comparison = _conform("prefix-hits", "off", "lookahead").comparison
    step, request_id = applied[0]
    expected = _first_step(
        reference, lambda i, s: i + 1 > step and request_id in (rid for rid, _, _ in s.scheduled_tokens)
    )
    assert comparison.first_difference == expected


def test_control_a_chunk_split_moved(monkeypatch):
    """kvsim ending every mid-prompt chunk longer than a block one block
    earlier fails at the first such chunk of vLLM's run."""
    block = 3200
    prompts = {r.request_id: r.prompt_len for r in _requests("long-chunked")}
    reference = _steps(_reference("long-chunked", "off", "eagle-drop"))
    expected = _first_step(
        reference,
        lambda i, s: any(c + n < prompts[rid] and n > block for rid, c, n in s.scheduled_tokens),
    )
    original = Scheduler._clip

    def moved(self, request, num_new, budget, num_hit=0):
        chunk = original(self, request, num_new, budget, num_hit)
        start = request.num_computed_tokens + num_hit
        return chunk - block if start + chunk < request.num_prompt_tokens and chunk > block else chunk

    monkeypatch.setattr(Scheduler, "_clip", moved)
    comparison = _conform("long-chunked", "off", "eagle-drop").comparison
    assert comparison.first_difference == expected
    assert comparison.differing_fields(expected)[0] == "scheduled_tokens"


# -------------------------------------------------------------------- CLI
def test_conform_exits_0_when_identical(capsys):
    status = main(
        ["conform", str(CONFORMANCE / "long-chunked.yaml"), "--layout", "off", "--mtp-hash-mode", "lookahead"]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "(100.0 %)" in out and "fenced frees" in out


def test_conform_exits_1_and_prints_the_first_difference(capsys, monkeypatch):
    """CONTROL for the exit status: the moved split, through the CLI."""
    original = Scheduler._clip

    def moved(self, request, num_new, budget, num_hit=0):
        chunk = original(self, request, num_new, budget, num_hit)
        return (
            chunk - 1 if request.num_computed_tokens + num_hit + chunk < request.num_prompt_tokens else chunk
        )

    monkeypatch.setattr(Scheduler, "_clip", moved)
    status = main(["conform", str(CONFORMANCE / "long-chunked.yaml"), "--layout", "on"])
    out = capsys.readouterr().out
    assert status == 1
    assert "first difference at step 1: scheduled_tokens" in out
    assert "  kvsim:" in out and "  vllm:" in out


def _no_scheduler_bridge(monkeypatch):
    """A vLLM without the modules the bridge imports: the import fails."""
    monkeypatch.setitem(sys.modules, "sim.vllm_bridge.scheduler", None)


def _speculative_config_without_the_switch(monkeypatch):
    """A vLLM whose SpeculativeConfig lacks the lookahead-hash switch."""

    def refuse(**kwargs):
        raise TypeError("SpeculativeConfig got an unexpected keyword 'disable_lookahead_block_hashes'")

    monkeypatch.setattr("sim.vllm_bridge.scheduler.SpeculativeConfig", refuse)


def _scheduler_with_another_signature(monkeypatch):
    """A vLLM whose Scheduler takes other arguments."""

    def refuse(**kwargs):
        raise TypeError("Scheduler.__init__() missing 1 required positional argument: 'kv_cache_manager'")

    monkeypatch.setattr("sim.vllm_bridge.scheduler.Scheduler", refuse)


@pytest.mark.parametrize(
    "break_it",
    [_no_scheduler_bridge, _speculative_config_without_the_switch, _scheduler_with_another_signature],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_scheduler_that_cannot_be_built_gives_one_line_and_exit_2(break_it, monkeypatch, capsys):
    import sim.vllm_bridge.scheduler  # noqa: F401  (loaded, so it can be patched)

    break_it(monkeypatch)
    status = main(["conform", str(CONFORMANCE / "long-chunked.yaml")])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("kvsim: error: vLLM's Scheduler cannot be built (")


def test_only_the_conformance_backends_import_the_vllm_scheduler_and_engine_bridges():
    """Nothing else in kvsim depends on the second backend."""
    importers = set()
    for path in SIM.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n in ("sim.vllm_bridge.scheduler", "sim.vllm_bridge.engine_core") for n in names):
                importers.add(path.relative_to(SIM).as_posix())
    assert importers == {
        "conformance/driver.py",
        "conformance/backends.py",
        "conformance/async_engine.py",
        "vllm_bridge/engine_core.py",  # the engine core is built on the scheduler bridge
    }


@pytest.mark.parametrize("caching", [True, False])
def test_the_conformance_allocators_take_the_scenarios_allocator_section(caching):
    """Both kvsim backends (the synchronous scheduler and the async engine
    core) build the allocator from the scenario's ``allocator:`` section as
    a simulation does (``allocator_options``), and vLLM is started with the
    same prefix caching. Expected: the section's value itself. (Control: the
    other value of the switch gives the other answer, so a backend that kept
    a setting of its own fails one case.)"""
    from sim.conformance.async_engine import kvsim_engine
    from sim.conformance.driver import kvsim_backend, vllm_settings
    from sim.scenario import AllocatorSection

    base = conformance_scenario(_scenario("prefix-hits"))
    scenario = base.model_copy(update={"allocator": AllocatorSection(enable_prefix_caching=caching)})
    plan = plan_for(scenario, "on")
    managers = (
        kvsim_backend(scenario, "on").kv_cache_manager,
        kvsim_engine(scenario, "on", depth=2, stagger=1).scheduler.kv_cache_manager,
    )
    assert [m.enable_caching for m in managers] == [caching, caching]
    assert vllm_settings(scenario, plan).enable_prefix_caching is caching
