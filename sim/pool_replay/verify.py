"""The pool replay's checks: the bytes hold what the shadow says each cell's
writer wrote, at every free, fence, prefix hit and at the end.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sim.pool_replay.fingerprints import (
    POSITION_BITS,
    POSITION_MASK,
    UNKNOWN,
    ZERO_POSITION,
    PoolCorruption,
    describe_word,
)
from sim.pool_replay.plan import Group, Layer, RowClass, WordSet, chunks
from sim.pool_replay.report import ReplayStep
from sim.sched.scheduler import Scheduler


@dataclass
class Fence:
    """Pages freed while a step that may read them is in flight: they must
    still hold ``codes`` when the step completes (``seq`` is processed)."""

    seq: int
    request_id: str
    step: int
    keys: set[tuple[int, int]]  # (group, view block)
    cells: list[tuple[RowClass, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class Cells:
    """Cells of one row class to write or check, with who asked (for messages)."""

    view_blocks: np.ndarray
    rows: np.ndarray
    codes: np.ndarray
    request_ids: list[str] = field(default_factory=list)  # one per cell, for messages


class PoolChecks:
    """The checks of ``PoolReplay`` (its base class): verify cells against
    the shadow, keep and pass the fences, check prefix hits."""

    device: torch.device
    groups: list[Group]
    scheduler: Scheduler
    step: int
    counts: defaultdict[str, int]
    words: torch.Tensor
    fences: list[Fence]
    fenced: dict[tuple[int, int], Fence]
    request_names: dict[int, str]
    stride: int
    _last_hit: dict[str, tuple[int, ...]]

    def _held_blocks(self, group: int, request_id: str) -> list[int]:
        raise NotImplementedError

    def _tally(self) -> ReplayStep:
        raise NotImplementedError

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

    def _verify(
        self,
        row_class: RowClass,
        view_blocks: torch.Tensor,
        rows: torch.Tensor,
        codes: torch.Tensor,
        when: str,
        expected_positions: torch.Tensor | None = None,
    ) -> None:
        """The cells hold the fingerprints ``codes`` say (unknown cells are
        skipped); the first one that does not is reported."""
        known = codes != UNKNOWN
        view_blocks, rows, codes = view_blocks[known], rows[known], codes[known]
        if expected_positions is not None:
            expected_positions = expected_positions[known]
        for word_set in row_class.word_sets:
            for chunk in chunks(len(codes), word_set):
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
        row_class: RowClass,
        word_set: WordSet,
        view_blocks: torch.Tensor,
        rows: torch.Tensor,
        codes: torch.Tensor,
        when: str,
        expected_positions: torch.Tensor | None,
    ) -> None:
        if expected_positions is not None:
            mask = (codes & POSITION_MASK) != expected_positions
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
        row_class: RowClass,
        layer: Layer,
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
        owner = self.request_names[code >> POSITION_BITS]
        position = code & POSITION_MASK
        expected = "zeros (its new ring slot)" if position == ZERO_POSITION else f"its position {position}"
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
    def _cells_of_blocks(self, row_class: RowClass, view_blocks: list[int]) -> tuple[torch.Tensor, ...]:
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
            and self.scheduler.last_sched_seq.get(request.request_id, 0) > self.scheduler.processed_step_seq
        )
        fence = Fence(
            seq=self.scheduler.last_sched_seq.get(request.request_id, 0),
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

    def _pass_fences(self, processed: int | None = None) -> None:
        """Steps up to ``processed`` (by default the scheduler's fence clock,
        ``processed_step_seq``) are complete: the pages they may have read
        must still hold what their owner wrote."""
        if processed is None:
            processed = self.scheduler.processed_step_seq
        remaining = []
        for fence in self.fences:
            if fence.seq > processed:
                remaining.append(fence)
                continue
            self._check_fence(fence)
        self.fences = remaining

    def _check_fence(self, fence: Fence) -> None:
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
                    if bool((codes == UNKNOWN).any()):
                        i = int(torch.nonzero(codes == UNKNOWN)[0])
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

    def _verify_everything(self) -> None:
        for group in self.groups:
            for row_class in group.classes:
                view_blocks, rows = torch.nonzero(row_class.shadow != UNKNOWN, as_tuple=True)
                self._verify(row_class, view_blocks, rows, row_class.shadow[view_blocks, rows], "at the end")
