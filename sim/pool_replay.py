"""Pool replay: the simulated block tables written into one rank's real KV
pool, to prove the bytes follow the allocator's bookkeeping.

The pool is allocated with torch the way the worker allocates it (vLLM's
``allocate_kv_cache`` and the layers' ``bind_kv_cache``, through
``sim.worker_views``), on the CPU or a CUDA device. The simulation runs
unchanged; the replay wraps a few methods of its scheduler and KV-cache
manager (instance attributes only, nothing of the engine changes) and, at
every step:

- zeroes the pages of the ring slots claimed that step (the fork's ring-tag
  path, fed by ``take_new_ring_block_ids``; the replay clears the whole slot
  page, a superset of the tag words);
- writes a fingerprint of (request, group, layer, position) into exactly the
  cells the block table maps for the tokens computed that step: one token row
  of every attention layer, one compressed-key state row per
  ``tokens_per_state`` tokens, the ring row ``position % capacity`` and the
  whole state page of every Mamba layer (GDN and PLE);
- reads back what it wrote.

Before writing it checks that every cell lies inside the pool block (for a
ring, inside the slot) its block id names, that the block is held by the
writer alone, and that no fenced block (freed while a step that may still
read it is in flight) is written. It verifies the bytes against a shadow of
who wrote each cell at every free (the freed request's pages), at every
prefix hit (the hit request reads what the earlier request wrote, at the
right positions), when a fence passes (the fenced pages still hold their
owner's fingerprint) and at the end (every cell of the pool). A violation
raises ``PoolCorruption`` naming the step, the request, the group, the layer
and the byte range.

Deliberate simplifications (docs/fidelity.md): a Mamba layer's state is
written to the block of the last token computed each step (the worker's
align-mode copies and internal prefill checkpoints are not replayed; a hit on
a state page the replay never wrote is not verified), and the fence clock is
the scheduler's model of steps in flight (``max_concurrent_batches``).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sim.config import ConfigError
from sim.engine import Simulation
from sim.kv_cache_interface import config_layer_specs, first_layer_spec, group_slots_per_block
from sim.scenario import Layout, Scenario
from sim.vllm_bridge import CircularBufferSpec, KVCacheBlock, MambaSpec
from sim.worker_views import WorkerViews, allocate_worker_views
from sim.workloads import Workload

# Fingerprint of a cell: one int64, tiled over the cell's bytes.
#   bits 56..62: group + 1, 48..55: layer label + 1 (layer index in the group
#   * 4 + state index), 24..47: request number, 0..23: position.
_POSITION_BITS = 24
_REQUEST_BITS = 24
_MAX_LABEL = 254
_POSITION_MASK = (1 << _POSITION_BITS) - 1
# Shadow code 0: nobody wrote this cell (not verified). A cell zeroed for a
# request carries that request and this position; its bytes are zeros.
_UNKNOWN = 0
_ZERO_POSITION = _POSITION_MASK
# Words per gather or scatter (int64 indices: 128 MiB), to bound the memory
# a full pool's Mamba pages (~1.6 MB each) and a final check need.
_CHUNK_WORDS = 1 << 24


class PoolCorruption(AssertionError):
    """The bytes of the pool do not follow the block tables."""


def _code(request_number: int | np.ndarray, position: int | np.ndarray) -> Any:
    return (np.int64(request_number) << _POSITION_BITS) | np.int64(position)


def describe_word(word: int, request_names: dict[int, str]) -> str:
    """What one 8-byte word found in the pool says about its writer."""
    if word == 0:
        return "zeros"
    group, label = (word >> 56) - 1, ((word >> 48) & 0xFF) - 1
    number = (word >> _POSITION_BITS) & ((1 << _REQUEST_BITS) - 1)
    position = word & _POSITION_MASK
    if group < 0 or label < 0 or number not in request_names:
        return f"bytes that are no fingerprint (0x{word & 0xFFFFFFFFFFFFFFFF:016x})"
    return (
        f"request {request_names[number]}'s fingerprint "
        f"(group {group}, layer label {label}, position {position})"
    )


@dataclass
class _Layer:
    """One layer (one state of a Mamba layer) of a row class. Cell
    ``(view block, row)`` is the ``8 * num_words`` contiguous bytes from
    ``offset_bytes + view_block * stride0_bytes + row * stride1_bytes``
    (offsets from the pool base, read off the bound view)."""

    name: str
    label: int
    offset_bytes: int
    stride0_bytes: int
    stride1_bytes: int
    num_words: int

    def byte_range(self, view_block: int, row: int) -> tuple[int, int]:
        lo = self.offset_bytes + view_block * self.stride0_bytes + row * self.stride1_bytes
        return lo, lo + 8 * self.num_words


@dataclass
class _WordSet:
    """The layers of a row class whose cells have one size, as index
    tensors: the replay touches all of them with one gather or scatter."""

    layers: list[_Layer]
    tags: torch.Tensor  # [L] int64: the group and layer bits of each fingerprint
    offsets: torch.Tensor  # [L] words
    strides0: torch.Tensor  # [L] words
    strides1: torch.Tensor  # [L] words
    num_words: int

    def word_index(self, view_blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[L, n, num_words]: the pool words of every layer's cells."""
        starts = (
            self.offsets[:, None]
            + view_blocks[None, :] * self.strides0[:, None]
            + rows[None, :] * self.strides1[:, None]
        )
        return starts[:, :, None] + torch.arange(self.num_words, device=starts.device)

    def words(self, codes: torch.Tensor) -> torch.Tensor:
        """[L, n]: every layer's fingerprint of every cell."""
        words = codes[None, :] | self.tags[:, None]
        zeroed = (codes & _POSITION_MASK) == _ZERO_POSITION
        return torch.where(zeroed[None, :], torch.zeros_like(words), words)


