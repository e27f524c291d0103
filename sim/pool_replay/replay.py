"""The pool replay: an observer of the scheduler that writes each step's
cells and checks them (``PoolChecks``), and the entry point."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from sim.config import ConfigError
from sim.engine import Simulation
from sim.fork.frees import BlockObserver
from sim.pool_replay.fingerprints import REQUEST_BITS, UNKNOWN, ZERO_POSITION, fingerprint
from sim.pool_replay.plan import Group, RowClass, build_groups, chunks, pool_words
from sim.pool_replay.report import PoolReplayReport, ReplayStep
from sim.pool_replay.verify import Cells, Fence, PoolChecks
from sim.pool_replay.views import WorkerViews, allocate_worker_views
from sim.scenario import Scenario, SideCacheSwitch
from sim.sched.output import SchedulerOutput
from sim.sched.scheduler import SchedulerObserver
from sim.vllm_bridge import KVCacheBlocks, Request
from sim.workloads import Workload


class PoolReplay(PoolChecks, SchedulerObserver, BlockObserver):
    """Writes and checks one rank's pool as the simulation ``sim`` runs."""

    def __init__(self, sim: Simulation, views: WorkerViews) -> None:
        self.sim = sim
        self.views = views
        self.device = views.kv_caches[next(iter(views.kv_caches))].device
        self.groups = build_groups(views)
        self.words = pool_words(views)
        self.stride = views.block_stride_bytes
        self.scheduler = sim.scheduler
        self.manager = sim.kv_cache_manager
        self.managers = self.manager.coordinator.single_type_managers
        self.request_numbers: dict[str, int] = {}
        self.request_names: dict[int, str] = {}
        self.fences: list[Fence] = []
        self.fenced: dict[tuple[int, int], Fence] = {}
        self.step = 0
        self.tallies: dict[int, ReplayStep] = {}
        self.counts: defaultdict[str, int] = defaultdict(int)
        self.max_slots_sharing_a_block = 0
        self._last_hit: dict[str, tuple[int, ...]] = {}
        # An attribute the scheduler calls, not a method swapped on it.
        self.scheduler.observer = self
        self.manager.observer = self

    # ------------------------------------------------ the scheduler's hooks
    def step_starts(self, step_index: int) -> None:
        self.step = step_index
        self._timed(self._pass_fences)

    def step_scheduled(self, output: SchedulerOutput) -> None:
        if not output.is_empty:
            self._timed(lambda: self._replay_step(output))

    def output_arrives(self, output: SchedulerOutput) -> None:
        self.step = output.step_index

    def blocks_freed(self, request: Request) -> None:
        self._timed(lambda: self._on_free(request))

    def prefix_hit(self, request: Request, blocks: KVCacheBlocks, num_hit: int) -> None:
        self._timed(lambda: self._on_hit(request.request_id, blocks, num_hit))

    def _timed(self, work: Callable[[], None]) -> None:
        started = time.perf_counter()
        work()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._tally().replay_s += time.perf_counter() - started

    def _tally(self) -> ReplayStep:
        if self.step not in self.tallies:
            self.tallies[self.step] = ReplayStep(step=self.step, time_s=float(self.sim.env.now))
        return self.tallies[self.step]

    def _number(self, request_id: str) -> int:
        if request_id not in self.request_numbers:
            number = len(self.request_numbers) + 1
            assert number < 1 << REQUEST_BITS
            self.request_numbers[request_id] = number
            self.request_names[number] = request_id
        return self.request_numbers[request_id]

    # ---------------------------------------------------------------- tables
    def _table(self, group: int, request_id: str) -> list[int]:
        """The request's block ids in ``group`` (-1 for a null block)."""
        blocks = self.managers[group].req_to_blocks.get(request_id, [])
        return [-1 if b.is_null else b.block_id for b in blocks]

    def _held_blocks(self, group: int, request_id: str) -> list[int]:
        """Every block the request holds in ``group``: its table plus a
        retained Mamba checkpoint."""
        held = [b for b in self._table(group, request_id) if b >= 0]
        retained = self._retained(group).get(request_id)
        if retained is not None:
            held.append(retained.block_id)
        return held

    def _retained(self, group: int) -> dict:
        """The group's retained Mamba checkpoints (none for other managers)."""
        manager = self.managers[group]
        return manager.retained_checkpoints() if hasattr(manager, "retained_checkpoints") else {}

    def _pool_block(self, group: Group, view_block: int) -> int:
        return view_block // group.slots_per_block

    def _holders(self) -> tuple[dict[int, set[int]], dict[tuple[int, int], set[str]]]:
        """Pool block -> groups holding it; (group, view block) -> requests."""
        pool_groups: dict[int, set[int]] = defaultdict(set)
        holders: dict[tuple[int, int], set[str]] = defaultdict(set)
        for group in self.groups:
            manager = self.managers[group.index]
            request_ids = set(manager.req_to_blocks) | set(self._retained(group.index))
            for request_id in request_ids:
                for view_block in self._held_blocks(group.index, request_id):
                    pool_groups[self._pool_block(group, view_block)].add(group.index)
                    holders[group.index, view_block].add(request_id)
        return pool_groups, holders

    # ------------------------------------------------------------ the step
    def _replay_step(self, output: Any) -> None:
        pool_groups, holders = self._holders()
        self._note_ring_packing(holders)
        self._zero_new_rings(output.new_ring_block_ids, pool_groups, holders)
        for group in self.groups:
            for row_class in group.classes:
                cells = self._step_cells(group, row_class, output.scheduled)
                if cells.codes.size:
                    self._check_ownership(group, row_class, cells, pool_groups, holders)
                    self._write(row_class, cells)

    def _note_ring_packing(self, holders: dict[tuple[int, int], set[str]]) -> None:
        for group in self.groups:
            if group.slots_per_block > 1:
                live: dict[int, int] = defaultdict(int)
                for (index, view_block), owners in holders.items():
                    if index == group.index and owners:
                        live[view_block // group.slots_per_block] += 1
                self.max_slots_sharing_a_block = max(self.max_slots_sharing_a_block, *live.values(), 0)

    def _step_cells(self, group: Group, row_class: RowClass, scheduled: Iterable[Any]) -> Cells:
        """The cells the step writes for ``row_class``, newest position last
        (a later write of the same cell wins, as on the device)."""
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        request_ids: list[str] = []
        for item in scheduled:
            start = item.num_computed_tokens
            end = start + item.num_scheduled_tokens
            table = self._table(group.index, item.request_id)
            number = self._number(item.request_id)
            part = self._request_cells(
                group, row_class, item.request_id, table, start, end - item.num_spec_tokens, end
            )
            if part is None:
                continue
            view_blocks, rows, positions = part
            parts.append((view_blocks, rows, fingerprint(number, positions)))
            request_ids += [item.request_id] * len(view_blocks)
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Cells(empty, empty, empty)
        view_blocks, rows, codes = (np.concatenate(p) for p in zip(*parts, strict=True))
        return Cells(view_blocks, rows, codes, request_ids)

    def _request_cells(
        self,
        group: Group,
        row_class: RowClass,
        request_id: str,
        table: list[int],
        start: int,
        end_main: int,
        end: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if row_class.kind == "state":
            # The state after the step lives in the block of its last token.
            index = math.ceil(end_main / group.block_size) - 1
            if index < 0 or index >= len(table) or table[index] < 0:
                self.counts["state_writes_without_a_block"] += 1
                return None
            return np.array([table[index]]), np.array([0]), np.array([end_main])
        if row_class.kind == "ring":
            capacity = row_class.num_rows
            positions = np.arange(max(start, end - capacity), end, dtype=np.int64)
            if not table:
                self._fail(request_id, group.index, "writes its ring but holds no ring block", None)
            return np.full(len(positions), table[0]), positions % capacity, positions
        per_row = row_class.tokens_per_row
        rows_positions = np.arange(start // per_row, math.ceil(end / per_row), dtype=np.int64)
        first_tokens = rows_positions * per_row
        indices = first_tokens // group.block_size
        if len(indices) and indices[-1] >= len(table):
            self._fail(
                request_id,
                group.index,
                f"writes position {int(first_tokens[-1])} past its {len(table)}-block table",
                None,
            )
        table_array = np.array(table, dtype=np.int64)
        view_blocks = table_array[indices]
        if (view_blocks < 0).any():
            bad = int(first_tokens[view_blocks < 0][0])
            self._fail(request_id, group.index, f"writes position {bad} into a null block", None)
        return view_blocks, rows_positions % row_class.num_rows, rows_positions

    # --------------------------------------------------------------- checks
    def _check_ownership(
        self,
        group: Group,
        row_class: RowClass,
        cells: Cells,
        pool_groups: dict[int, set[int]],
        holders: dict[tuple[int, int], set[str]],
    ) -> None:
        """Every cell lies inside the block (the slot) its id names, which
        the writer alone holds and no fence protects."""
        self._check_geometry(group, row_class, cells)
        seen: set[tuple[int, str]] = set()
        for index, (view_block, request_id) in enumerate(
            zip(cells.view_blocks.tolist(), cells.request_ids, strict=True)
        ):
            if (view_block, request_id) in seen:
                continue
            seen.add((view_block, request_id))
            layer = row_class.layers[0]
            span = layer.byte_range(view_block, int(cells.rows[index]))
            owners = holders.get((group.index, view_block), set())
            if owners != {request_id}:
                other_requests = sorted(owners - {request_id})
                what = f"held by {', '.join(other_requests)}" if other_requests else "not held by it"
                self._fail(
                    request_id, group.index, f"writes view block {view_block} {what}", span, layer.name
                )
            pool_block = self._pool_block(group, view_block)
            if pool_groups.get(pool_block, set()) != {group.index}:
                other_groups = sorted(pool_groups[pool_block] - {group.index})
                self._fail(
                    request_id,
                    group.index,
                    f"writes pool block {pool_block}, also held by groups {other_groups}",
                    span,
                    layer.name,
                )
            fence = self.fenced.get((group.index, view_block))
            if fence is not None:
                self._fail(
                    request_id,
                    group.index,
                    f"writes view block {view_block}, freed by {fence.request_id} at step {fence.step} "
                    f"but fenced until step seq {fence.seq} completes "
                    f"(now {self.scheduler.processed_step_seq})",
                    span,
                    layer.name,
                )

    def _check_geometry(self, group: Group, row_class: RowClass, cells: Cells) -> None:
        view_blocks, rows = cells.view_blocks, cells.rows
        slots = group.slots_per_block
        pool_blocks = view_blocks // slots
        slot_bytes = self.stride // slots
        region_lo = pool_blocks * self.stride + (view_blocks % slots) * slot_bytes
        region_hi = region_lo + slot_bytes
        for layer in row_class.layers:
            lo = layer.offset_bytes + view_blocks * layer.stride0_bytes + rows * layer.stride1_bytes
            hi = lo + 8 * layer.num_words
            outside = (lo < region_lo) | (hi > region_hi)
            if outside.any():
                i = int(np.flatnonzero(outside)[0])
                where = (
                    f"slot {view_blocks[i] % slots} of pool block {pool_blocks[i]}"
                    if slots > 1
                    else f"pool block {pool_blocks[i]}"
                )
                self._fail(
                    cells.request_ids[i],
                    group.index,
                    f"view block {view_blocks[i]} row {rows[i]} lies outside {where} "
                    f"[{region_lo[i]}, {region_hi[i]})",
                    (int(lo[i]), int(hi[i])),
                    layer.name,
                )

    def _write(self, row_class: RowClass, cells: Cells) -> None:
        view_blocks, rows, codes = (self._tensor(a) for a in (cells.view_blocks, cells.rows, cells.codes))
        for word_set in row_class.word_sets:
            for chunk in chunks(len(codes), word_set):
                index = word_set.word_index(view_blocks[chunk], rows[chunk])
                self.words[index] = word_set.words(codes[chunk])[:, :, None].expand_as(index)
                self._tally().bytes_written += 8 * index.numel()
        row_class.shadow[view_blocks, rows] = codes
        self._invalidate_other_groups(
            row_class.group, np.unique(cells.view_blocks // self._slots(row_class.group))
        )
        # Read back: a view that aliases another cell of this step shows here.
        self._verify(
            row_class, view_blocks, rows, row_class.shadow[view_blocks, rows], "right after the write"
        )

    def _slots(self, group_index: int) -> int:
        return next(g.slots_per_block for g in self.groups if g.index == group_index)

    def _invalidate_other_groups(self, group_index: int, pool_blocks: np.ndarray) -> None:
        """The bytes of a pool block another group used before are stale:
        forget them (its new holder writes over them legitimately)."""
        for group in self.groups:
            if group.index == group_index:
                continue
            slots = group.slots_per_block
            view_blocks = (pool_blocks[:, None] * slots + np.arange(slots)[None, :]).ravel()
            index = self._tensor(view_blocks)
            for row_class in group.classes:
                row_class.shadow[index] = UNKNOWN

    def _zero_new_rings(
        self,
        new_ring_block_ids: Iterable[int],
        pool_groups: dict[int, set[int]],
        holders: dict[tuple[int, int], set[str]],
    ) -> None:
        """Clear the pages of newly claimed ring slots (the fork's ring-tag
        path), each after checking one request alone holds it."""
        rings = [g for g in self.groups if g.kind == "ring"]
        new = list(dict.fromkeys(new_ring_block_ids))
        if not rings or not new:
            return
        for group in rings:
            claimed = [b for b in new if holders.get((group.index, b))]
            for view_block in claimed:
                owners = sorted(holders[group.index, view_block])
                layer = group.classes[0].layers[0]
                span = layer.byte_range(view_block, 0)
                if len(owners) > 1:
                    self._fail(
                        owners[-1],
                        group.index,
                        f"ring slot {view_block} (pool block {self._pool_block(group, view_block)}) "
                        f"is held by {len(owners)} requests: {', '.join(owners)}",
                        span,
                        layer.name,
                    )
            if not claimed:
                continue
            for row_class in group.classes:
                num = len(claimed)
                blocks = np.repeat(np.array(claimed, dtype=np.int64), row_class.num_rows)
                rows = np.tile(np.arange(row_class.num_rows, dtype=np.int64), num)
                owners = [
                    sorted(holders[group.index, b])[0] for b in claimed for _ in range(row_class.num_rows)
                ]
                numbers = np.array([self._number(owner) for owner in owners], dtype=np.int64)
                cells = Cells(blocks, rows, fingerprint(numbers, ZERO_POSITION), owners)
                self._check_ownership(group, row_class, cells, pool_groups, holders)
                self._write(row_class, cells)
            self.counts["ring_slots_zeroed"] += len(claimed)

    # ------------------------------------------------------------------ end
    def finish(self) -> None:
        """Every step has completed: pass every fence, then check every cell
        of the pool that anyone wrote."""
        self.step = self.scheduler.step_index
        self._timed(lambda: self._pass_fences(processed=self.scheduler.sched_step_seq))
        self._timed(self._verify_everything)


def with_pool_bytes(scenario: Scenario, pool_bytes: int) -> Scenario:
    """``scenario`` with every rank's KV pool pinned at ``pool_bytes``: the
    planner, hence the scheduler, plans the blocks that many bytes hold."""
    deployment = scenario.deployment.model_copy(update={"kv_cache_memory_bytes": pool_bytes})
    return scenario.model_copy(update={"deployment": deployment})


def replay_pool(
    scenario: Scenario,
    layout: SideCacheSwitch,
    workload: Workload,
    *,
    rank: int = 0,
    device: torch.device | None = None,
    bind: Callable[..., WorkerViews] | None = None,
) -> PoolReplayReport:
    """Simulate ``scenario`` under ``layout`` while replaying its block
    tables into rank ``rank``'s pool on ``device``. Raises
    ``PoolCorruption`` at the first page that does not hold its owner's
    fingerprint. ``bind`` replaces ``allocate_worker_views`` (tests bind
    broken views through it)."""
    device = device or torch.device("cpu")
    started = time.perf_counter()
    sim = Simulation(scenario, layout, workload)
    num_ranks = len(sim.plan.worker_configs)
    if not 0 <= rank < num_ranks:
        raise ConfigError(f"--rank {rank}: the deployment has ranks 0..{num_ranks - 1}")
    views = (bind or allocate_worker_views)(sim.plan, rank, device=device)
    replay = PoolReplay(sim, views)
    sim.start()
    sim.env.run(until=scenario.simulation.max_time_s)
    sim.finish()
    replay.finish()
    counts = dict(replay.counts)
    counts["num_preemptions"] = sum(r["num_preemptions"] for r in sim.recording.requests.values())
    counts["prefix_hit_tokens"] = sum(r["prefix_hit_tokens"] for r in sim.recording.requests.values())
    counts["num_requests"] = len(sim.recording.requests)
    counts["max_ring_slots_sharing_a_block"] = replay.max_slots_sharing_a_block
    steps = sorted(replay.tallies.values(), key=lambda t: t.step)
    return PoolReplayReport(
        scenario=scenario.name,
        layout=layout,
        rank=rank,
        device=str(device),
        num_blocks=views.num_blocks,
        block_stride_bytes=views.block_stride_bytes,
        pool_bytes=views.num_blocks * views.block_stride_bytes,
        steps=steps,
        counts=counts,
        wall_s=time.perf_counter() - started,
        replay_s=sum(t.replay_s for t in steps),
    )
