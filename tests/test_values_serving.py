"""``kvsim serve``'s engine by value (issue 26): ``LiveEngine`` driven
directly (no HTTP), its clock faked where time matters. Expected values are
hand counts: request ids ``cmpl-0, cmpl-1, ...`` in arrival order; a client
sees each output token as its position in the sequence (the simulator's
sampled ids are ``2**50 + position``, ``sim/sched/model_runner.py``); vLLM
counts a prompt's tokens when its first token comes out and a finished
request once under its reason (``vllm/v1/metrics/loggers.py``); the KV
usage is vLLM's ``BlockPool.get_usage`` of the engine's own pool."""

from __future__ import annotations

import ast
import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import vllm
from helpers.fault_server import GOOD_METRICS
from helpers.scenarios import HAND_STEP_TIME, NO_WORKLOAD
from helpers.scenarios import scenario as make_scenario
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.engine import FinishReason

from sim.serving.live_engine import LiveEngine, PromptTooLong, TokenDelta
from sim.serving.server_metrics import ServerMetrics, parse_metrics

VLLM_LOGGERS = Path(vllm.__file__).parent / "v1/metrics/loggers.py"

BOUND_S = 20.0
NO_DRAFTS = {"acceptance_rates": [0.0, 0.0, 0.0]}
ALL_DRAFTS = {"acceptance_rates": [1.0, 1.0, 1.0]}


class FakeClock:
    """A wall clock that moves only when told (seconds)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _engine(tmp_path, *, speed: float = 1.0, clock: Callable[[], float] = time.monotonic, **sections: Any):
    sections.setdefault("mtp", NO_DRAFTS)
    sc = make_scenario(tmp_path, deployment={"max_num_seqs": 2}, workload=NO_WORKLOAD, **sections)
    log: list[str] = []
    return LiveEngine(sc, "on", speed=speed, clock=clock, log=log.append), log


def _page(engine: LiveEngine) -> dict[str, float]:
    """The exposition, each sample by name (and finish reason)."""
    found = {}
    for family in text_string_to_metric_families(engine.metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            reason = sample.labels.get("finished_reason")
            found[sample.name + (f":{reason}" if reason else "")] = sample.value
    return found


def _running(engine: LiveEngine, check: Callable[[], Awaitable[Any]]) -> Any:
    """``check`` while the engine loop runs; the loop stopped afterwards."""

    async def main() -> Any:
        task = asyncio.create_task(engine.run())
        try:
            return await asyncio.wait_for(check(), BOUND_S)
        finally:
            engine.stop()
            await asyncio.wait_for(task, 5.0)

    return asyncio.run(main())


async def _all_deltas(queue: asyncio.Queue[TokenDelta]) -> list[TokenDelta]:
    deltas = [await queue.get()]
    while not deltas[-1].finished:
        deltas.append(await queue.get())
    return deltas


# ------------------------------------------------------------------ aborts
def test_an_abort_leaves_the_queue_counts_once_and_logs_one_line(tmp_path):
    """Three requests queued (no step yet): 3 wait. Aborting the second:
    2 wait, one abort counted, one log line; the scheduler no longer holds
    it. A second abort of it, and one of an id never given, change nothing
    and say False."""

    async def scenario() -> None:
        engine, log = _engine(tmp_path)
        ids = [engine.add_request(list(range(10)), 4)[0] for _ in range(3)]
        assert ids == ["cmpl-0", "cmpl-1", "cmpl-2"]
        page = _page(engine)
        assert page["vllm:num_requests_waiting"] == 3 and page["vllm:num_requests_running"] == 0
        assert engine.abort("cmpl-1", "gone") is True
        page = _page(engine)
        assert page["vllm:num_requests_waiting"] == 2
        assert page["vllm:request_success_total:abort"] == 1
        assert page["vllm:request_success_total:length"] == 0
        assert page["vllm:request_success_total:stop"] == 0
        assert log == ["Request cmpl-1 aborted (gone)."]
        assert engine.num_unfinished == 2
        assert [spec.request_id for spec in engine.scheduler.waiting] == ["cmpl-0", "cmpl-2"]
        assert engine.abort("cmpl-1", "again") is False and engine.abort("cmpl-9", "never") is False
        assert _page(engine)["vllm:request_success_total:abort"] == 1 and len(log) == 1
        assert engine.num_unfinished == 2

    asyncio.run(scenario())


def test_an_abort_mid_decode_frees_every_block_once_the_engine_idles(tmp_path):
    """A request aborted after its first tokens (fenced frees on): its
    stream ends without a finished delta, it is counted once as aborted,
    never as finished, and once the engine idles the KV usage gauge reads
    vLLM's pool: 0. The running gauge drops at the abort itself."""
    engine, log = _engine(tmp_path, speed=20.0, scheduler={"defer_block_free": True})

    async def check() -> dict[str, float]:
        request_id, queue = engine.add_request(list(range(64)), 1000)
        first = await queue.get()
        assert first.token_ids == [64] and not first.finished
        assert _page(engine)["vllm:num_requests_running"] == 1
        assert engine.abort(request_id, "client disconnected")
        page = _page(engine)
        assert page["vllm:num_requests_running"] == 0 and page["vllm:num_requests_waiting"] == 0
        for _ in range(int(BOUND_S / 0.05)):
            if _page(engine)["vllm:kv_cache_usage_perc"] == 0.0:
                break
            await asyncio.sleep(0.05)
        return _page(engine)

    page = _running(engine, check)
    assert page["vllm:kv_cache_usage_perc"] == 0.0 == engine.sim.kv_cache_manager.block_pool.get_usage()
    assert page["vllm:request_success_total:abort"] == 1
    assert page["vllm:request_success_total:length"] == 0
    assert log == ["Request cmpl-0 aborted (client disconnected)."]


