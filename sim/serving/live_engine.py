"""The simulator as a live engine: the same ``Simulation`` parts (scheduler
over the real allocator, model runner, engine core and clock) stepped by the
one engine loop (``sim/sched/engine_loop.py``) on the wall clock scaled by
``speed`` instead of by SimPy, in either ``engine.mode``. The steady lane is
off: requests are read after every step and may be aborted between steps.

Virtual time is ``(wall - start) * speed`` seconds. A step that starts right
after the previous one starts at that step's virtual end (not at the wall
time the loop got round to it), so event-loop latency does not add up over a
run; an idle engine starts its next step at the virtual time it woke.

A request whose client goes away is aborted as vLLM's engine core aborts it
(``abort``: ``Scheduler.finish_requests`` with ``FINISHED_ABORTED``), its
blocks freed through the scheduler's own path.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sim.engine import Simulation
from sim.scenario import Scenario, SideCacheSwitch
from sim.sched.engine_core import EngineCall
from sim.sched.engine_loop import IDLE, run_engine
from sim.sched.output import ModelRunnerOutput, StepOutcome
from sim.serving.server_metrics import ServerMetrics
from sim.vllm_bridge import RequestStatus
from sim.workloads import Workload

# An idle engine re-checks for a stop this often (wall seconds): every wait is bounded.
IDLE_POLL_S = 0.5
# Token ids sent back: sampled ids are 2**50 + position (see model_runner);
# clients see the position, a small int like a vocabulary id.
_TOKEN_ID_MASK = (1 << 31) - 1


@dataclass(frozen=True, kw_only=True)
class LiveRequestSpec:
    """A request that came over HTTP (the scheduler's ``RequestSpec``)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    token_ids: tuple[int, ...]

    def prompt_token_ids(self) -> list[int]:
        return list(self.token_ids)


@dataclass(frozen=True)
class TokenDelta:
    """Tokens one step produced for one request; ``finished`` on the last."""

    token_ids: list[int]
    finished: bool


@dataclass
class _Stream:
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    num_sent: int = 0
    prompt_len: int = 0
    arrival_s: float = 0.0


class PromptTooLong(ValueError):
    """The engine rejects a prompt that leaves no room for an output token."""


def log_to_stderr(line: str) -> None:
    print(f"INFO kvsim serve: {line}", file=sys.stderr, flush=True)


# Requests come over HTTP, not from a workload: the simulation's is empty
# (only ``Simulation.start`` and ``run`` read it, and a live engine calls
# neither).
LIVE_REQUESTS = Workload(name="live", source="live requests over HTTP", requests=())


class LiveEngine:
    def __init__(
        self,
        scenario: Scenario,
        layout: SideCacheSwitch,
        *,
        speed: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = log_to_stderr,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed: expected > 0, got {speed}")
        self.sim = Simulation(scenario, layout, LIVE_REQUESTS, steady_lane=False)
        self.scheduler = self.sim.scheduler
        self.model_name = scenario.load_model().name
        self.metrics = ServerMetrics(self.model_name, self.sim.plan)
        self.speed = speed
        self._clock = clock
        self._log = log
        self._start_wall = clock()
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()  # cuts a step's wait short at a stop
        self._was_idle = True
        self.max_lag_s = 0.0
        self._publish_gauges()

    # ----------------------------------------------------------------- time
    def now_s(self) -> float:
        return (self._clock() - self._start_wall) * self.speed

    def _arrival_s(self) -> float:
        """When the engine takes a request in. A busy engine's next step
        starts at its clock's time (when the last step landed); one that
        lags the wall clock runs that step late, with every request that
        came meanwhile: those are stamped with that step's start, so the
        arrivals reported (``ARRIVAL_HEADER``) keep the steps' order."""
        now_s = self.now_s()
        return now_s if self._was_idle else min(now_s, self.sim.clock.now_s)

    async def _sleep_until(self, virtual_s: float) -> None:
        """Until ``virtual_s``, or a stop (a slow engine's step may last hours)."""
        wall_s = max(0.0, virtual_s / self.speed + self._start_wall - self._clock())
        try:
            await asyncio.wait_for(self._stopped.wait(), wall_s)
        except TimeoutError:
            pass

    # --------------------------------------------------------------- intake
    def add_request(self, token_ids: list[int], max_tokens: int) -> tuple[str, asyncio.Queue[TokenDelta]]:
        """Queue a request; its tokens arrive on the returned queue."""
        request_id = f"cmpl-{next(self._ids)}"
        spec = LiveRequestSpec(
            request_id=request_id,
            arrival_s=self._arrival_s(),
            prompt_len=len(token_ids),
            output_len=max_tokens,
            token_ids=tuple(token_ids),
        )
        if not self.scheduler.add_request(spec):
            raise PromptTooLong(
                f"This model's maximum context length is {self.scheduler.config.max_model_len} tokens. "
                f"However, your request has {len(token_ids)} input tokens."
            )
        stream = _Stream(prompt_len=len(token_ids), arrival_s=spec.arrival_s)
        self._streams[request_id] = stream
        self._publish_gauges()
        self._wakeup.set()
        return request_id, stream.queue

    def abort(self, request_id: str, cause: str) -> bool:
        """Abort a request whose client is gone (or whose wait ran out), as
        vLLM's ``EngineCore.abort_requests`` does: finished with
        ``FINISHED_ABORTED`` by the scheduler, which frees its blocks (fenced
        while a step in flight may write them); counted in ``/metrics``; one
        log line (vLLM's "Request ... aborted."). False when it had already
        finished or been aborted."""
        if self._streams.pop(request_id, None) is None:
            return False
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.metrics.request_finished("abort")
        self._log(f"Request {request_id} aborted ({cause}).")
        self._publish_gauges()
        self._wakeup.set()  # an idle engine lets the fences pass
        return True

    def arrival_s(self, request_id: str) -> float:
        """When the engine took the request in (its virtual seconds): the
        order and times a replay needs to simulate what this server saw."""
        return self._streams[request_id].arrival_s

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return len(self._streams)

    # ---------------------------------------------------------------- loop
    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._wakeup.set()

    async def run(self) -> None:
        """The engine loop, its pauses slept on the scaled wall clock."""
        # At rest the steps in flight complete, so the blocks fenced behind
        # them (the last finished or aborted requests') return.
        steps = run_engine(self.sim.core, self.sim.clock, self, settle_at_rest=True)
        for pause in steps:
            if pause is IDLE:
                self._publish_gauges()
                await self._idle()
                continue
            landed_s = self.sim.clock.now_s
            await self._sleep_until(landed_s)
            # Behind the wall clock when a step's computing took longer than
            # its scaled duration: --speed is then too high for this machine.
            self.max_lag_s = max(self.max_lag_s, self.now_s() - landed_s)

    # The engine loop's I/O (``engine_loop.EngineIO``). A step that starts
    # right after the previous one starts at the clock's time, when that
    # one landed; after an idle wait, at the time the engine woke.
    def start_s(self) -> float:
        clock = self.sim.clock
        if self._was_idle:
            self._was_idle = False
            return max(clock.now_s, self.now_s())
        return clock.now_s

    def arrivals_ended(self) -> bool:
        return False  # a client may always send one more

    def stopped(self) -> bool:
        return self._stopping

    def record(self, call: EngineCall, started_s: float, step_s: float) -> None:
        output, outcome = call.processed, call.outcome
        if output is None or output.is_empty or outcome is None:
            return
        assert call.sampled is not None, "no steady lane: every step's tokens are sampled"
        prompt_tokens = self._prompt_tokens(outcome)  # before finished streams go
        self._deliver(call.sampled, outcome)
        self.metrics.record_step(output, outcome, prompt_tokens)
        self._publish_gauges()

    async def _idle(self) -> None:
        """Wait for an arrival (or a stop), at most ``IDLE_POLL_S``."""
        self._was_idle = True
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
        except TimeoutError:
            pass

    # ---------------------------------------------------------------- output
    def _prompt_tokens(self, outcome: StepOutcome) -> int:
        """vLLM counts a prompt's tokens when its first token comes out."""
        return sum(self._streams[r].prompt_len for r in outcome.first_token_request_ids if r in self._streams)

    def _deliver(self, runner_output: ModelRunnerOutput, outcome: StepOutcome) -> None:
        """Hand each request the tokens this step appended (several with MTP)."""
        for request_id, sampled in runner_output.sampled_token_ids.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            finished = request_id in outcome.finished
            total = outcome.finished[request_id] if finished else self._num_output_tokens(request_id)
            new = total - stream.num_sent
            if new <= 0 and not finished:
                continue
            stream.num_sent = total
            stream.queue.put_nowait(TokenDelta([t & _TOKEN_ID_MASK for t in sampled[:new]], finished))
            if finished:
                del self._streams[request_id]
                self.metrics.request_finished("length")

    def _num_output_tokens(self, request_id: str) -> int:
        request = self.scheduler.requests.get(request_id)
        return 0 if request is None else request.num_output_tokens

    def _publish_gauges(self) -> None:
        self.metrics.set_gauges(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.sim.kv_cache_manager.block_pool.get_usage(),
            max_lag_s=self.max_lag_s,
        )
