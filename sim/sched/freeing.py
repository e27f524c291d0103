"""Where a leaving request's blocks go: preemption, finish, fenced frees.

Part of the twin of ``vllm/v1/core/sched/scheduler.py`` (0.33.0):
``_preempt`` (recompute preemption) and ``_free_request``, a base of
``Scheduler`` (``scheduler.py``) holding no state of its own. What kvsim
adds: fenced (deferred) frees, blocks that return only once the steps still
in flight that may write them complete (``defer_block_free``), and the
copy-on-write blocks of sub-block prefix hits, released once the copying
step completes.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from sim.vllm_bridge import KVCacheBlock, Request, RequestStatus

if TYPE_CHECKING:
    from sim.kv_cache_manager import KVCacheManager
    from sim.sched.scheduler import RequestSpec, SchedulerConfig


class BlockFreeing:
    """Frees, at once or fenced, and the fence clock they wait on."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request | RequestSpec]
    running: list[Request]
    # (fence step, blocks, is a copy-on-write retention), in free order.
    deferred_frees: deque[tuple[int, list[KVCacheBlock], bool]]
    last_sched_seq: dict[str, int]
    sched_step_seq: int
    processed_step_seq: int

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