def test_by_default_the_abort_line_goes_to_stderr_as_docs_serving_states(tmp_path, capsys):
    """docs/serving.md: ``INFO kvsim serve: Request cmpl-N aborted (client
    disconnected).``, on stderr, one line; nothing on stdout."""

    async def scenario() -> None:
        sc = make_scenario(tmp_path, workload=NO_WORKLOAD, mtp=NO_DRAFTS)
        engine = LiveEngine(sc, "on")
        request_id, _ = engine.add_request(list(range(10)), 2)
        engine.abort(request_id, "client disconnected")

    asyncio.run(scenario())
    captured = capsys.readouterr()
    assert captured.err == "INFO kvsim serve: Request cmpl-0 aborted (client disconnected).\n"
    assert captured.out == ""


# ------------------------------------------------------------------ output
def test_a_request_streams_its_positions_and_counts_its_prompt_at_the_first_token(tmp_path):
    """A 64-token prompt, 5 outputs, no drafts: one token a step, the ids
    64..68 (their positions), finished on the last only. The prompt's 64
    tokens are counted with the first token; one request finished by length."""
    engine, _ = _engine(tmp_path, speed=50.0)

    async def check() -> tuple[dict[str, float], list[TokenDelta], dict[str, float]]:
        _, queue = engine.add_request(list(range(64)), 5)
        first = await queue.get()
        at_first = _page(engine)
        rest = await _all_deltas(queue)
        await asyncio.sleep(0)
        return at_first, [first, *rest], _page(engine)

    at_first, deltas, after = _running(engine, check)
    assert at_first["vllm:prompt_tokens_total"] == 64 and at_first["vllm:generation_tokens_total"] == 1
    assert [d.token_ids for d in deltas] == [[64], [65], [66], [67], [68]]
    assert [d.finished for d in deltas] == [False, False, False, False, True]
    assert after["vllm:prompt_tokens_total"] == 64 and after["vllm:generation_tokens_total"] == 5
    assert after["vllm:request_success_total:length"] == 1
    assert after["vllm:request_success_total:abort"] == 0
    assert engine.num_unfinished == 0


