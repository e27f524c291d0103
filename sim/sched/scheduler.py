"""A simulated vLLM scheduler that drives the real allocator.

Twin of ``vllm/v1/core/sched/scheduler.py`` (0.33.0), reduced to what moves
KV blocks: the RUNNING loop first (allocate, or preempt the newest running
request by recompute), then the WAITING loop only in steps that preempted
nothing (prefix-cache lookup, the full-sequence admission gate, head-of-line
blocking), chunked prefill clipped on Mamba block boundaries by vLLM's own
split, MTP drafts with K lookahead slots, and fenced (deferred) frees.

Plain synchronous Python: no clock, no SimPy. ``schedule()`` returns a
``SchedulerOutput``; ``update_from_output()`` applies what the workers
sampled. One token-accounting rule, as in vLLM: a request's computed tokens
chase its tokens (prompt, outputs, drafts); rejected drafts roll them back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import compress
from operator import not_
from typing import Protocol

from sim.fork.scheduler_pins import NoPins, SchedulerPins, scheduler_pins
from sim.kv_cache_manager import KVCacheManager, MTPHashing
from sim.sched.fast_path.memos import fast_path_of
from sim.sched.fast_path.steady import NO_OFFER, SKIP, LaneOffer
from sim.sched.fast_path.waiting_queue import WaitingQueue
from sim.sched.model_runner import OUTPUT_TOKEN_BASE
from sim.sched.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepOutcome,
    StepTally,
    is_decoding,
)
from sim.sched.stats import PrefixCacheStats, SchedulerGauges, SchedulerStats, SpecDecodingStats
from sim.vllm_bridge import (
    BlockRemoved,
    KVCacheBlock,
    KVCacheBlocks,
    MambaAlignedSplit,
    Request,
    RequestStatus,
    SamplingParams,
    check_stop,
    get_request_block_hasher,
    sha256,
)


class RequestSpec(Protocol):
    """What the scheduler needs of an arriving request (the workloads'
    ``RequestSpec`` satisfies it; the scheduler does not import workloads)."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    def prompt_token_ids(self) -> list[int]: ...


