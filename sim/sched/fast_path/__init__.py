"""The fast path: the scheduler work kvsim skips because it changes nothing.

No twin in vLLM (its scheduler makes every call). Two objects: the
allocator's door (``FastPathKVCacheManager``, ``kv_cache_manager.py``: the
scheduler's ``kv_cache_manager`` when ``simulation.fast_path`` is on), which
decides every call into the allocator, and ``FastPath`` (held as
``Scheduler.fast_path``, ``memos.py``; ``NoFastPath`` when off, so the
scheduler never branches on it), the memos of the scheduler's own loops and the lanes:

- **settled calls** (``settled.py``): a decoding request's ``allocate_slots``
  and ``cache_blocks`` between block boundaries change nothing; the first
  call in a block's window is made, the next are skipped;
- **the steady lane** (``steady.py``): a request whose decode steps are alike
  keeps its tokens aside and is scheduled as it is, past the running loop's
  arithmetic (``EngineCore`` makes it with ``make_lane``; in async mode
  ``BatchQueueEngineCore`` makes ``async_steady.py``'s with ``make_async_lane``);
- **known-idle waiting loops**: a waiting loop that admitted nobody admits
  nobody again while its inputs, its head and the allocator are unchanged
  (the allocator's version counts the calls that may change it), or, for
  a head that found no prefix hit, while running requests only took
  blocks;
- **missed pin lookups** (``missed_lookups.py``): a waiter whose lookup for
  the fork's waiter pins found no hit finds none again until a hash is
  cached or its tokens change.

The scheduler calls ``self.kv_cache_manager.…`` as vLLM's does; the door
skips a settled call, answers a lookup known to find nothing and counts
every call that may change the allocator. What stays at the scheduler's
level, each a call on ``Scheduler.fast_path``: the waiting-loop memo
(``skips_waiting`` / ``waiting_starts`` / ``waiting_ends``, a refused
admission, ``waiter_admitted``), the pin-pass memo (``skips_pin_pass`` /
``unchanged_waiters`` / ``pin_pass_ends``, ``pins.py``), a waiter's change
(``waiting_tokens_change`` / ``waiting_request_changes``, async mode) and
the lanes (``make_lane`` / ``make_async_lane``, the engine cores).

``audit = True`` makes every skipped call anyway and asserts it changed
nothing (the whole allocator state compared, ``allocator_snapshot``), and
counts them in ``audited``: the tests' proof, through a public switch.

The rules the fast path rests on, each with the test that goes red when it
is broken:

1. A call whose positions, widened by the margin, lie strictly inside one
   block of every size the allocator divides by, after a real call in the
   same block, changes nothing (``settled.py``). The hash unit is such a
   size only where the widened span reaches into the prompt: past it a
   call reads the unit only through the count of block hashes, floored to
   a block, and through the prompt's own boundaries (argued: the calls
   the scheduler makes inside a prompt are prefill chunks, never skipped,
   so no trace has shown the unit to matter there; kept as the safe side).
   ``tests/test_fast_path.py::test_the_hash_unit_bounds_a_window_only_inside_the_prompt``
   (the arithmetic); the rig's block flags among the audited cases
   (``tests/helpers/fast_path.py``) for the decodes past the prompt.
   ``tests/test_fast_path.py::test_the_check_catches_a_call_skipped_across_a_boundary``,
   ``::test_a_fast_path_that_skips_across_boundaries_changes_the_frames``.
2. The margin, ``4 * (1 + K) + 16`` tokens (``margin_tokens``), lies well
   past every offset a call adds to the positions it is taken to read (the
   ``K`` lookahead slots, the ``K`` tokens an EAGLE drop or a lookahead hash
   reaches, the ``1 + K`` of a rejected step's rollback): argued, with room
   to spare, not derived to the token; the audit checks it.
   ``tests/test_fast_path.py::test_the_calls_skipped_across_a_block_boundary``
   (the hand count moves with it).
3. Every call that may change the allocator bumps the version: structural,
   the door is the scheduler's only way to the allocator and bumps it for
   each (frees, fenced frees, a copy-on-write's release, an admission, pins
   and yields that change something; a running request's allocation and
   caching move ``allocator_version`` alone, rule 12). ``new_step_starts``
   (clears a per-step set of cached ids) and ``get_computed_blocks`` (a
   lookup: it touches nothing) do not. A new call into the allocator is a
   method of the door, or passes through it unseen: check it here.
   ``tests/test_steady.py::test_the_waiting_memo_holds_only_for_the_same_inputs_and_allocator``.
4. ``_waiting_inputs`` lists everything the waiting loop reads besides its
   head and the allocator: the budget left, the running and waiting counts,
   whether a running request or a prefill was scheduled. A read added to
   ``Scheduler._admit_waiting`` or ``_pads_to_uniform_decode`` must be
   added there. The memo keeps up to ``MAX_INPUTS`` idle loops' inputs
   while the head and the allocator's version stay (async scheduling's
   stagger alternates two budgets): each was idle on the same state.
   ``tests/test_steady.py::test_the_waiting_memo_keeps_idle_loops_of_other_inputs_while_the_allocator_stays``.
   ``tests/test_steady.py::test_the_check_catches_a_waiting_loop_wrongly_skipped``,
   ``::test_a_lane_skipping_every_waiting_loop_changes_the_frames``.
5. A request in the lane has a stale ``Request`` (computed tokens, output
   tokens): read ``Scheduler.requests`` / ``running`` only after
   ``EngineCore.flush``. ``LiveEngine`` (``kvsim serve``) builds its
   ``EngineCore`` with ``steady_lane=False``, so it may read (and abort)
   requests every step.
   ``tests/test_steady.py::test_without_the_hand_over_at_the_horizon_requests_lag``.
6. A kept request's ``limit`` and ``unstoppable`` are computed once, when it
   enters the lane: valid because its settled windows cannot move while its
   calls are skipped (they move only on a real call or a free, and a free
   hands the request back first).
   ``tests/test_steady.py::test_the_check_catches_a_steady_step_across_a_boundary``,
   ``::test_a_lane_that_never_stops_a_request_changes_the_frames``.
7. The lane draws acceptances from the runner's stream in exactly
   ``ModelRunner.execute``'s order (the step's order, one draw per request).
   ``tests/test_steady.py::test_the_conformance_driver_compares_the_lanes_steps``,
   ``::test_a_runners_acceptance_draws_are_its_per_request_draws``.
8. Every step's output passes ``Scheduler.output_arrives`` before any of its
   requests' outputs is applied, the lane's steps too (the fences pass
   first; the pool replay's observer relies on it).
   ``tests/test_fast_path.py::test_every_gate_scenario_gives_the_same_frames_with_and_without_the_fast_path``.

9. In async mode (``AsyncScheduler``; the lane is ``async_steady.py``) a decode's
   ``allocate_slots`` reads back to its processed tokens, behind the
   tokens in flight (vLLM frees skipped blocks there), so its window spans
   from them (``FastPathKVCacheManager.decode_span``); its ``cache_blocks`` calls are at
   the processed tokens. A preempted request's stale output draining
   changes what the waiting loop reads without an allocator call: it voids
   the memo (``waiting_request_changes``). The async lane keeps a decode's
   in-flight tokens, placeholders and stagger; its window is the same span.
   ``tests/test_fast_path.py::test_the_check_catches_an_async_window_blind_to_the_tokens_in_flight``,
   ``tests/test_async_steady.py::test_the_check_catches_an_async_lane_blind_to_the_tokens_in_flight``,
   ``::test_a_lane_that_ignores_the_stagger_fails_the_conformance_gate``.
10. A waiter's pin lookup (``get_computed_blocks``, pin point 3) that found
   no hit finds none again while no (hash, block) pair with one of its own
   block hashes was inserted into the pool's cached-hash map
   (``BlockPool._insert_block_hash``, counted when the map lacked the
   pair: a call for a pair it holds inserts nothing, and a decode's
   caching makes one every step) and the
   request has the same tokens and block hashes: a lookup reads nothing
   else that moves, and removing cached hashes (evictions, a reset) only
   shrinks a hit. The allocator version would be safe too, but it moves
   with every allocation; a hash is inserted only as a block (or, with
   partial hits, a unit) is cached. The audit makes each skipped lookup.
   ``tests/test_fast_path.py::test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes``,
   ``::test_a_pin_lookup_memo_blind_to_new_hashes_changes_the_frames``,
   ``::test_a_waiter_with_no_hit_is_looked_up_again_once_a_hash_is_cached_or_its_tokens_grow``.
11. A pin pass that pinned nothing pins nothing again, and is skipped
   whole, while no hash was inserted, the waiting queue holds the same
   entries (by identity) in the same order, no waiting request took tokens
   (``waiting_tokens_change``: a stale output lands, async mode) and the
   same waiters are pinned: each waiter meets it as before (pinned, past
   the bound, or known to find no hit, rule 10). A waiter's computed tokens
   and status change only as it enters or leaves the queue.
   When only the queue changed (an arrival, an admission), a pass passes
   over the waiters of the last idle pass and examines only the others
   (by identity; the audit makes each passed-over waiter's pin call and
   asserts it pins nothing). The scheduler's queue (``waiting_queue.WaitingQueue``)
   counts every call of ``deque`` that may put an entry in it: with none
   since the idle pass (no call, or only removals: admissions pop the head),
   every waiter left met the idle pass, without reading its entries, so
   with none forgotten the pass would pass over all of them and is skipped
   whole.
   With hashes inserted since, a pass still passes over the idle pass's
   waiters if that pass met only waiters rule 10 remembers (each reported
   otherwise by the door's ``pin_waiting_hit``): an insertion changes such a
   waiter only by forgetting it, and the forgotten ones are examined. An
   admitted waiter is examined again too (``waiter_admitted``: preempted,
   it comes back as the same object with more tokens).
   ``tests/test_fast_path.py::test_a_pin_pass_is_known_idle_only_with_the_same_queue_pins_hashes_and_tokens``,
   ``tests/test_values_fast_path.py::test_a_pass_after_an_idle_one_examines_only_the_waiters_it_did_not_meet``,
   ``::test_the_waiting_queue_counts_every_call_of_deque_that_may_insert``,
   ``::test_after_insertions_a_pass_passes_over_the_remembered_waiters_not_forgotten``,
   ``::test_a_pin_call_that_pins_nothing_and_finds_a_hit_is_not_remembered``,
   ``::test_the_scheduler_reports_each_admitted_waiter_to_rule_11``,
   ``::test_a_queue_only_taken_from_since_an_idle_pass_is_known_idle``.
12. A waiting loop that admitted nobody, whose lookup of its head found
   nothing in any group (no token, no block, no shared-prefix boundary),
   admits nobody again with the same head and inputs while the only calls
   since were running requests' allocations and caching
   (the door moves ``allocator_version`` alone for them; every other change bumps the release
   version too: frees, fenced frees, admissions, pins, preemptions, a
   waiter's stale output), none of the head's hashes was inserted (rule
   10's memo of the head is still the one it had at that lookup: a pin
   lookup remembers a forgotten head anew on no tokens hit, though a
   group's blocks may be found) and the pool has no more free blocks.
   Argued: with no hit, what ``allocate_slots`` counts for a waiting
   request reads only the request (it holds no blocks), the flags, and
   the packed rings' free slots (claimed at admission, released at a
   free); it refuses when that need exceeds the free blocks, which have
   not grown; the fork's head guard (0097) compares a shortfall that has
   only grown with pins that have not changed. The hit stays empty: each
   group's hit, and the boundary (one group's longer hit), grow only with
   the head's own hashes inserted. A running request's allocation may
   free its own skipped blocks: the free count catches that.
   ``tests/test_steady.py::test_a_head_that_found_nothing_stays_refused_while_running_requests_only_take_blocks``,
   ``::test_a_head_whose_own_hash_is_inserted_is_looked_up_again``,
   ``::test_a_head_forgotten_then_remembered_again_by_a_pin_lookup_is_looked_up_again``,
   ``::test_a_lookup_found_nothing_only_with_no_block_no_token_and_no_boundary``,
   ``::test_the_check_catches_a_head_taken_as_refused_after_blocks_came_free``.

Every rule is also checked whole, in both engine modes: every gate scenario's frames are the same
with the fast path off, and the conformance driver steps the lane against
vLLM's own ``Scheduler``. Glossary: ``docs/fast-path.md``.
"""