def test_the_async_engine_streams_the_same_positions(tmp_path):
    """``engine.mode: async`` (a batch queue: calls that apply no output
    come first): the same request gives one token a step, finished on the
    last, as in sync mode. (The ids are not pinned: in async mode the third
    comes out as 69, not its position 66; see docs/mutation/report.md.)"""
    engine, _ = _engine(tmp_path, speed=50.0, engine={"mode": "async"})

    async def check() -> list[TokenDelta]:
        return await _all_deltas(engine.add_request(list(range(64)), 3)[1])

    deltas = _running(engine, check)
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1]
    assert [d.finished for d in deltas] == [False, False, True]


def test_a_step_that_samples_past_the_output_length_sends_only_the_tokens_kept(tmp_path):
    """Every draft accepted (K = 3): the prefill step samples 1 token, each
    decode 4. Six outputs: 1 + 4, then the third step samples 4 but the
    request stops after 1 of them: the deltas are [100], [101..104], [105]."""
    engine, _ = _engine(tmp_path, speed=50.0, mtp=ALL_DRAFTS)

    async def check() -> list[TokenDelta]:
        return await _all_deltas(engine.add_request(list(range(100)), 6)[1])

    deltas = _running(engine, check)
    assert [d.token_ids for d in deltas] == [[100], [101, 102, 103, 104], [105]]
    assert [d.finished for d in deltas] == [False, False, True]


def test_two_requests_each_get_their_own_tokens_and_the_prompts_add_up(tmp_path):
    """Prompts of 40 and 70 tokens, 3 outputs each, sent together: each
    stream holds its own positions; 110 prompt tokens, 6 generated."""
    engine, _ = _engine(tmp_path, speed=50.0)

    async def check() -> tuple[list[list[int]], list[list[int]], dict[str, float]]:
        (_, short), (_, long) = engine.add_request(list(range(40)), 3), engine.add_request(list(range(70)), 3)
        a, b = await asyncio.gather(_all_deltas(short), _all_deltas(long))
        return [d.token_ids for d in a], [d.token_ids for d in b], _page(engine)

    short, long, page = _running(engine, check)
    assert sum(short, []) == [40, 41, 42] and sum(long, []) == [70, 71, 72]
    assert page["vllm:prompt_tokens_total"] == 110 and page["vllm:generation_tokens_total"] == 6
    assert page["vllm:request_success_total:length"] == 2


def test_a_prompt_in_chunks_beside_a_decode_sends_no_empty_delta_and_loses_no_token(tmp_path):
    """Prefill chunks of at most 1,000 tokens: a 5,000-token prompt sent
    first computes in chunks (steps that sample nothing for it) while a
    64-token prompt sent second decodes beside it. Each stream gets only
    deltas with tokens, all its positions, finished on the last."""
    engine, _ = _engine(tmp_path, speed=50.0, scheduler={"long_prefill_token_threshold": 1000})

    async def check() -> tuple[list[TokenDelta], list[TokenDelta]]:
        long, short = engine.add_request(list(range(5000)), 2), engine.add_request(list(range(64)), 5)
        return tuple(await asyncio.gather(_all_deltas(long[1]), _all_deltas(short[1])))

    long, short = _running(engine, check)
    assert sum((d.token_ids for d in long), []) == [5000, 5001]
    assert sum((d.token_ids for d in short), []) == [64, 65, 66, 67, 68]
    for deltas in (long, short):
        assert all(d.token_ids for d in deltas)
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_an_abort_in_a_step_in_flight_leaves_the_other_requests_tokens_whole(tmp_path):
    """Two requests decode together; the first is aborted while a step
    holding both is in flight. The second still gets every one of its
    positions."""
    engine, _ = _engine(tmp_path, speed=20.0)

    async def check() -> list[TokenDelta]:
        (first_id, first), (_, second) = (
            engine.add_request(list(range(64)), 1000),
            engine.add_request(list(range(70)), 6),
        )
        await first.get()
        engine.abort(first_id, "gone")
        return await _all_deltas(second)

    deltas = _running(engine, check)
    assert sum((d.token_ids for d in deltas), []) == [70, 71, 72, 73, 74, 75]


