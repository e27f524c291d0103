"""The scheduler's queues from outside a step: arrivals in, aborts out.

Part of the twin of ``vllm/v1/core/sched/scheduler.py`` (0.33.0):
``add_request`` and ``finish_requests`` with the queue sizes, a base of
``Scheduler`` (``scheduler.py``) holding no state of its own (the scheduler
builds it). kvsim keeps an arrival as its ``RequestSpec`` until it reaches
the queue head (``_materialize``), so a long waiting queue holds no token
lists.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from itertools import compress
from operator import not_
from typing import TYPE_CHECKING, Any

from sim.sched.fast_path.waiting_queue import WaitingQueue
from sim.vllm_bridge import Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from sim.sched.scheduler import RequestSpec, SchedulerConfig


class RequestQueues:
    """The waiting and running queues' entries and exits between steps."""

    config: SchedulerConfig
    requests: dict[str, Request]
    waiting: WaitingQueue
    running: list[Request]
    num_rejected: int
    _num_arrived_since_schedule: int
    _params_by_output_len: dict[int, SamplingParams]
    block_hasher: Callable[[Request], list[Any]]

    if TYPE_CHECKING:

        def _free_request(self, request: Request) -> None: ...

    # ------------------------------------------------------------------ intake
    def add_request(self, spec: RequestSpec) -> bool:
        """Queue an arrival; False (and counted) when the prompt leaves no room
        for one output token within ``max_model_len``, as the engine rejects it."""
        if spec.prompt_len >= self.config.max_model_len:
            self.num_rejected += 1
            return False
        self.waiting.append(spec)
        self._num_arrived_since_schedule += 1
        return True

    def _materialize(self, spec: RequestSpec) -> Request:
        """Build the vLLM ``Request`` only when it reaches the queue head, so
        a long waiting queue holds no token lists."""
        request = Request(
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids(),
            sampling_params=self._sampling_params(spec.output_len),
            pooling_params=None,
            arrival_time=spec.arrival_s,
            block_hasher=self.block_hasher,
        )
        self.requests[spec.request_id] = request
        return request

    def _sampling_params(self, output_len: int) -> SamplingParams:
        """One ``SamplingParams`` per output length, shared by the requests
        that have it (building one costs as much as the rest of an
        admission; ``Request`` only reads it)."""
        params = self._params_by_output_len.get(output_len)
        if params is None:
            params = SamplingParams(max_tokens=output_len, ignore_eos=True)
            self._params_by_output_len[output_len] = params
        return params

    def _waiting_requests(self, skip: Container[int] = frozenset()) -> Iterator[Request]:
        """The waiting queue in order, each entry built as it is reached
        (the pin pass reads requests behind the head), less the entries (by
        ``id``) in ``skip``."""
        entries = list(self.waiting)
        # The kept indices found without a Python step per entry: a pass
        # after an idle one skips nearly all of ~1,000 waiters.
        kept = compress(range(len(entries)), map(not_, map(skip.__contains__, map(id, entries))))
        for index in kept:
            entry = entries[index]
            if not isinstance(entry, Request):
                entry = self.waiting[index] = self._materialize(entry)
            yield entry

    def _peek_waiting(self) -> Request:
        head = self.waiting[0]
        if isinstance(head, Request):
            return head
        request = self._materialize(head)
        self.waiting[0] = request
        return request

    # ------------------------------------------------------------------ aborts
    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        """Finish requests from outside the scheduler (vLLM's
        ``Scheduler.finish_requests``, which ``EngineCore.abort_requests``
        calls with ``FINISHED_ABORTED`` when a client goes away): each
        known, unfinished request leaves its queue, takes the status and
        frees its blocks as a finished one does (fenced while a step in
        flight may write them). ``None`` finishes every request. Returns the
        requests finished; unknown or finished ids are skipped. Deliberate
        differences: ids are taken in the order given, ``None`` in arrival
        order (vLLM iterates a set, whose order varies between processes,
        and the free order moves block ids); a waiting request kvsim has not
        built yet (``_materialize``) is built first, so the caller gets a
        ``Request`` as from vLLM."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        wanted = None if request_ids is None else dict.fromkeys(request_ids)
        found = {
            entry.request_id: entry
            for entry in (*self.waiting, *self.running)
            if wanted is None or entry.request_id in wanted
        }
        if not found:
            return []
        self._drop_from_queues(set(found))
        order = sorted(found, key=lambda i: _arrival_s(found[i])) if wanted is None else wanted
        finished = []
        for request_id in (i for i in order if i in found):
            entry = found[request_id]
            request = entry if isinstance(entry, Request) else self._materialize(entry)
            request.status = finished_status
            self._free_request(request)
            finished.append(request)
        return finished

    def _drop_from_queues(self, request_ids: set[str]) -> None:
        """Both queues without ``request_ids``, kept in place and in order."""
        kept = [entry for entry in self.waiting if entry.request_id not in request_ids]
        self.waiting.clear()
        self.waiting.extend(kept)
        self.running[:] = [r for r in self.running if r.request_id not in request_ids]

    # ------------------------------------------------------------------- state
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)


def _arrival_s(entry: Request | RequestSpec) -> float:
    return entry.arrival_time if isinstance(entry, Request) else entry.arrival_s