@dataclass
class _RowClass:
    """The layers of one group that share a row geometry, and the shadow of
    who wrote each of their cells."""

    group: int
    kind: str  # "tokens", "ring" or "state"
    tokens_per_row: int
    num_rows: int
    layers: list[_Layer]
    shadow: torch.Tensor  # int64 [view blocks, rows]: the expected code
    word_sets: list[_WordSet] = field(default_factory=list)

    def build_word_sets(self) -> None:
        device = self.shadow.device
        by_size: dict[int, list[_Layer]] = defaultdict(list)
        for layer in self.layers:
            by_size[layer.num_words].append(layer)

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.word_sets = [
            _WordSet(
                layers=layers,
                tags=column([((self.group + 1) << 56) | ((layer.label + 1) << 48) for layer in layers]),
                offsets=column([layer.offset_bytes // 8 for layer in layers]),
                strides0=column([layer.stride0_bytes // 8 for layer in layers]),
                strides1=column([layer.stride1_bytes // 8 for layer in layers]),
                num_words=num_words,
            )
            for num_words, layers in by_size.items()
        ]


@dataclass
class _Group:
    index: int
    kind: str  # "attention", "ring" or "mamba"
    block_size: int  # tokens per block (the ring: its capacity)
    slots_per_block: int
    classes: list[_RowClass]


@dataclass
class _Fence:
    """Pages freed while a step that may read them is in flight: they must
    still hold ``codes`` when the step completes (``seq`` is processed)."""

    seq: int
    request_id: str
    step: int
    keys: set[tuple[int, int]]  # (group, view block)
    cells: list[tuple[_RowClass, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StepTally:
    step: int
    time_s: float
    bytes_written: int = 0
    bytes_verified: int = 0
    replay_s: float = 0.0


@dataclass
class PoolReplayReport:
    """What a replay wrote and verified."""

    scenario: str
    layout: Layout
    rank: int
    device: str
    num_blocks: int
    block_stride_bytes: int
    pool_bytes: int
    steps: list[StepTally]
    counts: dict[str, int]
    wall_s: float
    replay_s: float

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written for s in self.steps)

    @property
    def bytes_verified(self) -> int:
        return sum(s.bytes_verified for s in self.steps)

    @property
    def gb_per_s(self) -> float:
        moved = self.bytes_written + self.bytes_verified
        return moved / self.replay_s / 1e9 if self.replay_s else float("nan")

    @property
    def steps_per_s(self) -> float:
        return len(self.steps) / self.wall_s if self.wall_s else float("nan")

    def step_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "step": s.step,
                "time_s": s.time_s,
                "bytes_written": s.bytes_written,
                "bytes_verified": s.bytes_verified,
                "gb_per_s": (s.bytes_written + s.bytes_verified) / s.replay_s / 1e9 if s.replay_s else 0.0,
            }
            for s in self.steps
        ]


# ---------------------------------------------------------------------------
# The pool's geometry, from the bound views.
# ---------------------------------------------------------------------------
def _row_dim(view: torch.Tensor, num_rows: int, name: str) -> int:
    """The dim of a paged view that indexes token rows (neither the block dim
    nor the innermost, contiguous one)."""
    dims = [d for d in range(1, view.dim() - 1) if view.shape[d] == num_rows]
    if not dims:
        raise ValueError(f"{name}: no dim of {tuple(view.shape)} holds {num_rows} rows")
    return dims[0]


def _layer(name: str, label: int, cells: torch.Tensor, base: int) -> _Layer:
    """``cells``: a uint8 view ``[view blocks, rows, *cell bytes]``. The
    replay moves whole 8-byte words, so a cell must be contiguous and
    word-aligned (every page of the models kvsim knows is)."""
    shape, strides = cells.shape[2:], cells.stride()[2:]
    nbytes = math.prod(shape)
    contiguous = all(stride == math.prod(shape[i + 1 :]) for i, stride in enumerate(strides) if shape[i] > 1)
    offset = cells.data_ptr() - base
    if not contiguous or nbytes % 8 or offset % 8 or cells.stride(0) % 8 or cells.stride(1) % 8:
        raise ValueError(f"{name}: cells of {nbytes} B at {offset} are not whole aligned words")
    return _Layer(
        name=name,
        label=label,
        offset_bytes=offset,
        stride0_bytes=cells.stride(0),
        stride1_bytes=cells.stride(1),
        num_words=nbytes // 8,
    )


def _chunks(num_cells: int, word_set: _WordSet) -> list[slice]:
    per_chunk = max(1, _CHUNK_WORDS // (len(word_set.layers) * word_set.num_words))
    return [slice(lo, lo + per_chunk) for lo in range(0, num_cells, per_chunk)]


def pool_words(views: WorkerViews) -> torch.Tensor:
    """The whole backing buffer as int64 words: every cell is written and
    read through it, at the offsets the bound views give."""
    storage = next(iter(views.kv_caches.values())).untyped_storage()
    assert storage.data_ptr() == views.base
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat[: storage.nbytes() // 8 * 8].view(torch.int64)


def build_groups(views: WorkerViews) -> list[_Group]:
    """Every non-empty group of the rank, its layers split into row classes."""
    specs = config_layer_specs(views.config)
    groups = []
    for index, group in enumerate(views.config.kv_cache_groups):
        if not group.layer_names:
            continue  # a group projected empty on this rank
        first = first_layer_spec(group)
        kind = (
            "mamba"
            if isinstance(first, MambaSpec)
            else "ring"
            if isinstance(first, CircularBufferSpec)
            else "attention"
        )
        classes: dict[tuple[str, int], _RowClass] = {}
        for position, name in enumerate(group.layer_names):
            spec, view = specs[name], views.views[name]
            states = view if isinstance(view, tuple) else (view,)
            for state_index, state in enumerate(states):
                label = position * 4 + state_index
                assert label <= _MAX_LABEL, f"group {index} has too many layers to label"
                if isinstance(spec, MambaSpec):
                    key, rows, per_row = ("state", 0), 1, 0
                    cells = state.view(torch.uint8).unsqueeze(1)
                elif isinstance(spec, CircularBufferSpec):
                    key, rows, per_row = ("ring", 1), spec.block_size, 1
                    cells = state.view(torch.uint8).movedim(_row_dim(state, rows, name), 1)
                else:
                    per_row = int(spec.tokens_per_state) if spec.tokens_per_state > 0 else 1
                    key, rows = ("tokens", per_row), first.block_size // per_row
                    cells = state.view(torch.uint8).movedim(_row_dim(state, rows, name), 1)
                if key not in classes:
                    classes[key] = _RowClass(
                        group=index,
                        kind=key[0],
                        tokens_per_row=per_row,
                        num_rows=rows,
                        layers=[],
                        shadow=torch.zeros((cells.shape[0], rows), dtype=torch.int64, device=cells.device),
                    )
                classes[key].layers.append(_layer(name, label, cells, views.base))
        for row_class in classes.values():
            row_class.build_word_sets()
        groups.append(
            _Group(
                index=index,
                kind=kind,
                block_size=first.block_size,
                slots_per_block=group_slots_per_block(group),
                classes=list(classes.values()),
            )
        )
    return groups


# ---------------------------------------------------------------------------
# The replay.
# ---------------------------------------------------------------------------
@dataclass
class _Cells:
    """Cells of one row class to write or check, with who asked (for messages)."""

    view_blocks: np.ndarray
    rows: np.ndarray
    codes: np.ndarray
    request_ids: list[str] = field(default_factory=list)  # one per cell, for messages


class PoolReplay:
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
        self.last_seq: dict[str, int] = {}
        self.issued = 0
        self.processed = 0
        self.fences: list[_Fence] = []
        self.fenced: dict[tuple[int, int], _Fence] = {}
        self.step = 0
        self.tallies: dict[int, StepTally] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.max_slots_sharing_a_block = 0
        self._last_hit: dict[str, tuple[int, ...]] = {}
        self._install()

    # -------------------------------------------------------------- wrapping
    def _install(self) -> None:
        """Wrap the scheduler's and the manager's methods on the instances:
        the engine calls them as before and the replay sees every step, free
        and prefix hit as it happens."""
        scheduler, manager = self.scheduler, self.manager
        schedule, arrives = scheduler.schedule, scheduler.output_arrives
        complete = scheduler.complete_in_flight_steps
        free, pop = manager.free, manager.pop_blocks_for_free
        lookup = manager.get_computed_blocks

        def schedule_step(*args: Any, **kwargs: Any) -> Any:
            self.step = scheduler.step_index + 1
            self._timed(self._pass_fences)
            output = schedule(*args, **kwargs)
            if not output.is_empty:
                self.issued += 1
                for item in output.scheduled:
                    self.last_seq[item.request_id] = self.issued
                self._timed(lambda: self._replay_step(output))
            return output

        def output_arrives(output: Any) -> None:
            # Every step's output passes here first (the steady lane's too).
            self.step = output.step_index
            if not output.is_empty:
                self.processed = max(
                    self.processed, self.issued - (scheduler.config.max_concurrent_batches - 1)
                )
            arrives(output)

        def complete_in_flight_steps() -> bool:
            self.processed = self.issued
            return complete()

        def free_request(request: Any) -> None:
            self._timed(lambda: self._on_free(request))
            free(request)

        def pop_for_free(request: Any) -> list[KVCacheBlock]:
            self._timed(lambda: self._on_free(request))
            return pop(request)

        def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
            result = lookup(request, *args, **kwargs)
            blocks, num_hit = result[0], result[1]
            if num_hit:
                self._timed(lambda: self._on_hit(request.request_id, blocks, num_hit))
            return result

        scheduler.schedule = schedule_step  # type: ignore[method-assign]
        scheduler.output_arrives = output_arrives  # type: ignore[method-assign]
        scheduler.complete_in_flight_steps = complete_in_flight_steps  # type: ignore[method-assign]
        manager.free = free_request  # type: ignore[method-assign]
        manager.pop_blocks_for_free = pop_for_free  # type: ignore[method-assign]
        manager.get_computed_blocks = get_computed_blocks  # type: ignore[method-assign]

    def _timed(self, work: Callable[[], None]) -> None:
        started = time.perf_counter()
        work()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._tally().replay_s += time.perf_counter() - started

    def _tally(self) -> StepTally:
        if self.step not in self.tallies:
            self.tallies[self.step] = StepTally(step=self.step, time_s=float(self.sim.env.now))
        return self.tallies[self.step]

    def _number(self, request_id: str) -> int:
        if request_id not in self.request_numbers:
            number = len(self.request_numbers) + 1
            assert number < 1 << _REQUEST_BITS
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

    def _pool_block(self, group: _Group, view_block: int) -> int:
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

    def _step_cells(self, group: _Group, row_class: _RowClass, scheduled: Iterable[Any]) -> _Cells:
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
            parts.append((view_blocks, rows, _code(number, positions)))
            request_ids += [item.request_id] * len(view_blocks)
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return _Cells(empty, empty, empty)
        view_blocks, rows, codes = (np.concatenate(p) for p in zip(*parts, strict=True))
        return _Cells(view_blocks, rows, codes, request_ids)

    def _request_cells(
        self,
        group: _Group,
        row_class: _RowClass,
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
        group: _Group,
        row_class: _RowClass,
        cells: _Cells,
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
                    f"but fenced until step seq {fence.seq} completes (now {self.processed})",
                    span,
                    layer.name,
                )

    def _check_geometry(self, group: _Group, row_class: _RowClass, cells: _Cells) -> None:
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

    def _fail(
        self,
        request_id: str,
        group: int,
        what: str,
        span: tuple[int, int] | None,
        layer: str | None = None,
    ) -> None:
        where = f", bytes [{span[0]}, {span[1]})" if span else ""
        on = f", layer {layer}" if layer else ""
        raise PoolCorruption(f"step {self.step}: request {request_id}, group {group}{on}{where}: {what}")

    # ---------------------------------------------------------- the bytes
    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

    def _write(self, row_class: _RowClass, cells: _Cells) -> None:
        view_blocks, rows, codes = (self._tensor(a) for a in (cells.view_blocks, cells.rows, cells.codes))
        for word_set in row_class.word_sets:
            for chunk in _chunks(len(codes), word_set):
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
                row_class.shadow[index] = _UNKNOWN

    def _verify(
        self,
        row_class: _RowClass,
        view_blocks: torch.Tensor,
        rows: torch.Tensor,
        codes: torch.Tensor,
        when: str,
        expected_positions: torch.Tensor | None = None,
    ) -> None:
        """The cells hold the fingerprints ``codes`` say (unknown cells are
        skipped); the first one that does not is reported."""
        known = codes != _UNKNOWN
        view_blocks, rows, codes = view_blocks[known], rows[known], codes[known]
        if expected_positions is not None:
            expected_positions = expected_positions[known]
        for word_set in row_class.word_sets:
            for chunk in _chunks(len(codes), word_set):
                self._verify_chunk(
                    row_class,
                    word_set,
                    view_blocks[chunk],
                    rows[chunk],
                    codes[chunk],
                    when,
                    None if expected_positions is None else expected_positions[chunk],
                )

    def _verify_chunk(
        self,
        row_class: _RowClass,
        word_set: _WordSet,
        view_blocks: torch.Tensor,
        rows: torch.Tensor,
        codes: torch.Tensor,
        when: str,
        expected_positions: torch.Tensor | None,
    ) -> None:
        if expected_positions is not None:
            mask = (codes & _POSITION_MASK) != expected_positions
            if bool(mask.any()):
                i = int(torch.nonzero(mask)[0])
                self._mismatch(row_class, row_class.layers[0], view_blocks, rows, codes, i, when)
        found = self.words[word_set.word_index(view_blocks, rows)]
        bad = (found != word_set.words(codes)[:, :, None]).any(dim=2)
        self._tally().bytes_verified += 8 * found.numel()
        if bool(bad.any()):
            layer_index, i = (int(x) for x in torch.nonzero(bad)[0])
            layer = word_set.layers[layer_index]
            self._mismatch(row_class, layer, view_blocks, rows, codes, i, when, int(found[layer_index, i, 0]))

    def _mismatch(
        self,
        row_class: _RowClass,
        layer: _Layer,
        view_blocks: torch.Tensor,
        rows: torch.Tensor,
        codes: torch.Tensor,
        i: int,
        when: str,
        found_word: int | None = None,
    ) -> None:
        code = int(codes[i])
        view_block, row = int(view_blocks[i]), int(rows[i])
        span = layer.byte_range(view_block, row)
        owner = self.request_names[code >> _POSITION_BITS]
        position = code & _POSITION_MASK
        expected = "zeros (its new ring slot)" if position == _ZERO_POSITION else f"its position {position}"
        if found_word is None:
            what = (
                f"view block {view_block} row {row} {when}: was written at {expected}, not the position read"
            )
        else:
            what = (
                f"view block {view_block} row {row} {when}: expected {expected}, "
                f"found {describe_word(found_word, self.request_names)}"
            )
        self._fail(owner, row_class.group, what, span, layer.name)

    # -------------------------------------------------------- verify points
    def _cells_of_blocks(self, row_class: _RowClass, view_blocks: list[int]) -> tuple[torch.Tensor, ...]:
        index = self._tensor(np.array(view_blocks, dtype=np.int64))
        rows = torch.arange(row_class.num_rows, device=self.device)
        blocks = index[:, None].expand(-1, row_class.num_rows).reshape(-1)
        all_rows = rows[None, :].expand(len(index), -1).reshape(-1)
        return blocks, all_rows, row_class.shadow[blocks, all_rows]

    def _on_free(self, request: Any) -> None:
        """Before the request's blocks go back (or are fenced): every page
        it holds still holds what was written there."""
        self.counts["frees_verified"] += 1
        # The fork fences frees (scheduler.defer_block_free); without it the
        # scheduler models no step in flight that could still read them.
        fenced = (
            self.scheduler.config.defer_block_free
            and self.last_seq.get(request.request_id, 0) > self.processed
        )
        fence = _Fence(
            seq=self.last_seq.get(request.request_id, 0),
            request_id=request.request_id,
            step=self.step,
            keys=set(),
            cells=[],
        )
        for group in self.groups:
            held = sorted(set(self._held_blocks(group.index, request.request_id)))
            if not held:
                continue
            for row_class in group.classes:
                blocks, rows, codes = self._cells_of_blocks(row_class, held)
                self._verify(row_class, blocks, rows, codes, f"when {request.request_id} is freed")
                if fenced:
                    fence.cells.append((row_class, blocks, rows, codes.clone()))
            if fenced:
                fence.keys |= {(group.index, b) for b in held}
        if fenced:
            self.fences.append(fence)
            for key in fence.keys:
                self.fenced[key] = fence

    def _pass_fences(self) -> None:
        """Steps up to ``processed`` are complete: the pages they may have
        read must still hold what their owner wrote."""
        remaining = []
        for fence in self.fences:
            if fence.seq > self.processed:
                remaining.append(fence)
                continue
            self._check_fence(fence)
        self.fences = remaining

    def _check_fence(self, fence: _Fence) -> None:
        self.counts["fences_verified"] += 1
        for row_class, blocks, rows, codes in fence.cells:
            self._verify(
                row_class,
                blocks,
                rows,
                codes,
                f"when the fence of {fence.request_id} (freed at step {fence.step}) passes",
            )
        for key in fence.keys:
            if self.fenced.get(key) is fence:
                del self.fenced[key]

    def _on_hit(self, request_id: str, blocks: Any, num_hit: int) -> None:
        """The hit request reads the pages the earlier requests wrote, at the
        positions it asks for."""
        key = tuple(b.block_id for group_blocks in blocks.blocks for b in group_blocks)
        if self._last_hit.get(request_id) == key:
            return  # the same hit, looked up again while the request waits
        self._last_hit[request_id] = key
        self.counts["prefix_hits_verified"] += 1
        for group in self.groups:
            if group.kind == "ring":
                continue  # rings are never prefix-cached
            hit = [(i, b.block_id) for i, b in enumerate(blocks.blocks[group.index]) if not b.is_null]
            if not hit:
                continue
            for row_class in group.classes:
                indices = [i for i, _ in hit]
                blocks_, rows, codes = self._cells_of_blocks(row_class, [b for _, b in hit])
                positions = None
                if row_class.kind == "tokens":
                    first_rows = self._tensor(np.array(indices, dtype=np.int64)) * row_class.num_rows
                    positions = (
                        first_rows[:, None] + torch.arange(row_class.num_rows, device=self.device)
                    ).reshape(-1)
                    if bool((codes == _UNKNOWN).any()):
                        i = int(torch.nonzero(codes == _UNKNOWN)[0])
                        layer = row_class.layers[0]
                        self._fail(
                            request_id,
                            group.index,
                            f"prefix hit reads view block {int(blocks_[i])} row {int(rows[i])}, "
                            "which nobody wrote",
                            layer.byte_range(int(blocks_[i]), int(rows[i])),
                            layer.name,
                        )
                self._verify(row_class, blocks_, rows, codes, f"when {request_id} hits it", positions)

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
                cells = _Cells(blocks, rows, _code(numbers, _ZERO_POSITION), owners)
                self._check_ownership(group, row_class, cells, pool_groups, holders)
                self._write(row_class, cells)
            self.counts["ring_slots_zeroed"] += len(claimed)

    # ------------------------------------------------------------------ end
    def finish(self) -> None:
        """Every step has completed: pass every fence, then check every cell
        of the pool that anyone wrote."""
        self.step = self.scheduler.step_index
        self.processed = self.issued
        self._timed(self._pass_fences)
        self._timed(self._verify_everything)

    def _verify_everything(self) -> None:
        for group in self.groups:
            for row_class in group.classes:
                view_blocks, rows = torch.nonzero(row_class.shadow != _UNKNOWN, as_tuple=True)
                self._verify(row_class, view_blocks, rows, row_class.shadow[view_blocks, rows], "at the end")


# ---------------------------------------------------------------------------
# Devices and memory.
# ---------------------------------------------------------------------------
# The CPU pool may take at most this fraction of the available RAM: the
# simulation, vLLM and the replay's own tensors need the rest.
CPU_POOL_FRACTION = 0.25


def available_ram_bytes() -> int:
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_device(name: str) -> torch.device:
    """A torch device that exists here, or a ``ConfigError`` saying why not."""
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: not a device the replay can use (cpu, cuda or cuda:N)")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a torch device name") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
            raise ConfigError(f"--device {name}: no CUDA device is visible to torch ({build})")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: only {count} CUDA device(s) here")
    return device


def device_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes a pool may take on ``device``, and how that bound was found."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device} ({total:,} B in all)"
    available = available_ram_bytes()
    return int(available * CPU_POOL_FRACTION), f"a quarter of the {available:,} B of available RAM"


def pool_bytes_for(device: torch.device, requested: int | None, pinned: int) -> tuple[int, str | None]:
    """The pool bytes to plan for: ``requested`` (an error above the
    device's bound) or, by default, the scenario's pin (capped on the CPU)."""
    bound, why = device_memory_bytes(device)
    if requested is not None:
        if requested > bound:
            raise ConfigError(
                f"--pool-bytes {requested:,}: more than the {bound:,} B the {device} allows ({why})"
            )
        return requested, None
    if pinned <= bound:
        return pinned, None
    if device.type == "cuda":
        raise ConfigError(f"the scenario's pool ({pinned:,} B) exceeds the {bound:,} B free on {device}")
    return bound, f"pool capped at {bound:,} B on the cpu ({why}); the scenario pins {pinned:,} B"


# ---------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------
def with_pool_bytes(scenario: Scenario, pool_bytes: int) -> Scenario:
    """``scenario`` with every rank's KV pool pinned at ``pool_bytes``: the
    planner, hence the scheduler, plans the blocks that many bytes hold."""
    deployment = scenario.deployment.model_copy(update={"kv_cache_memory_bytes": pool_bytes})
    return scenario.model_copy(update={"deployment": deployment})


def replay_pool(
    scenario: Scenario,
    layout: Layout,
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