def test_a_prompt_that_leaves_no_room_is_refused_with_vllms_message(tmp_path):
    """max_model_len 64: a 63-token prompt is taken, a 64-token one is not
    (vLLM's message, nothing queued)."""

    async def scenario() -> None:
        sc = make_scenario(
            tmp_path, deployment={"max_num_seqs": 2, "max_model_len": 64}, workload=NO_WORKLOAD, mtp=NO_DRAFTS
        )
        engine = LiveEngine(sc, "on", log=lambda line: None)
        with pytest.raises(PromptTooLong) as refused:
            engine.add_request(list(range(64)), 1)
        assert str(refused.value) == (
            "This model's maximum context length is 64 tokens. However, your request has 64 input tokens."
        )
        assert engine.num_unfinished == 0 and _page(engine)["vllm:num_requests_waiting"] == 0
        engine.add_request(list(range(63)), 1)
        assert _page(engine)["vllm:num_requests_waiting"] == 1

    asyncio.run(scenario())


# -------------------------------------------------------------------- time
def test_virtual_time_is_the_wall_time_since_start_times_the_speed(tmp_path):
    """Started at wall 100 s, speed 4: at wall 102.5 s it is 10 s; a request
    sent then arrives at 10 s."""

    async def scenario() -> None:
        clock = FakeClock(100.0)
        engine, _ = _engine(tmp_path, speed=4.0, clock=clock)
        assert engine.now_s() == 0.0
        clock.now = 102.5
        assert engine.now_s() == 10.0
        engine.add_request(list(range(10)), 1)
        assert engine.scheduler.waiting[0].arrival_s == 10.0

    asyncio.run(scenario())


def _wall_time_of_a_request(tmp_path, speed: float, outputs: int) -> float:
    engine, _ = _engine(tmp_path, speed=speed, step_time=HAND_STEP_TIME)

    async def check() -> float:
        began = time.monotonic()
        await _all_deltas(engine.add_request(list(range(64)), outputs)[1])
        return time.monotonic() - began

    return _running(engine, check)


def test_the_steps_take_their_scaled_time_on_the_wall_clock(tmp_path):
    """The hand step-time model (every step costs its 0.2 s overhead and
    1 ms a token): three outputs take three steps, at least 0.6 s of
    simulated time, so at speed 1 at least 0.6 s of wall time pass before
    the last token. At speed 1000 five steps take about a millisecond of
    wall time: the engine goes straight on from one step to the next
    (an engine that waited on its idle poll, 0.5 s, between steps would
    take 2.5 s)."""
    assert 0.6 <= _wall_time_of_a_request(tmp_path, 1.0, 3) < 10.0
    assert _wall_time_of_a_request(tmp_path, 1000.0, 5) < 1.5