# Drafts are never hashed or cached; their ids only need to be ints.
DRAFT_TOKEN_ID = OUTPUT_TOKEN_BASE - 1


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The engine flags that shape scheduling (vLLM's names)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_speculative_tokens: int
    long_prefill_token_threshold: int = 0
    # vLLM 0.30.0 (the fork's base) caps a lone request's prefill too; 0.33.0
    # spares it (``fork.threshold_caps_lone_request``).
    threshold_caps_lone_request: bool = False
    # 0.33.0's synchronous scheduler caches blocks after each sampled step
    # with drafts; 0.30.0's only in allocate_slots (``fork.caches_at_allocation_only``).
    caches_after_sampling: bool = True
    # vLLM's scheduler_reserve_full_isl: admit only if the whole prompt fits.
    scheduler_reserve_full_isl: bool = True
    # Fenced frees: freed blocks return once the steps still in flight that
    # may write them complete (PP=2 with async scheduling: 2 in flight).
    defer_block_free: bool = True
    max_concurrent_batches: int = 2
    # MTP hashing (EAGLE block drop, the fork's setting, or lookahead
    # hashes); must match the KVCacheManager's.
    mtp_hashing: MTPHashing = MTPHashing()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be at least 1, got {self.max_concurrent_batches}")


class SchedulerObserver:
    """Hooks for a caller that watches the scheduler's steps as they happen
    (the pool replay, ``sim/pool_replay/``); each a no-op here. The scheduler
    calls them; an observer reads, never changes, its state. Frees are the
    manager's hook (``KVCacheManager.observer``)."""

    def step_starts(self, step_index: int) -> None:
        """``schedule()`` begins the step ``step_index``."""

    def step_scheduled(self, output: SchedulerOutput) -> None:
        """``schedule()`` returns ``output``."""

    def output_arrives(self, output: SchedulerOutput) -> None:
        """A step's output arrived, before its fences pass (the steady lane's
        steps too: fast-path rule 8)."""

    def prefix_hit(self, request: Request, blocks: KVCacheBlocks, num_hit: int) -> None:
        """The waiting loop's lookup found ``num_hit`` cached tokens."""


@dataclass(slots=True)
class _StepState:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    new_ids: list[str] = field(default_factory=list)
    resumed_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    admitted_hits: dict[str, int] = field(default_factory=dict)
    # The RUNNING loop scheduled someone / someone mid-prefill (vLLM's
    # ``scheduled_running_reqs`` / ``prefill_scheduled``).
    running_scheduled: bool = False
    prefill_scheduled: bool = False
    padded_ids: set[str] = field(default_factory=set)
    # The steady lane's share of the step (``fast_path/steady.py``).
    offer: LaneOffer = NO_OFFER


class Scheduler:
    """FCFS scheduler over one ``KVCacheManager``: one class, as vLLM's
    ``Scheduler`` is (its size exception, ``tests/test_code_size.py``), so
    it diffs against upstream in one file. In order: arrivals, aborts and
    the queue sizes (``add_request``, ``finish_requests``); the step
    (``schedule``: the running loop, the steady lane's share of it, the
    waiting loop, admission); the output (``update_from_output``);
    preemption, finish and fenced frees; gauges and stats (the records are
    ``stats.py``'s).

    ``fast_path``: skip the work that changes nothing (``fast_path/``: a
    decode's allocator calls between block boundaries, behind the
    allocator's door, the steady lane, a waiting loop known to admit
    nobody); the steps, frames and allocator states are the same either
    way. Beyond the door it enters at a few named points, each a call on
    ``self.fast_path`` (a ``NoFastPath`` when off).

    While a request is in the steady lane its ``Request`` is stale
    (fast-path rule 5): read ``requests`` and ``running`` after
    ``EngineCore.flush``.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        # With the fast path on, the allocator behind its door (``fast_path/kv_cache_manager.py``,
        # built by ``engine_assembly.build_engine``).
        self.kv_cache_manager = kv_cache_manager
        self.split = MambaAlignedSplit(
            block_size=config.block_size,
            max_num_scheduled_tokens=config.max_num_batched_tokens,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            use_eagle_block_drop=config.mtp_hashing.use_eagle_block_drop,
            num_hash_lookahead_tokens=config.mtp_hashing.num_hash_lookahead_tokens,
            num_prefill_lookahead_tokens=config.mtp_hashing.num_prefill_lookahead_tokens,
            hash_block_size=kv_cache_manager.block_pool.hash_block_size,
            partial_hash_hits=kv_cache_manager.coordinator.enable_partial_hash_hits,
        )
        # vLLM's engine core builds each request's hasher the same way, on the
        # hash block (the prefix-match unit). Requests take it as they are built.
        self.block_hasher = get_request_block_hasher(
            kv_cache_manager.block_pool.hash_block_size, sha256, config.mtp_hashing.num_hash_lookahead_tokens
        )
        # Sub-block prefix hits (a prefix-match unit finer than the block):
        # their copy-on-write blocks are released once copied.
        self._partial_hash_hits = kv_cache_manager.coordinator.enable_partial_hash_hits
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        # (fence step, blocks, is a copy-on-write retention), in free order.
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock], bool]] = deque()
        self.last_sched_seq: dict[str, int] = {}
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.step_index = 0
        self.num_rejected = 0
        # Accepted arrivals since the last schedule(): not in a step's waiting gauge.
        self._num_arrived_since_schedule = 0
        self.num_evicted_blocks = 0
        self._params_by_output_len: dict[int, SamplingParams] = {}
        self.fast_path = fast_path_of(self)
        self.observer = SchedulerObserver()
        # The fork's prefix-hit pins (patches 0095-0097), entered at three
        # named points; NoPins when the manager pins nothing (upstream).
        self.pins: NoPins | SchedulerPins = scheduler_pins(self.kv_cache_manager, self.fast_path)

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

    # ---------------------------------------------------------------- schedule
    def schedule(self, offer: LaneOffer = NO_OFFER) -> SchedulerOutput:
        """``offer``: the steady lane's decodes for this step, which the
        running loop schedules as they are where it would have scheduled
        them unchanged (the fast path's lane)."""
        self.observer.step_starts(self.step_index + 1)
        self._num_arrived_since_schedule = 0
        self.kv_cache_manager.new_step_starts()
        step = _StepState(token_budget=self.config.max_num_batched_tokens, offer=offer)
        self._schedule_running(step)
        if not step.preempted_ids and not self.fast_path.skips_waiting(step):
            self._schedule_waiting(step)
        if not step.preempted_ids:
            self.pins.pin_waiting(self._waiting_requests)  # pin point 3
        output = self._finish_schedule(step)
        self.observer.step_scheduled(output)
        return output

    def _long_prefill_threshold(self) -> int:
        # A lone request may use the whole budget (0.33.0; 0.30.0 caps it).
        eligible = len(self.running) + len(self.waiting)
        spared = eligible <= 1 and not self.config.threshold_caps_lone_request
        return 0 if spared else self.config.long_prefill_token_threshold

    def clip_room(self, request: Request, num_hit: int = 0) -> int:
        """The most tokens a step may schedule for ``request``: room for the
        sampled token within ``max_model_len``."""
        return self.config.max_model_len - request.num_computed_tokens - num_hit - 1

    def _clip(self, request: Request, num_new_tokens: int, budget: int, num_hit: int = 0) -> int:
        threshold = self._long_prefill_threshold()
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, budget)
        num_new_tokens = min(num_new_tokens, self.clip_room(request, num_hit))
        if num_new_tokens <= 0:
            return 0
        num_new_tokens = self.split(request, num_new_tokens, num_hit)
        computed = request.num_computed_tokens + num_hit
        return self.split.reserve_prefill_lookahead(request, computed, num_new_tokens)

    # Async scheduling's running and waiting skips (``async_scheduler.py``);
    # None here, so the synchronous loops pay one test per step.
    _skips_running: Callable[[Request], bool] | None = None
    _skips_waiting: Callable[[Request], bool] | None = None

    def _schedule_running(self, step: _StepState) -> None:
        index = 0
        skips = self._skips_running
        while index < len(self.running) and step.token_budget > 0:
            if step.offer.items:
                index = self._take_offer(index, step)
                if index == len(self.running) or step.token_budget <= 0:
                    break
            request = self.running[index]
            if skips is not None and skips(request):
                index += 1
                continue
            # Output placeholders (async scheduling) count as computed and known.
            num_new = (
                request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
            )
            num_new = self._clip(request, num_new, step.token_budget)
            if num_new == 0:
                index += 1  # not strictly FCFS, as in vLLM
                continue
            if not self._allocate_or_preempt(request, num_new, step):
                break
            step.running_scheduled = True
            step.prefill_scheduled |= request.is_prefill_chunk
            self._record_scheduled(request, num_new, request.num_computed_tokens, step)
            index += 1

    def _take_offer(self, index: int, step: _StepState) -> int:
        """Schedule the lane's decodes for the running requests from
        ``index`` on, each as it is, while the running loop would: the
        budget holds it whole and no long-prefill threshold clips it (its
        allocation is settled and the clip to ``max_model_len`` leaves it
        whole: the lane's part). Stops at the first request the lane did not
        offer, or hands that one back for the ordinary path (also when no
        budget is left: the running loop then stops, and an offered request
        the ordinary path could reach is always handed back first). Returns
        the index of the first request not taken. (A run at a time: it runs
        for every request of every step.)"""
        offer = step.offer
        running, items, scheduled, taken = self.running, offer.items, step.scheduled, offer.taken
        # The running loop preempts nobody here, so the threshold holds throughout.
        threshold = self.config.long_prefill_token_threshold and self._long_prefill_threshold()
        num_running = len(running)  # the loop takes requests, it never removes one
        while index < num_running:
            request_id = running[index].request_id
            item = items.get(request_id)
            if item is None:
                break
            if item is SKIP:  # async: its stagger holds it back, as the running loop's skip would
                index += 1
                continue
            num_new = item.num_scheduled_tokens
            if step.token_budget < num_new or 0 < threshold < num_new:
                offer.hand_over(running[index])
                break
            scheduled[request_id] = item
            taken.add(request_id)
            step.token_budget -= num_new
            step.running_scheduled = True
            index += 1
        return index

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _StepState) -> bool:
        """Allocate, preempting the newest running request (vLLM's FCFS
        victim) until it fits, the victim is the request itself, or the victim's
        blocks cannot be freed at once (a fenced free would not help now)."""
        lookahead = self.config.num_speculative_tokens
        while self.kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead) is None:
            if self.pins.yield_for_running():  # pin point 1: a pin yields before any victim
                continue
            victim = self.running[-1]
            if not self._blocks_can_be_freed(victim):
                return False
            self.running.pop()
            if victim.request_id in step.offer.items:
                step.offer.hand_over(victim)  # not reached yet this step: its tokens back first
            self._preempt(victim)
            step.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: _StepState) -> None:
        self.fast_path.waiting_loop(step, self._admit_waiting)

    def _admit_waiting(self, step: _StepState) -> bool:
        skipped: list[Request] = []
        admitted = self._admit_waiting_requests(step, skipped)
        # Skipped requests go back to the front, in their order (vLLM's
        # prepend); none, no call: the queue would count it as an insertion.
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        return admitted

    def _admit_waiting_requests(self, step: _StepState, skipped: list[Request]) -> bool:
        admitted = False
        skips = self._skips_waiting
        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            if skips is not None and skips(request):
                self.waiting.popleft()
                skipped.append(request)
                continue
            blocks, num_hit, boundary = self.kv_cache_manager.get_computed_blocks(request)
            if num_hit:
                self.observer.prefix_hit(request, blocks, num_hit)
            request.shared_prefix_boundary = boundary
            num_new = request.num_tokens - num_hit
            padded = self._pads_to_uniform_decode(request, num_new, num_hit, step)
            if padded and 1 + self.config.num_speculative_tokens > step.token_budget:
                break  # vLLM prefers not scheduling to scheduling un-padded
            if padded:
                num_new = 1 + self.config.num_speculative_tokens
            num_new = self._clip(request, num_new, step.token_budget, num_hit)
            if num_new == 0:
                break
            if padded and num_new != 1 + self.config.num_speculative_tokens:
                num_new, padded = 1, False  # the split clipped the padding: drop it
            allocate = partial(
                self.kv_cache_manager.allocate_slots,
                request,
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=blocks,
                num_lookahead_tokens=self.config.num_speculative_tokens,
                full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
                has_scheduled_reqs=bool(self.running),
            )
            attempt = partial(self._try_admission, request, blocks, allocate)
            if self.fast_path.admission(request, num_new, attempt) is None:
                break  # head-of-line blocking: never try the requests behind it
            self.kv_cache_manager.record_prefix_cache_stats(request, num_hit)
            if padded:
                step.padded_ids.add(request.request_id)
            self._admit(request, num_hit, num_new, step)
            admitted = True
        return admitted

    def _try_admission(
        self, request: Request, blocks: KVCacheBlocks, allocate: Callable[[], KVCacheBlocks | None]
    ) -> KVCacheBlocks | None:
        """The head's allocation, then the fork's second chance for it."""
        allocated = allocate()
        if allocated is None:
            allocated = self.pins.admit_head(request, blocks, allocate)  # pin point 2
        return allocated

    def _pads_to_uniform_decode(self, request: Request, num_new: int, num_hit: int, step: _StepState) -> bool:
        """vLLM pads an admitted request with one token left (a full prefix
        hit, a resumed decode) to ``1 + K`` rows, placeholder drafts that are
        never accepted, to keep the batch a uniform (CUDA-graph) decode;
        only when no running prefill is in the step and there is room."""
        num_spec = self.config.num_speculative_tokens
        return (
            num_spec > 0
            and num_new == 1
            and not step.prefill_scheduled
            and (step.running_scheduled or num_hit > 0)
            and num_hit + 1 + num_spec + 1 <= self.config.max_model_len
        )

    def _admit(self, request: Request, num_hit: int, num_new: int, step: _StepState) -> None:
        self.waiting.popleft()
        self.fast_path.waiter_admitted(request)
        self.running.append(request)
        ids = step.resumed_ids if request.status == RequestStatus.PREEMPTED else step.new_ids
        ids.append(request.request_id)
        step.admitted_hits[request.request_id] = num_hit
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        self._record_scheduled(request, num_new, num_hit, step)

    def _record_scheduled(self, request: Request, num_new: int, computed: int, step: _StepState) -> None:
        num_spec = max(num_new + computed - request.num_tokens - request.num_output_placeholders, 0)
        step.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id,
            num_scheduled_tokens=num_new,
            num_computed_tokens=computed,
            num_spec_tokens=num_spec,
            num_prompt_tokens_left=0 if is_decoding(computed, request.num_tokens) else num_new - num_spec,
            is_padded=request.request_id in step.padded_ids,
        )
        step.token_budget -= num_new
        request.spec_token_ids = []  # new drafts arrive with the step's output

    def _finish_schedule(self, step: _StepState) -> SchedulerOutput:
        if self._partial_hash_hits:
            self._release_cow_copies()
        if step.scheduled:
            self.sched_step_seq += 1
        self.last_sched_seq.update(dict.fromkeys(step.scheduled, self.sched_step_seq))
        taken = step.offer.taken
        for request_id, item in step.scheduled.items() if len(taken) < len(step.scheduled) else ():
            if request_id in taken:
                continue  # the lane keeps its requests' computed tokens
            request = self.requests[request_id]
            request.num_computed_tokens += item.num_scheduled_tokens
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
        queries, hits = self._take_prefix_cache_stats()
        evicted = sum(
            len(e.block_hashes) for e in self.kv_cache_manager.take_events() if isinstance(e, BlockRemoved)
        )
        self.num_evicted_blocks += evicted
        # vLLM's _get_new_block_ids_to_zero drains the full-attention
        # managers' zeroing record every step (a Mamba model needs zeroing);
        # kvsim has no workers to zero them, but the record must not grow.
        self.kv_cache_manager.take_new_block_ids()
        self.step_index += 1
        return SchedulerOutput(
            step_index=self.step_index,
            scheduled=tuple(step.scheduled.values()),
            new_request_ids=tuple(step.new_ids),
            resumed_request_ids=tuple(step.resumed_ids),
            preempted_request_ids=tuple(step.preempted_ids),
            admitted_hits=dict(step.admitted_hits),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_evicted_blocks=evicted,
            new_ring_block_ids=tuple(self.kv_cache_manager.take_new_ring_block_ids()),
        )

    # ------------------------------------------------------------------ output
    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> StepOutcome:
        """Apply one step's sampled tokens. With ``max_concurrent_batches``
        steps in flight, the output of this step arrives when the steps
        scheduled after it are still running: only the fences up to
        ``sched_step_seq - (batches - 1)`` have passed."""
        self.output_arrives(output)
        tally = StepTally()
        for item in output.scheduled:
            self.apply_sampled(item, runner_output.sampled_token_ids.get(item.request_id, []), tally)
        return tally.outcome()

    def output_arrives(self, output: SchedulerOutput) -> None:
        """A step's output arrived: the fences up to it pass (first, before
        any of its requests' outputs is applied)."""
        self.observer.output_arrives(output)
        if self.config.defer_block_free and not output.is_empty:
            self._advance_processed(self.sched_step_seq - (self.config.max_concurrent_batches - 1))

    def apply_sampled(self, item: ScheduledRequest, sampled: list[int], tally: StepTally) -> None:
        """One scheduled request's sampled tokens: rejected drafts rolled
        back, the tokens appended, the request finished or its blocks cached."""
        request = self.requests.get(item.request_id)
        if request is None or request.is_finished() or not sampled:
            return
        if item.num_spec_tokens:
            num_accepted = len(sampled) - 1
            request.num_computed_tokens -= item.num_spec_tokens - num_accepted
            tally.num_draft_tokens += item.num_spec_tokens
            tally.num_accepted_tokens += num_accepted
        if request.num_output_tokens == 0:
            tally.first_token_request_ids.append(request.request_id)
        appended, stopped = self.take_sampled(request, sampled)
        tally.num_generated_tokens += appended
        if stopped:
            tally.finished[request.request_id] = request.num_output_tokens

    def take_sampled(self, request: Request, sampled: list[int]) -> tuple[int, bool]:
        """Append a step's sampled tokens to ``request`` and finish it if
        they stop it, else cache its blocks and queue its drafts. Returns
        the tokens appended and whether it stopped."""
        appended, stopped = self._append_output(request, sampled)
        if stopped:
            self._finish(request)
        else:
            self._after_sampling(request)
        return appended, stopped

    def _append_output(self, request: Request, sampled: list[int]) -> tuple[int, bool]:
        """Append the step's tokens, stopping as vLLM's ``check_stop`` says.
        kvsim's requests stop by length only (``ignore_eos``, no stop ids,
        output ids far from any EOS), so when the length limits lie past
        every token but the last, none but the last can stop the request:
        they go in at once and ``check_stop`` judges the last. (The
        ``max_model_len`` limit never binds within a step: the scheduler
        leaves a step's tokens room below it.)"""
        if len(sampled) <= self.stop_room(request):
            request.append_output_token_ids(sampled)
            return len(sampled), check_stop(request, self.config.max_model_len)
        # The stop falls within the step: find it token by token, as vLLM does.
        count = 0
        for token in sampled:
            request.append_output_token_ids(token)
            count += 1
            if check_stop(request, self.config.max_model_len):
                break
        return count, True

    def stop_room(self, request: Request) -> int:
        """The tokens ``request`` can take before a length limit stops it
        (the last of them stops it): ``check_stop``'s two limits."""
        return min(
            request.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens
        )

    def _after_sampling(self, request: Request) -> None:
        """Cache the blocks the accepted tokens filled (0.33.0; see config),
        then take the drafter's K new drafts (``update_draft_token_ids``)."""
        if self.config.num_speculative_tokens and self.config.caches_after_sampling:
            self._cache_blocks(request)
        request.spec_token_ids = [DRAFT_TOKEN_ID] * self.config.num_speculative_tokens

    def _cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """``cache_blocks`` up to ``num_computed_tokens`` (default: the
        request's computed tokens)."""
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        self.kv_cache_manager.cache_blocks(request, computed)

    # ------------------------------------------------------------- preemption
    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free (or fence) the blocks, back to the front
        of the waiting queue with no computed tokens; outputs are kept."""
        self._free_request_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----------------------------------------------------------- fenced frees
    def _blocks_can_be_freed(self, request: Request) -> bool:
        if not self.config.defer_block_free:
            return True
        return self.last_sched_seq.get(request.request_id, 0) <= self.processed_step_seq

    def _free_request_blocks(self, request: Request) -> None:
        if self._blocks_can_be_freed(request):
            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks, False))

    def _release_cow_copies(self) -> None:
        """vLLM's ``schedule()``: a partial (sub-block) prefix hit copies the
        hit's tail block into a private one (copy-on-write), and both ends of
        the copy stay referenced until the step that runs it completes (the
        first step at or after this one: ``sched_step_seq + 1``)."""
        copies, retained = self.kv_cache_manager.take_kv_cache_block_copies()
        if not copies:
            return
        fence = self.sched_step_seq + 1
        if not self.config.defer_block_free or fence <= self.processed_step_seq:
            self.kv_cache_manager.free_blocks(retained)
            return
        self.deferred_frees.append((fence, retained[::-1], True))

    def _drain_deferred_frees(self) -> None:
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks, _ = self.deferred_frees.popleft()
            self.kv_cache_manager.free_blocks(reversed(blocks))

    def _advance_processed(self, processed: int) -> bool:
        before = (self.processed_step_seq, len(self.deferred_frees))
        self.processed_step_seq = max(self.processed_step_seq, processed)
        self._drain_deferred_frees()
        return (self.processed_step_seq, len(self.deferred_frees)) != before

    def complete_in_flight_steps(self) -> bool:
        """The engine idles: every step still in flight completes. True when
        that changed anything (a fence passed, blocks came back)."""
        return self._advance_processed(self.sched_step_seq)

    def deferred_blocks(self) -> list[list[KVCacheBlock]]:
        """Blocks popped for a fenced free (their owners are gone)."""
        return [blocks for _, blocks, copy in self.deferred_frees if not copy]

    def copy_retained_blocks(self) -> list[list[KVCacheBlock]]:
        """Both ends of pending copy-on-write copies: an extra reference on
        blocks a request may still hold, until the copying step completes."""
        return [blocks for _, blocks, copy in self.deferred_frees if copy]

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self._free_request_blocks(request)
        del self.requests[request.request_id]
        self.last_sched_seq.pop(request.request_id, None)

    def num_deferred_blocks(self) -> int:
        return sum(len(blocks) for _, blocks, _ in self.deferred_frees)

    def _take_prefix_cache_stats(self) -> tuple[int, int]:
        stats = self.kv_cache_manager.make_prefix_cache_stats()
        if stats is None:
            return 0, 0
        return stats.queries + stats.preempted_queries, stats.hits + stats.preempted_hits

    # ------------------------------------------------------------------- stats
    def make_gauges(self, *, exclude_arrived: bool = False) -> SchedulerGauges:
        """The gauges now (the one builder for step records and samples).
        ``exclude_arrived``: vLLM's engine core adds arrivals between steps,
        so its ``make_stats`` counts the waiting queue without the requests
        that arrived while the step ran (kvsim adds them as they arrive)."""
        kv = self.kv_cache_manager
        arrived = self._num_arrived_since_schedule if exclude_arrived else 0
        return SchedulerGauges(
            num_requests_running=self.num_running,
            num_requests_waiting=self.num_waiting - arrived,
            num_free_blocks=kv.num_free_blocks,
            num_deferred_blocks=self.num_deferred_blocks(),
            kv_cache_usage_perc=kv.usage,
            num_retained_checkpoints=kv.num_retained_checkpoints(),
        )

    def make_stats(self, output: SchedulerOutput, outcome: StepOutcome) -> SchedulerStats:
        """One step's stats once its output is applied (vLLM's ``make_stats``)."""
        return SchedulerStats(
            step=output.step_index,
            num_scheduled_requests=len(output.scheduled),
            num_scheduled_tokens=output.total_num_scheduled_tokens,
            num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens,
            num_admitted=len(output.new_request_ids),
            num_resumed=len(output.resumed_request_ids),
            num_preemptions=len(output.preempted_request_ids),
            num_finished=len(outcome.finished),
            num_generation_tokens=outcome.num_generated_tokens,
            gauges=self.make_gauges(exclude_arrived=True),
            prefix_cache_stats=PrefixCacheStats(
                prefix_cache_queries_tokens=output.prefix_cache_queries,
                prefix_cache_hits_tokens=output.prefix_cache_hits,
                prefix_cache_evicted_blocks=output.num_evicted_blocks,
            ),
            spec_decoding_stats=SpecDecodingStats(
                num_draft_tokens=outcome.num_draft_tokens,
                num_accepted_tokens=outcome.num_accepted_tokens,
            ),
        )

    def token_counts(self) -> dict[str, int]:
        """Each running request's tokens (prompt plus outputs, no drafts)."""
        return {r.request_id: r.num_tokens for r in self.running}


def _arrival_s(entry: Request | RequestSpec) -> float:
    return entry.arrival_time if isinstance(entry, Request) else entry.arrival_s
