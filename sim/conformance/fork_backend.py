"""The fork's own ``Scheduler`` as a conformance backend: a child process
with the fork's interpreter runs ``fork_server.py``; this side owns the clock,
the acceptance draws and the comparison, exactly as for vLLM's Scheduler
(``backends.VllmBackend``), and talks to it one JSON line at a time.

The fork's scheduler-side code never enters kvsim: the child imports it from
the user's build (``fork_venv.py``). Every wait on the child is bounded, and
the child is stopped when the backend closes, also on failure.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sim.config import ConfigError
from sim.conformance.backends import ComparedStep, scheduled_request
from sim.fork.patches import AS_SHIPPED, ForkPatches
from sim.model_specs import build_worker_specs
from sim.scenario import Scenario, SideCacheSwitch
from sim.sched.model_runner import ModelRunner
from sim.sched.output import SchedulerOutput
from sim.sched.scheduler import RequestSpec

SERVER = Path(__file__).resolve().parents[1] / "vllm_bridge" / "fork_server.py"
# Seconds one answer may take: building the planner's config imports vLLM.
INIT_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 120.0
# An engine call asks what its step sampled at most once.
MAX_CALLBACKS_PER_CALL = 4


class ForkUnavailable(ConfigError):
    """The fork's Scheduler cannot be built or stopped answering (one line)."""


# ------------------------------------------------------------ layer specs
def encode_value(value: Any) -> Any:
    """A spec field as JSON: dtypes by name, enums by member name."""
    if isinstance(value, enum.Enum):
        return {"enum": value.name}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return [encode_value(v) for v in value]
    return value


def encode_spec(spec: Any) -> dict[str, Any]:
    return {
        "type": type(spec).__name__,
        "fields": {f.name: encode_value(getattr(spec, f.name)) for f in dataclasses.fields(spec)},
    }


def encode_workers(scenario: Scenario) -> tuple[int, list[list[tuple[str, dict[str, Any]]]]]:
    """The hybrid block size and every rank's layer specs in registration
    order (the fork flags the MTP draft's group by the last registered layer)."""
    specs, workers = build_worker_specs(scenario.load_model(), scenario.deployment)
    encoded = [[(layer, encode_spec(spec)) for layer, spec in worker.items()] for worker in workers]
    return specs.block_size, encoded


def fork_environment(layout: SideCacheSwitch, patches: ForkPatches = AS_SHIPPED) -> dict[str, str]:
    """The fork's switches as its launcher (``scripts/serve-v2.5.sh``) sets
    them; the layout switch per compared layout, retention as the scenario
    sets it (the fork's one switch among the modelled patches)."""
    return {
        "VLLM_E2_SIDE_CACHE_LAYOUT": "1" if layout == "on" else "0",
        "VLLM_E2_MAMBA_RETAIN_CHECKPOINT": "1" if patches.mamba_retain_checkpoint else "0",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }


def fork_pin_switches(scenario: Scenario) -> dict[str, bool]:
    """The scenario's fork switches as the fork's side can run them, or a
    one-line error for one it cannot. The fork has no switch for 0093-0097;
    v2.5.0 is v2.5.1 without them (its CHANGELOG), and the fork's code gates
    0093, 0094 and 0097 on a match unit finer than the block, so at the
    block's unit only the waiter pins (0095/0096) act: the child bounds them
    at no waiters, and turns graces off as the fork does under a connector.
    The base-version rules and 0023 are the fork's code as built."""
    patches = scenario.fork.patches()
    fixed = ("deferred_free_eviction_order", "threshold_caps_lone_request", "caches_at_allocation_only")
    for name in fixed:
        if not getattr(patches, name):
            raise ConfigError(f"--fork: fork.{name}=false: the fork's code has no switch for it")
    hash_unit = scenario.deployment.prefix_match_unit
    block_size = build_worker_specs(scenario.load_model(), scenario.deployment)[0].block_size
    finer_than_block = hash_unit is not None and hash_unit < block_size
    if patches.mamba_retain_checkpoint and not patches.mamba_hold_partial_tail and finer_than_block:
        raise ConfigError(
            "--fork: fork.mamba_hold_partial_tail=false: the fork has no switch for 0093, "
            "which acts with a prefix-match unit finer than the block (set the unit to the block)"
        )
    return {"waiter_pins": patches.waiter_pins, "grace_pins": patches.grace_pins}