def test_a_fresh_engine_serves_its_models_name_its_plan_and_zero_gauges(tmp_path):
    """Before any request: every gauge 0 (no lag either) under the model
    file's name (``flash-next``, read from the file), the cache info of the
    plan ``plan_kv_cache`` makes for this deployment and layout, nothing
    unfinished, and the core without the steady lane (requests are read
    after every step)."""
    from sim.kv_cache_plan import plan_kv_cache

    clock = FakeClock(100.0)
    engine, log = _engine(tmp_path, speed=4.0, clock=clock)
    page = _page(engine)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert page[name] == 0.0, name
    assert page["kvsim:engine_max_lag_seconds"] == 0.0 and engine.max_lag_s == 0.0
    assert engine.model_name == "flash-next" and engine.num_unfinished == 0 and log == []
    families = {f.name: f for f in engine.metrics.registry.collect()}
    assert {s.labels["model_name"] for s in families["vllm:num_requests_running"].samples} == {"flash-next"}
    sc = engine.sim.scenario
    plan = plan_kv_cache(sc.load_model(), sc.deployment, side_cache_layout=True)
    (info,) = families["vllm:cache_config_info"].samples
    assert (
        info.labels["block_size"],
        info.labels["num_gpu_blocks"],
        info.labels["kv_cache_size_tokens"],
    ) == (
        str(plan.block_size),
        str(plan.num_blocks),
        str(plan.kv_cache_tokens),
    )
    off = plan_kv_cache(sc.load_model(), sc.deployment, side_cache_layout=False)
    assert off.kv_cache_tokens != plan.kv_cache_tokens  # the layout matters here (the control)
    assert engine.sim.core.lane is None and engine.speed == 4.0 and engine.now_s() == 0.0
    clock.now = 101.0
    assert engine.now_s() == 4.0


def test_the_default_speed_is_real_time(tmp_path):
    """The engine keeps wall time unless told: speed 1, as ``kvsim serve
    --speed``'s default ("simulated seconds per wall second (default 1)")."""
    sc = make_scenario(tmp_path, workload=NO_WORKLOAD, mtp=NO_DRAFTS)
    clock = FakeClock(10.0)
    engine = LiveEngine(sc, "on", clock=clock, log=lambda line: None)
    clock.now = 12.5
    assert engine.speed == 1.0 and engine.now_s() == 2.5


@pytest.mark.parametrize("speed", [0.0, -1.0])
def test_a_speed_of_zero_or_less_is_refused(tmp_path, speed):
    with pytest.raises(ValueError, match=f"^speed: expected > 0, got {speed}$"):
        _engine(tmp_path, speed=speed)


def test_a_step_after_an_idle_wait_starts_when_the_engine_woke_and_the_next_when_its_predecessor_landed(
    tmp_path,
):
    """Speed 2, wall 3 s after the start: it is 6 s. After an idle wait a
    step starts at the later of the step clock (4 s) and now (6 s); the next
    ones, with no wait between, at the step clock's 7.5 s and 5 s (their
    predecessors' landings), not at now. After another idle wait: now (6 s)
    over a clock behind it (4 s), a clock ahead of now (9 s) over now."""

    async def scenario() -> None:
        clock = FakeClock(50.0)
        engine, _ = _engine(tmp_path, speed=2.0, clock=clock)
        clock.now = 53.0
        engine.sim.clock.now_s = 4.0
        assert engine.start_s() == 6.0
        engine.sim.clock.now_s = 7.5
        assert engine.start_s() == 7.5
        engine.sim.clock.now_s = 5.0  # a step that landed behind the wall clock
        assert engine.start_s() == 5.0
        await engine._idle()  # nothing arrives: back after the poll
        engine.sim.clock.now_s = 4.0
        assert engine.start_s() == 6.0
        engine.sim.clock.now_s = 9.0
        await engine._idle()
        assert engine.start_s() == 9.0

    asyncio.run(scenario())


def test_a_sleep_lasts_the_virtual_time_over_the_speed_and_a_stop_cuts_it_short(tmp_path):
    """Speed 4, started at wall 100 s (the fake clock stays there): a sleep
    until 2 s virtual lasts 0.5 s of real time; after a stop a sleep until
    an hour returns at once."""

    async def scenario() -> tuple[float, float]:
        engine, _ = _engine(tmp_path, speed=4.0, clock=FakeClock(100.0))
        began = time.monotonic()
        await engine._sleep_until(2.0)
        slept = time.monotonic() - began
        engine.stop()
        began = time.monotonic()
        await engine._sleep_until(3600.0)
        return slept, time.monotonic() - began

    slept, stopped = asyncio.run(scenario())
    assert 0.45 <= slept < 1.5
    assert stopped < 0.2


