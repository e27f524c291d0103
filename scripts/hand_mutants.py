#!/usr/bin/env python3
"""Hand mutants of kvsim's rule lists (issue 41): the mutants mutmut's
operators cannot write. Four kinds:

- swap: two same-typed arguments or values exchanged;
- reorder: an order that matters reversed (free order, yield order, queue order);
- clause: one clause of a compound condition dropped;
- edge: a comparison's edge moved by one (``<`` for ``<=``, ``+ 1`` for ``+ 2``).

Each mutant is one textual patch (``old`` must occur exactly once in the
file) applied to a throwaway copy of the working tree, never the checkout;
the test files that pin that module run against it (``-x``: the first
failure kills it), and the file is restored before the next mutant.

    scripts/hand_mutants.py                       every mutant, one after another
    scripts/hand_mutants.py 'settled-*' 'pins-*'  the mutants whose names match, in that order
    scripts/hand_mutants.py --list                the mutants, not run
    scripts/hand_mutants.py --table results.json  the markdown table of a run

Results go to ``$KVSIM_MUTATION_DIR/hand/results.json`` (default
``/tmp/kvsim-mutation``), merged with earlier runs, and a markdown table is
printed (docs/mutation/report.md holds the latest counts; the per-mutant
table of issue 41's run is in its history). CPU-heavy: run niced on
a shared machine, e.g. ``nice -n 19 scripts/hand_mutants.py``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600

# The test sets, each the fast tests that pin one module's rules (as in
# scripts/mutation.sh).
SETTLED_TESTS = (
    "tests/test_fast_path.py::test_a_window_is_one_block_interior_widened_by_the_margin",
    "tests/test_fast_path.py::test_a_window_needs_every_block_size",
    "tests/test_fast_path.py::test_only_a_second_call_in_the_same_window_is_settled",
    "tests/test_fast_path.py::test_a_settled_window_ends_exactly_at_its_bounds",
    "tests/test_fast_path.py::test_the_hash_unit_bounds_a_window_only_inside_the_prompt",
    "tests/test_fast_path.py::test_the_calls_skipped_across_a_block_boundary",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[heavy-preemption--off-sync]",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[decode-across-boundaries--off-sync]",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[heavy-preemption--off-async]",
    "tests/test_fast_path.py::test_the_check_catches_an_async_window_blind_to_the_tokens_in_flight",
)
# Rule 9's span: the settled set and the async audits of pool-bound decodes
# (where a window blind to the tokens in flight settles a call that frees).
SPAN_TESTS = (
    *SETTLED_TESTS,
    "tests/test_fast_path.py::test_prefill_chunks_are_never_skipped",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[saturated-decode--off-async]",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[decode-across-boundaries--off-async]",
)
MISSED_LOOKUP_TESTS = (
    "tests/test_values_fast_path.py",
    "tests/test_fast_path.py::test_a_waiter_with_no_hit_is_looked_up_again_once_a_hash_is_cached_or_its_tokens_grow",
    "tests/test_fast_path.py::test_a_pin_pass_is_known_idle_only_with_the_same_queue_pins_hashes_and_tokens",
    "tests/test_fast_path.py::test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[saturated-decode--off-sync]",
)
WAITING_MEMO_TESTS = (
    "tests/test_steady.py::test_the_waiting_memo_holds_only_for_the_same_inputs_and_allocator",
    "tests/test_steady.py::test_the_waiting_memo_keeps_idle_loops_of_other_inputs_while_the_allocator_stays",
    "tests/test_steady.py::test_an_arrival_voids_the_waiting_memo",
    "tests/test_steady.py::test_the_check_catches_a_waiting_loop_wrongly_skipped",
    "tests/test_steady.py::test_a_head_that_found_nothing_stays_refused_while_running_requests_only_take_blocks",
    "tests/test_steady.py::test_a_release_bump_at_a_running_allocation_alone_is_caught",
    "tests/test_steady.py::test_a_head_whose_own_hash_is_inserted_is_looked_up_again",
    "tests/test_steady.py::test_a_head_forgotten_then_remembered_again_by_a_pin_lookup_is_looked_up_again",
    "tests/test_steady.py::test_a_refused_head_that_found_nothing_is_neither_looked_up_nor_allocated_again",
    "tests/test_steady.py::test_a_lookup_found_nothing_only_with_no_block_no_token_and_no_boundary",
    "tests/test_steady.py::test_the_check_catches_a_head_taken_as_refused_after_blocks_came_free",
    "tests/test_steady.py::test_a_refused_admission_is_known_only_for_the_same_request_tokens_running_set_and_empty_lookup",
    "tests/test_steady.py::test_rule_12_keeps_the_idle_loops_of_other_inputs_across_the_changes_it_allows",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[heavy-preemption--off-sync]",
    "tests/test_fast_path.py::test_every_skipped_call_changes_nothing[saturated-decode--off-sync]",
)
PINS_TESTS = ("tests/test_values_fork_pins.py", "tests/test_fork_pins.py")
# Rules 5-8 (the synchronous steady lane): the lane's own tests first (the
# hand counts of steady steps), the value tests, the fast path's audits and
# frames, then the fork's golden frames (fork mode, fast path on: the lane
# without a caching window).
STEADY_TESTS = (
    "tests/test_steady.py",
    "tests/test_values_fast_path.py",
    "tests/test_fast_path.py",
    "tests/test_fork_golden.py",
)
ASYNC_TESTS = (
    "tests/test_values_async.py",
    "tests/test_async_conformance.py::test_every_engine_step_is_identical[heavy-preemption-on-eagle-drop]",
    "tests/test_async_conformance.py::test_every_engine_step_is_identical[heavy-preemption-off-lookahead]",
    "tests/test_async_conformance.py::test_every_engine_step_is_identical[prefix-hits-off-eagle-drop]",
    "tests/test_async_conformance.py::test_every_engine_step_is_identical[block-budget-on-lookahead]",
    "tests/test_async_conformance.py::test_every_engine_step_is_identical_with_fenced_frees[heavy-preemption]",
    "tests/test_async_conformance.py::test_an_abort_while_a_step_is_in_flight_takes_vllms_steps[on]",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    kind: str  # swap, reorder, clause, edge
    rule: str  # the rule list and item it breaks
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    # Further (old, new) patches in the same file, for a mutant that moves a
    # line (a reorder across a loop): each old must occur exactly once too.
    also: tuple[tuple[str, str], ...] = ()


SETTLED = "sim/sched/fast_path/settled.py"
ASYNC = "sim/sched/async_scheduler.py"
PINS = "sim/fork/pins.py"
SCHED_PINS = "sim/fork/scheduler_pins.py"
MISSED = "sim/sched/fast_path/missed_lookups.py"
STEADY = "sim/sched/fast_path/steady.py"
# The fast path's door: the versions (rules 3, 12), decode spans (rule 9),
# the lookup that found nothing (rule 12) and the margin (rule 2).
DOOR = "sim/sched/fast_path/kv_cache_manager.py"
# output.reaches_max_tokens: the async scheduler's sure-to-finish test.
OUTPUT = "sim/sched/output.py"


def _settled(name: str, kind: str, old: str, new: str) -> Mutant:
    return Mutant(name, kind, "fast path 1-2 (settled windows)", SETTLED, old, new, SETTLED_TESTS)


def _async(name: str, kind: str, old: str, new: str, path: str = ASYNC) -> Mutant:
    return Mutant(name, kind, "async scheduler (module docstring's list)", path, old, new, ASYNC_TESTS)


def _waiting(
    name: str, kind: str, rule: str, old: str, new: str, path: str = "sim/sched/fast_path/memos.py"
) -> Mutant:
    return Mutant(name, kind, rule, path, old, new, WAITING_MEMO_TESTS)


def _pins(name: str, kind: str, rule: str, old: str, new: str, path: str = PINS) -> Mutant:
    return Mutant(name, kind, rule, path, old, new, PINS_TESTS)


def _steady(
    name: str, kind: str, rule: str, old: str, new: str, also: tuple[tuple[str, str], ...] = ()
) -> Mutant:
    return Mutant(name, kind, f"fast path {rule}", STEADY, old, new, STEADY_TESTS, also)


def _missed(name: str, kind: str, old: str, new: str) -> Mutant:
    return Mutant(name, kind, "fast path 10-11 (missed lookups)", MISSED, old, new, MISSED_LOOKUP_TESTS)


MUTANTS = (
    # ---------------------------------------------------- fast path, rules 1-2
    _settled(
        "settled-past-prompt-edge",
        "edge",
        "first_token - self.margin_tokens > prompt_tokens",
        "first_token - self.margin_tokens >= prompt_tokens",
    ),
    _settled(
        "settled-boundary-at-low-dropped",
        "clause",
        "if low % size == 0 or high // size != index:",
        "if high // size != index:",
    ),
    _settled(
        "settled-crossing-dropped",
        "clause",
        "if low % size == 0 or high // size != index:",
        "if low % size == 0:",
    ),
    _settled(
        "settled-least-bound-edge",
        "edge",
        "least = max(k * b + 1 + self.margin_tokens for k, b in blocks)",
        "least = max(k * b + self.margin_tokens for k, b in blocks)",
    ),
    _settled(
        "settled-greatest-bound-edge",
        "edge",
        "min((k + 1) * b - 1 - self.margin_tokens for k, b in blocks)",
        "min((k + 1) * b - self.margin_tokens for k, b in blocks)",
    ),
    _settled(
        "settled-prompt-bound-dropped",
        "clause",
        "        if self._past_prompt(first_token, prompt_tokens):\n            # A settled",
        "        if False:\n            # A settled",
    ),
    _settled(
        "settled-first-last-swapped",
        "swap",
        "bounds[0] <= first_token and last_token <= bounds[1]",
        "bounds[0] <= last_token and first_token <= bounds[1]",
    ),
    _settled(
        "settled-first-bound-edge",
        "edge",
        "bounds[0] <= first_token and last_token <= bounds[1]",
        "bounds[0] < first_token and last_token <= bounds[1]",
    ),
    Mutant(
        "fast-path-margin-one-less",
        "edge",
        "fast path 2 (the margin)",
        DOOR,
        "return 4 * (1 + num_speculative_tokens) + 16",
        "return 4 * (1 + num_speculative_tokens) + 15",
        SETTLED_TESTS,
    ),
    # ------------------------------------------- fast path, rules 3, 4 and 12
    _waiting(
        "waiting-inputs-flags-swapped",
        "swap",
        "fast path 4 (the waiting loop's inputs)",
        "and self._waiting_inputs(token_budget, running_scheduled, prefill_scheduled) in idle.inputs",
        "and self._waiting_inputs(token_budget, prefill_scheduled, running_scheduled) in idle.inputs",
    ),
    _waiting(
        "waiting-inputs-clause-dropped",
        "clause",
        "fast path 4 (the waiting loop's inputs)",
        "            and self._waiting_inputs(token_budget, running_scheduled, prefill_scheduled)"
        " in idle.inputs\n",
        "",
    ),
    _waiting(
        "rule12-free-blocks-clause-dropped",
        "clause",
        "fast path 12 (the pool has no more free blocks)",
        "return release_version == self.door.release_version and self._num_free_blocks() <= num_free_blocks",
        "return release_version == self.door.release_version",
    ),
    _waiting(
        "rule12-free-blocks-strict",
        "edge",
        "fast path 12 (the pool has no more free blocks)",
        "return release_version == self.door.release_version and self._num_free_blocks() <= num_free_blocks",
        "return release_version == self.door.release_version and self._num_free_blocks() < num_free_blocks",
    ),
    _waiting(
        "rule12-no-boundary-clause-dropped",
        "clause",
        "fast path 12 (found nothing: no token, no block, no boundary)",
        "missed = num_hit == 0 and boundary == 0 and not any(blocks.blocks)",
        "missed = num_hit == 0 and not any(blocks.blocks)",
        DOOR,
    ),
    _waiting(
        "rule12-no-block-clause-dropped",
        "clause",
        "fast path 12 (found nothing: no token, no block, no boundary)",
        "missed = num_hit == 0 and boundary == 0 and not any(blocks.blocks)",
        "missed = num_hit == 0 and boundary == 0",
        DOOR,
    ),
    _waiting(
        "rule12-refusal-same-need-dropped",
        "clause",
        "fast path 12 (a refusal is known for the same need)",
        "            or refusal.num_new != num_new\n",
        "",
    ),
    _waiting(
        "rule12-refusal-same-running-dropped",
        "clause",
        "fast path 12 (a refusal is known with the same running set)",
        "            or refusal.has_scheduled_reqs != bool(self.scheduler.running)\n",
        "",
    ),
    Mutant(
        "rule3-takes-blocks-bumps-release",
        "swap",
        "fast path 3 and 12 (a running request's allocation bumps the version, not the release version)",
        DOOR,
        # Both calls that only take blocks (allocate_slots for a running
        # request, cache_blocks): one method, allocator_takes_blocks, before
        # the door.
        "        self.allocator_version += 1\n        blocks = allocate(request, num_new_tokens, **kwargs)",
        "        self.release_version += 1\n        blocks = allocate(request, num_new_tokens, **kwargs)",
        WAITING_MEMO_TESTS,
        also=(
            (
                "        self.allocator_version += 1\n        self.wrapped.cache_blocks(request, computed)",
                "        self.release_version += 1\n        self.wrapped.cache_blocks(request, computed)",
            ),
        ),
    ),
    Mutant(
        "rule3-running-allocation-bumps-release",
        "swap",
        "fast path 3 and 12 (a running request's allocation alone bumps the release version too)",
        DOOR,
        "        self.allocator_version += 1\n        blocks = allocate(request, num_new_tokens, **kwargs)",
        "        self.changes()\n        blocks = allocate(request, num_new_tokens, **kwargs)",
        WAITING_MEMO_TESTS,
    ),
    _waiting(
        "rule3-change-skips-release",
        "clause",
        "fast path 3 and 12 (every other change bumps the release version too)",
        "        self.allocator_version += 1\n        self.release_version += 1\n",
        "        self.allocator_version += 1\n",
        DOOR,
    ),
    Mutant(
        "rule9-span-blind-to-in-flight",
        "clause",
        "fast path 9 (an async decode spans from its processed tokens)",
        DOOR,
        "return computed - request.num_in_flight_tokens, computed + num_tokens",
        "return computed, computed + num_tokens",
        SPAN_TESTS,
    ),
    Mutant(
        "rule9-decoding-edge-early",
        "edge",
        "fast path 9 (decoding: only the last known token left)",
        DOOR,
        # The door's call of output.is_decoding (computed >= num_tokens - 1),
        # moved: decoding from computed >= num_tokens - 2.
        "if not is_decoding(computed, request.num_tokens):",
        "if not is_decoding(computed + 1, request.num_tokens):",
        SPAN_TESTS,
    ),
    Mutant(
        "rule9-decoding-edge-late",
        "edge",
        "fast path 9 (decoding: only the last known token left)",
        DOOR,
        # decoding only from computed >= num_tokens.
        "if not is_decoding(computed, request.num_tokens):",
        "if not is_decoding(computed - 1, request.num_tokens):",
        SPAN_TESTS,
    ),
    # ------------------------------------------------ fast path, rules 10-11
    _missed(
        "missed-same-request-dropped",
        "clause",
        "            and missed[0] is request\n",
        "",
    ),
    _missed(
        "missed-same-tokens-dropped",
        "clause",
        "            and missed[1] == request.num_tokens\n",
        "",
    ),
    _missed(
        "missed-same-hashes-dropped",
        "clause",
        "            and missed[2] == len(request.block_hashes)\n",
        "",
    ),
    _missed(
        "missed-changed-ids-dropped",
        "clause",
        "if idle[0] != self.num_hash_insertions or self._changed_ids or idle[3] != tuple(map(id, waiting)):",
        "if idle[0] != self.num_hash_insertions or idle[3] != tuple(map(id, waiting)):",
    ),
    _missed(
        "missed-remembered-bound-edge",
        "edge",
        "self._num_remembered_hashes + len(request.block_hashes) > self.MAX_REMEMBERED_HASHES",
        "self._num_remembered_hashes + len(request.block_hashes) >= self.MAX_REMEMBERED_HASHES",
    ),
    # ------------------------------------------ fast path, rules 5-8 (sync lane)
    _steady(
        "steady-hand-over-args-swapped",
        "swap",
        "5 (a request takes the tokens it sampled since it last took them)",
        "self.model_runner.sampled_token_ids(kept.handed_over, new_tokens)",
        "self.model_runner.sampled_token_ids(new_tokens, kept.handed_over)",
    ),
    _steady(
        "steady-entry-computed-tokens-swapped",
        "swap",
        "5 (a kept request starts from its Request's counts)",
        "request, request.num_computed_tokens, num_tokens, num_tokens,",
        "request, num_tokens, request.num_computed_tokens, num_tokens,",
    ),
    _steady(
        "steady-offer-tokens-drafts-swapped",
        "swap",
        "6 (the lane offers 1 + K tokens, K of them drafts)",
        "ScheduledRequest(request_id, step_tokens, kept.computed, num_spec, 0)",
        "ScheduledRequest(request_id, num_spec, kept.computed, step_tokens, 0)",
    ),
    _steady(
        "steady-rejected-sign-swapped",
        "swap",
        "7 (a kept step rolls back its rejected drafts)",
        "kept.computed -= num_spec - num_accepted",
        "kept.computed -= num_accepted - num_spec",
    ),
    _steady(
        "steady-span-ends-swapped",
        "swap",
        "6 (the limit leaves the span's width inside the allocation window)",
        "limit = min(allocation[1] - (span[1] - computed), clip)",
        "limit = min(allocation[1] - (computed - span[1]), clip)",
    ),
    _steady(
        "steady-draws-in-reverse-order",
        "reorder",
        "7 (the lane draws in the step's order)",
        "        for item in output.scheduled:\n            if item.request_id not in taken:",
        "        for item in reversed(output.scheduled):\n            if item.request_id not in taken:",
    ),
    _steady(
        "steady-output-arrives-after-applies",
        "reorder",
        "8 (a step's output arrives before its requests' outputs apply)",
        "        scheduler.output_arrives(output)\n        tally = StepTally()\n",
        "        tally = StepTally()\n",
        also=(
            (
                "        if num_spec:\n            tally.num_draft_tokens",
                "        scheduler.output_arrives(output)\n"
                "        if num_spec:\n            tally.num_draft_tokens",
            ),
        ),
    ),
    _steady(
        "steady-decoding-clause-dropped",
        "clause",
        "6 (only a decode enters: all its tokens computed but the last)",
        "return request.num_computed_tokens == known - 1 and len(request.spec_token_ids) == self.num_spec",
        "return len(request.spec_token_ids) == self.num_spec",
    ),
    _steady(
        "steady-drafts-clause-dropped",
        "clause",
        "6 (only a decode with K drafts queued enters)",
        "return request.num_computed_tokens == known - 1 and len(request.spec_token_ids) == self.num_spec",
        "return request.num_computed_tokens == known - 1",
    ),
    _steady(
        "steady-allocation-window-start-dropped",
        "clause",
        "6 (the allocation window starts at or before the span)",
        "if span is None or allocation is None or allocation[0] > span[0]:",
        "if span is None or allocation is None:",
    ),
    _steady(
        "steady-caching-num-spec-dropped",
        "clause",
        "6 (a caching window only with drafts: K = 0 caches nothing after sampling)",
        "not (self.num_spec and self.scheduler.config.caches_after_sampling):",
        "not (self.scheduler.config.caches_after_sampling):",
    ),
    _steady(
        "steady-caching-after-sampling-dropped",
        "clause",
        "6 (a caching window only where the scheduler caches after sampling)",
        "not (self.num_spec and self.scheduler.config.caches_after_sampling):",
        "not (self.num_spec):",
    ),
    _steady(
        "steady-caching-window-start-dropped",
        "clause",
        "6 (the caching window starts at or before the step's caching)",
        "if caching is None or caching[0] > computed + 1:",
        "if caching is None:",
    ),
    _steady(
        "steady-audit-caching-clause-dropped",
        "clause",
        "6 (the caching audit only where the scheduler caches after sampling)",
        "if self.door.audit and self.scheduler.config.caches_after_sampling:",
        "if self.door.audit:",
    ),
    _steady(
        "steady-leaves-at-limit-early",
        "edge",
        "6 (a kept request leaves past its limit)",
        "if kept.computed > kept.limit:",
        "if kept.computed >= kept.limit:",
    ),
    _steady(
        "steady-decoding-edge",
        "edge",
        "6 (only a decode enters: all its tokens computed but the last)",
        "return request.num_computed_tokens == known - 1 and",
        "return request.num_computed_tokens == known - 2 and",
    ),
    _steady(
        "steady-allocation-window-start-edge",
        "edge",
        "6 (the allocation window starts at or before the span)",
        "allocation[0] > span[0]:",
        "allocation[0] >= span[0]:",
    ),
    _steady(
        "steady-span-one-short",
        "edge",
        "6 (the span a decode allocates for: 1 + K tokens and K lookahead slots)",
        "span = door.decode_span(request, self.step_tokens + self.num_spec)",
        "span = door.decode_span(request, self.step_tokens + self.num_spec - 1)",
    ),
    _steady(
        "steady-caching-window-start-edge",
        "edge",
        "6 (the caching window starts at or before the step's caching)",
        "if caching is None or caching[0] > computed + 1:",
        "if caching is None or caching[0] > computed + 2:",
    ),
    _steady(
        "steady-caching-limit-one-late",
        "edge",
        "6 (the step caches up to computed + 1 + K)",
        "limit = min(limit, caching[1] - self.step_tokens)",
        "limit = min(limit, caching[1] - self.step_tokens + 1)",
    ),
    _steady(
        "steady-clip-limit-one-late",
        "edge",
        "6 (the max_model_len clip leaves the step whole)",
        "clip = computed + self.scheduler.clip_room(request) - self.step_tokens",
        "clip = computed + self.scheduler.clip_room(request) - self.step_tokens + 1",
    ),
    _steady(
        "steady-entry-limit-strict",
        "edge",
        "6 (a request enters only within its limit)",
        "return limit if computed <= limit else None",
        "return limit if computed < limit else None",
    ),
    _steady(
        "steady-unstoppable-one-late",
        "edge",
        "6 (unstoppable: the step's tokens stay short of the stop room)",
        "self.scheduler.stop_room(request) - self.step_tokens - 1",
        "self.scheduler.stop_room(request) - self.step_tokens",
    ),
    _steady(
        "steady-unstoppable-check-strict",
        "edge",
        "6 (a kept step within unstoppable keeps its tokens aside)",
        "if kept.computed - step_tokens <= kept.unstoppable:",
        "if kept.computed - step_tokens < kept.unstoppable:",
    ),
    _steady(
        "steady-kept-tokens-one-more",
        "edge",
        "7 (a kept step samples its accepted drafts and one token)",
        "kept.num_tokens += num_accepted + 1",
        "kept.num_tokens += num_accepted + 2",
    ),
    # --------------------------------------------------- the async scheduler
    _async(
        "async-sure-to-finish-edge",
        "edge",
        "num_computed_tokens + 2 - num_output_placeholders >= max_tokens_end",
        "num_computed_tokens + 1 - num_output_placeholders >= max_tokens_end",
        OUTPUT,
    ),
    _async(
        "async-sure-to-finish-strict",
        "edge",
        "num_computed_tokens + 2 - num_output_placeholders >= max_tokens_end",
        "num_computed_tokens + 2 - num_output_placeholders > max_tokens_end",
        OUTPUT,
    ),
    _async(
        "async-placeholders-clause-dropped",
        "clause",
        "return num_output_placeholders > 0 and num_computed_tokens",
        "return num_computed_tokens",
        OUTPUT,
    ),
    _async(
        "async-stagger-edge",
        "edge",
        "return self.step_index + 1 < request.next_decode_eligible_step",
        "return self.step_index + 1 <= request.next_decode_eligible_step",
    ),
    _async(
        "async-stale-wait-edge",
        "edge",
        "return request.num_stale_output_tokens > 0",
        "return request.num_stale_output_tokens > 1",
    ),
    _async(
        "async-drafts-accepted-swapped",
        "swap",
        "self._roll_back_rejected(request, item.num_spec_tokens, len(sampled) - 1, stale, tally)",
        "self._roll_back_rejected(request, len(sampled) - 1, item.num_spec_tokens, stale, tally)",
    ),
    _async(
        "async-cache-not-stale-dropped",
        "clause",
        "if not stale and running and (had_placeholders or self.config.num_speculative_tokens):",
        "if running and (had_placeholders or self.config.num_speculative_tokens):",
    ),
    _async(
        "async-cache-running-dropped",
        "clause",
        "if not stale and running and (had_placeholders or self.config.num_speculative_tokens):",
        "if not stale and (had_placeholders or self.config.num_speculative_tokens):",
    ),
    _async(
        "async-outputs-newest-first",
        "reorder",
        "step_index, seq = self._step_seqs.popleft()",
        "step_index, seq = self._step_seqs.pop()",
    ),
    _async(
        "async-fence-on-empty-output",
        "clause",
        "if self.config.defer_block_free and not output.is_empty:",
        "if self.config.defer_block_free:",
    ),
    _async(
        "async-stop-trim-edge",
        "edge",
        "request.num_computed_tokens -= len(sampled) - count",
        "request.num_computed_tokens -= len(sampled) - count - 1",
    ),
    # ------------------------------------------------------ the fork's pins
    _pins(
        "pins-free-order-not-reversed",
        "reorder",
        "pins 0095 (a released pin frees its tail first)",
        "self.block_pool.free_blocks(reversed(blocks))",
        "self.block_pool.free_blocks(blocks)",
    ),
    _pins(
        "pins-waiter-pins-oldest-first",
        "reorder",
        "pins 0095/0096 (waiter pins yield newest first)",
        "order += [(False, rid) for rid in reversed(list(self._pinned_hits)) if rid != keep]",
        "order += [(False, rid) for rid in list(self._pinned_hits) if rid != keep]",
    ),
    _pins(
        "pins-graces-newest-first",
        "reorder",
        "pins 0097 (graces yield oldest first)",
        "order = [(True, rid) for rid in self._graces]",
        "order = [(True, rid) for rid in reversed(list(self._graces))]",
    ),
    _pins(
        "pins-waiter-pins-before-graces",
        "reorder",
        "pins 0097 (graces yield before waiter pins)",
        "        released = 0\n        for is_grace, request_id in order[:limit]:",
        "        released = 0\n        order = sorted(order, key=lambda entry: entry[0])\n"
        "        for is_grace, request_id in order[:limit]:",
    ),
    _pins(
        "pins-held-blocks-head-first",
        "reorder",
        "pins 0097 (a grace holds the table tail first)",
        "for block in reversed(m.req_to_blocks.get(request_id, ()))]",
        "for block in m.req_to_blocks.get(request_id, ())]",
    ),
    _pins(
        "pins-grace-bound-edge",
        "edge",
        "pins 0097 (at most max_grace_pins graces)",
        "while len(self._graces) > self.max_grace_pins:",
        "while len(self._graces) >= self.max_grace_pins:",
    ),
    _pins(
        "pins-grace-reach-one-unit",
        "edge",
        "pins 0097 (a hit within two units releases its grace)",
        "reach = num_hit_tokens + 2 * self.block_pool.hash_block_size",
        "reach = num_hit_tokens + 1 * self.block_pool.hash_block_size",
    ),
    _pins(
        "pins-grace-reach-strict",
        "edge",
        "pins 0097 (a hit within two units releases its grace)",
        "if reach >= self._graces[request_id].num_prompt_tokens:",
        "if reach > self._graces[request_id].num_prompt_tokens:",
    ),
    _pins(
        "pins-waiter-bound-edge",
        "edge",
        "pins 0096 (at most max_pinned_waiters pinned)",
        "or len(self._pinned_hits) >= self.max_pinned_waiters",
        "or len(self._pinned_hits) > self.max_pinned_waiters",
    ),
    _pins(
        "pins-yieldable-hit-clause-dropped",
        "clause",
        "pins 0097 (the head's own hit never counts as yieldable)",
        "if block.ref_cnt == num_pins and key not in hit_ids",
        "if block.ref_cnt == num_pins",
    ),
    _pins(
        "pins-grace-needs-output-dropped",
        "clause",
        "pins 0097 (a grace only for a turn with output)",
        "            and request.num_output_tokens > 0\n",
        "",
    ),
    _pins(
        "sched-pins-pass-bound-edge",
        "edge",
        "scheduler pins 3 (the pass stops at the bound)",
        "if manager.num_pinned_waiters >= manager.max_pinned_waiters:",
        "if manager.num_pinned_waiters > manager.max_pinned_waiters:",
        SCHED_PINS,
    ),
    _pins(
        "sched-pins-computed-clause-dropped",
        "clause",
        "scheduler pins 3 (only waiters that computed nothing)",
        "if request.num_computed_tokens == 0 and request.status in _PINNABLE_STATUSES:",
        "if request.status in _PINNABLE_STATUSES:",
        SCHED_PINS,
    ),
    _pins(
        "sched-pins-status-clause-dropped",
        "clause",
        "scheduler pins 3 (only WAITING or PREEMPTED waiters)",
        "if request.num_computed_tokens == 0 and request.status in _PINNABLE_STATUSES:",
        "if request.num_computed_tokens == 0:",
        SCHED_PINS,
    ),
    _pins(
        "sched-pins-no-shortfall-clause-dropped",
        "clause",
        "scheduler pins 2 (0097: nothing to do without a shortfall)",
        "if manager.last_alloc_shortfall <= 0 or not (manager.num_grace_pins or manager.num_pinned_waiters):",
        "if not (manager.num_grace_pins or manager.num_pinned_waiters):",
        SCHED_PINS,
    ),
    _pins(
        "sched-pins-graces-clause-dropped",
        "clause",
        "scheduler pins 2 (0097: graces alone are worth a try)",
        "if manager.last_alloc_shortfall <= 0 or not (manager.num_grace_pins or manager.num_pinned_waiters):",
        "if manager.last_alloc_shortfall <= 0 or not manager.num_pinned_waiters:",
        SCHED_PINS,
    ),
    _pins(
        "sched-pins-covered-strict",
        "edge",
        "scheduler pins 2 (0097: yield only while the yieldable covers the shortfall)",
        "return manager.last_alloc_shortfall <= manager.num_yieldable_blocks(",
        "return manager.last_alloc_shortfall < manager.num_yieldable_blocks(",
        SCHED_PINS,
    ),
)


def _copy_tree(copy: Path) -> None:
    """Tracked and new (not ignored) files: no .venv, no results."""
    if copy.exists():
        shutil.rmtree(copy)
    copy.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _pytest(copy: Path, python: str, tests: tuple[str, ...]) -> tuple[str, float]:
    """'passed', 'failed' or 'timeout', and the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - started
    return ("passed" if done.returncode == 0 else "failed"), time.monotonic() - started