def fork_settings(scenario: Scenario, block_size: int, *, async_scheduling: bool) -> dict[str, Any]:
    d, s = scenario.deployment, scenario.scheduler
    return {
        "max_model_len": d.max_model_len,
        "max_num_seqs": d.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "long_prefill_token_threshold": s.long_prefill_token_threshold,
        "scheduler_reserve_full_isl": s.scheduler_reserve_full_isl,
        "tensor_parallel_size": d.tensor_parallel_size,
        "pipeline_parallel_size": d.pipeline_parallel_size,
        "block_size": block_size,
        "num_speculative_tokens": scenario.load_model().mtp.num_speculative_tokens,
        "enable_prefix_caching": scenario.allocator.enable_prefix_caching,
        "prefix_match_unit": d.prefix_match_unit,
        "async_scheduling": async_scheduling,
        "kv_cache_layout": d.kv_cache_layout,
        "patches": fork_pin_switches(scenario),
    }


# ------------------------------------------------------------- the child
class ForkProcess:
    """The child running ``fork_server.py``; a context manager that always
    stops it."""

    def __init__(self, python: Path, server: Path = SERVER) -> None:
        self._log = tempfile.TemporaryFile(mode="w+")
        # A fixed string hash: the fork iterates a set of request ids where
        # two graces go at once (kvsim: oldest first); fixed, a recording
        # is reproducible.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}
        env.pop("PYTHONPATH", None)  # kvsim's own modules need vLLM 0.33.0
        self.process = subprocess.Popen(
            [str(python), "-P", str(server)],  # -P: not its own folder on sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def __enter__(self) -> ForkProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(
        self,
        op: str,
        timeout_s: float = CALL_TIMEOUT_S,
        on_callback: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """One op; the child may ask questions (``callback``) before it
        answers, each answered by ``on_callback``. Every wait is bounded."""
        message: dict[str, Any] = {"op": op, **params}
        for _ in range(MAX_CALLBACKS_PER_CALL):
            answer = self._exchange(message, op, timeout_s)
            if "callback" not in answer:
                return answer
            if on_callback is None:
                raise ForkUnavailable(f"the fork's scheduler asked an unexpected question ({op})")
            message = on_callback(answer)
        raise ForkUnavailable(
            f"the fork's scheduler asked more than {MAX_CALLBACKS_PER_CALL} questions ({op})"
        )

    def _exchange(self, message: dict[str, Any], op: str, timeout_s: float) -> dict[str, Any]:
        process = self.process
        assert process.stdin is not None and process.stdout is not None
        watchdog = threading.Timer(timeout_s, process.kill)
        watchdog.start()
        try:
            process.stdin.write(json.dumps(message) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        finally:
            watchdog.cancel()
        if not line:
            raise ForkUnavailable(f"the fork's scheduler stopped answering ({op}): {self._last_log_line()}")
        answer = json.loads(line)
        if "error" in answer:
            raise ForkUnavailable(f"the fork's scheduler failed: {answer['error']}")
        return answer

    def _last_log_line(self) -> str:
        self._log.seek(0)
        lines = [line.strip() for line in self._log.read().splitlines() if line.strip()]
        return lines[-1][:300] if lines else "no output"

    def close(self) -> None:
        process = self.process
        try:
            if process.poll() is None and process.stdin is not None:
                process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                process.stdin.flush()
            process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait(timeout=10)
        finally:
            self._log.close()


# ------------------------------------------------------------ the backend
class _ForkSide:
    """What both ways of stepping the fork share: the child built for the
    scenario and layout (``async_scheduling``: its engine core's batch queue)
    and requests sent to it as vLLM's input processor hands them over."""

    name = "fork"
    async_scheduling = False

    def __init__(
        self, process: ForkProcess, scenario: Scenario, layout: SideCacheSwitch, runner: ModelRunner
    ):
        self.process = process
        self.runner = runner
        self.max_model_len = scenario.deployment.max_model_len
        block_size, workers = encode_workers(scenario)
        self.description = process.call(
            "init",
            timeout_s=INIT_TIMEOUT_S,
            settings=fork_settings(scenario, block_size, async_scheduling=self.async_scheduling),
            workers=workers,
            memory_bytes=[scenario.deployment.kv_cache_memory_bytes] * _num_workers(scenario),
            environment=fork_environment(layout, scenario.fork.patches()),
        )
        self._has_work = self._has_unfinished = False

    def add_request(self, spec: RequestSpec) -> bool:
        if spec.prompt_len >= self.max_model_len:
            return False  # vLLM's input processor rejects it
        self.process.call(
            "add",
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids(),
            max_tokens=spec.output_len,
            arrival_s=spec.arrival_s,
        )
        self._has_work = self._has_unfinished = True
        return True


class ForkBackend(_ForkSide):
    """The fork's Scheduler, stepped as ``EngineCore.step`` steps it."""

    def __init__(
        self, process: ForkProcess, scenario: Scenario, layout: SideCacheSwitch, runner: ModelRunner
    ):
        super().__init__(process, scenario, layout, runner)
        self._token_counts: dict[str, int] = {}

    def has_unfinished_requests(self) -> bool:
        return self._has_unfinished

    def complete_in_flight_steps(self) -> bool:
        return False  # one step at a time: the fence passes with each output

    def schedule(self) -> SchedulerOutput:
        answer = self.process.call("schedule")
        self._token_counts = {row[0]: row[3] for row in answer["scheduled"]}
        return scheduler_output(answer)

    def execute(self, output: SchedulerOutput) -> ComparedStep:
        sampled = self.runner.execute(output, self._token_counts).sampled_token_ids
        answer = self.process.call("update", sampled={rid: list(ids) for rid, ids in sampled.items()})
        self._has_unfinished = answer["has_unfinished"]
        return compared_step(output, answer)


def compared_step(output: SchedulerOutput, answer: dict[str, Any]) -> ComparedStep:
    return ComparedStep(
        scheduled_tokens=tuple(
            (r.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in output.scheduled
        ),
        admitted=output.new_request_ids,
        resumed=output.resumed_request_ids,
        preempted=output.preempted_request_ids,
        finished=tuple(answer["finished"]),
        running=tuple(answer["running"]),
        waiting=tuple(answer["waiting"]),
        num_free_blocks=answer["num_free_blocks"],
        prefix_cache_queries_tokens=answer["prefix_cache_queries_tokens"],
        prefix_cache_hits_tokens=answer["prefix_cache_hits_tokens"],
        fork_state=fork_state_of(answer["fork"]),
    )


def fork_state_of(record: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The fork's additions as one comparable value (kvsim reports the same)."""
    return tuple(
        (key, tuple(value) if isinstance(value, list) else value) for key, value in sorted(record.items())
    )


def _num_workers(scenario: Scenario) -> int:
    d = scenario.deployment
    return d.tensor_parallel_size * d.pipeline_parallel_size


# ---------------------------------------------------- the fork's batch queue
class ForkEngine(_ForkSide):
    """The fork's own ``EngineCore.step_with_batch_queue`` over its
    ``AsyncScheduler`` (the rig's mode), one engine call a step of the
    comparison, as ``async_engine._VllmEngine`` drives vLLM 0.33.0's. The
    child asks this side what each step sampled (the shared runner)."""

    async_scheduling = True

    def __init__(
        self, process: ForkProcess, scenario: Scenario, layout: SideCacheSwitch, runner: ModelRunner
    ):
        super().__init__(process, scenario, layout, runner)
        self._in_flight: deque[SchedulerOutput] = deque()
        # The engine loop's adapter asks the scheduler whether requests are
        # unfinished; the fork's answers come with each call.
        self.scheduler = self

    def has_work(self) -> bool:
        return self._has_work

    def has_unfinished_requests(self) -> bool:
        return self._has_unfinished

    def only_empty_in_flight(self) -> bool:
        return self._only_empty_in_flight

    def _sample(self, question: dict[str, Any]) -> dict[str, Any]:
        output = scheduler_output(question["scheduled"])
        sampled = self.runner.execute_sampling(output, question["samples"]).sampled_token_ids
        return {"sampled": {rid: list(ids) for rid, ids in sampled.items()}}

    def step(self) -> tuple[Any, Any]:
        from sim.conformance.async_engine import compared_call
        from sim.sched.engine_core import EngineCall

        answer = self.process.call("engine_step", on_callback=self._sample)
        self._has_work, self._has_unfinished = answer["has_work"], answer["has_unfinished"]
        scheduled = scheduler_output(answer["scheduled"]) if answer["scheduled"] else None
        if scheduled is not None:
            self._in_flight.append(scheduled)
        processed = self._in_flight.popleft() if answer["processed"] else None
        self._only_empty_in_flight = answer["in_flight_empty"]
        call = EngineCall(scheduled, answer["samples"], waits=processed is not None, processed=processed)
        state = compared_call(
            call,
            placeholders=answer["placeholders"],
            finished=answer["finished"],
            running=answer["running"],
            waiting=answer["waiting"],
            num_free_blocks=answer["num_free_blocks"],
            prefix=(answer["prefix_cache_queries_tokens"], answer["prefix_cache_hits_tokens"]),
        )
        return call, dataclasses.replace(state, fork_state=fork_state_of(answer["fork"]))


def scheduler_output(record: dict[str, Any]) -> SchedulerOutput:
    """kvsim's record of a step of the fork's scheduler or engine (the clock's
    and the runner's input), from the rows ``fork_server.scheduled_row``
    wrote."""
    return SchedulerOutput(
        step_index=record["step_index"],
        scheduled=tuple(
            scheduled_request(
                SimpleNamespace(request_id=rid, num_computed_tokens=computed_after, num_tokens=num_tokens),
                n,
                num_drafts,
                is_padded,
            )
            for rid, n, computed_after, num_tokens, num_drafts, is_padded in record["scheduled"]
        ),
        new_request_ids=tuple(record["new"]),
        resumed_request_ids=tuple(record["resumed"]),
        preempted_request_ids=tuple(record["preempted"]),
    )