# ----------------------------------------------------------------- /metrics
class _Plan:
    block_size, num_blocks, kv_cache_tokens = 3200, 7, 22400


def test_every_vllm_series_carries_vllms_labels_and_every_finish_reason_starts_at_zero():
    """vLLM 0.33.0 (``loggers.py``): every metric is labelled
    ``["model_name", "engine"]`` with values ``[model_name, str(idx)]``
    (one engine: "0"); the finished-request counter adds
    ``finished_reason`` and is created for every ``FinishReason`` (so a
    fresh page shows each reason at 0)."""
    source = VLLM_LOGGERS.read_text()
    label_names = re.search(r"labelnames = (\[[^]]*\])", source)
    assert label_names is not None and ast.literal_eval(label_names.group(1)) == ["model_name", "engine"]
    assert 'labelnames=labelnames + ["finished_reason"]' in source
    families = list(ServerMetrics("flash", _Plan()).registry.collect())
    served = [f for f in families if f.name.startswith("vllm:") and f.name != "vllm:cache_config_info"]
    assert len(served) == 12
    for family in served:
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "finished_reason"}
            assert labels == {"model_name": "flash", "engine": "0"}, sample
    success = next(f for f in families if f.name == "vllm:request_success")
    totals = {s.labels["finished_reason"]: s.value for s in success.samples if s.name.endswith("_total")}
    assert totals == {str(reason): 0.0 for reason in FinishReason}
    assert set(totals) == {"stop", "length", "abort", "error", "repetition"}


def test_the_cache_config_info_gauge_has_vllms_help_and_is_one():
    source = VLLM_LOGGERS.read_text()
    doc = re.search(r'name = "vllm:cache_config_info"\s*documentation = "([^"]*)"', source)
    assert doc is not None
    families = ServerMetrics("flash", _Plan()).registry.collect()
    info = next(f for f in families if f.name == "vllm:cache_config_info")
    assert info.type == "gauge" and info.documentation == doc.group(1)
    assert [s.value for s in info.samples] == [1.0]


def test_a_family_the_replay_does_not_read_is_skipped_and_the_rest_still_read():
    """vLLM's page starts with families the replay does not scrape (the
    process's own, the cache info): each is skipped, never the end of the
    page."""
    page = (
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"
        '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16"} 1.0\n' + GOOD_METRICS
    )
    warnings: list[str] = []
    values = parse_metrics(page, warnings.append)
    assert values["num_requests_running"] == 1.0 and values["num_generation_total_tokens"] == 50.0
    assert values["kv_cache_usage_perc"] == 0.25 and warnings == []


def _parser_error(page: str) -> Exception:
    """What prometheus-client's own parser raises on ``page``."""
    try:
        list(text_string_to_metric_families(page))
    except Exception as error:
        return error
    raise AssertionError("the page parsed")


def _bad_page_of_message_length(length: int) -> tuple[str, str]:
    """A page whose parser error (``could not convert string to float:
    'TOKEN'``) is ``length`` characters long, and that message."""
    stem = len(str(_parser_error("m x\n"))) - 1
    page = f"m {'x' * (length - stem)}\n"
    message = str(_parser_error(page))
    assert len(message) == length
    return page, message


def test_an_unparsable_page_warns_with_the_parsers_error_whole_up_to_120_characters():
    """The warning names the exception's type and its message on one line:
    whole at 120 characters, cut to 117 and "..." at 121."""
    for length, shown in ((120, lambda m: m), (121, lambda m: m[:117] + "...")):
        page, message = _bad_page_of_message_length(length)
        warnings: list[str] = []
        values = parse_metrics(page, warnings.append)
        assert all(math.isnan(v) for v in values.values())
        assert warnings == [f"/metrics: unparsable page (ValueError: {shown(message)})"], length