def mutate(mutant: Mutant, original: str) -> tuple[str, int]:
    """The mutated text, or '' and the match count of the first patch whose
    old text does not occur exactly once (the mutant no longer aims)."""
    mutated = original
    for old, new in ((mutant.old, mutant.new), *mutant.also):
        count = mutated.count(old)
        if count != 1:
            return "", count
        mutated = mutated.replace(old, new)
    return mutated, 1


def run_mutant(mutant: Mutant, copy: Path, python: str) -> dict[str, object]:
    path = copy / mutant.path
    original = path.read_text()
    mutated, count = mutate(mutant, original)
    if not mutated:
        return {"outcome": f"not applied ({count} matches)", "seconds": 0.0}
    path.write_text(mutated)
    try:
        outcome, seconds = _pytest(copy, python, mutant.tests)
    finally:
        path.write_text(original)
    verdict = {"failed": "killed", "passed": "survived", "timeout": "killed (timeout)"}[outcome]
    return {"outcome": verdict, "seconds": round(seconds, 1)}


def markdown_table(results: dict[str, dict[str, object]]) -> str:
    by_name = {m.name: m for m in MUTANTS}
    lines = ["| Kind | Mutant | Rule | File | Outcome | Seconds |", "|---|---|---|---|---|---:|"]
    for kind in ("swap", "reorder", "clause", "edge"):
        for name, result in results.items():
            mutant = by_name.get(name)
            if mutant is None or mutant.kind != kind:
                continue
            outcome, seconds = result["outcome"], result["seconds"]
            lines.append(f"| {kind} | `{name}` | {mutant.rule} | `{mutant.path}` | {outcome} | {seconds} |")
    counts = [str(result["outcome"]).split(" ")[0] for result in results.values()]
    killed, survived = counts.count("killed"), counts.count("survived")
    lines.append("")
    lines.append(f"{killed} killed, {survived} survived of {len(results)} run.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patterns", nargs="*", help="mutant name globs (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--table", metavar="RESULTS", help="print the markdown table of a results file")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    # In the patterns' order (the quick kills first, say), each mutant once.
    chosen = list(MUTANTS) if not args.patterns else []
    for pattern in args.patterns:
        chosen += [m for m in MUTANTS if fnmatch.fnmatch(m.name, pattern) and m not in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.kind:8} {m.name:40} {m.path}")
        return 0
    work = Path(os.environ.get("KVSIM_MUTATION_DIR", "/tmp/kvsim-mutation")) / "hand"
    copy = work / "tree"
    python = os.environ.get("KVSIM_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    _copy_tree(copy)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    # The unmutated copy must pass each test set, else a "killed" means nothing.
    for tests in {m.tests for m in chosen}:
        outcome, seconds = _pytest(copy, python, tests)
        print(f"baseline ({len(tests)} test ids): {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            return 1
    for mutant in chosen:
        results[mutant.name] = run_mutant(mutant, copy, python)
        print(f"{mutant.kind:8} {mutant.name:40} {results[mutant.name]['outcome']}", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    print(markdown_table({m.name: results[m.name] for m in chosen}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
