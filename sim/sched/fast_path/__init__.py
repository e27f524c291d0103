"""The fast path: the scheduler work kvsim skips because it changes nothing.

No twin in vLLM (its scheduler makes every call). Two objects: the
allocator's door (``FastPathKVCacheManager``, ``kv_cache_manager.py``: the
scheduler's ``kv_cache_manager`` when ``simulation.fast_path`` is on, built
by ``engine_assembly.build_engine``), which decides every call that may
change the allocator, and ``FastPath`` (``memos.py``, held as
``Scheduler.fast_path``; ``NoFastPath`` when off), the memos of the
scheduler's own loops and the steady lanes (``steady.py``,
``async_steady.py``). ``audit = True`` makes every skipped call anyway and
asserts it changed nothing (``allocator_snapshot``), counted in ``audited``.

The rules, each with a test that goes red when it is broken (each argued in
full in ``docs/fast-path.md``, "The rules, argued"; ``tf`` is
``tests/test_fast_path.py``, ``ts`` ``tests/test_steady.py``, ``tas``
``tests/test_async_steady.py``, ``tvf`` ``tests/test_values_fast_path.py``):

1. A decode's call whose positions, widened by the margin, lie strictly
   inside one block of every size the allocator divides by (the hash unit
   only inside the prompt), after a real call in that block, changes
   nothing (``settled.py``). ``tf::test_the_check_catches_a_call_skipped_across_a_boundary``,
   ``tf::test_the_hash_unit_bounds_a_window_only_inside_the_prompt``.
2. The margin, ``margin_tokens``, lies past every offset a call adds
   (lookahead, hash lookahead, a rejected step's rollback).
   ``tf::test_the_calls_skipped_across_a_block_boundary``.
3. Every call that may change the allocator bumps the allocator version:
   structural, the door is the scheduler's only way to it (a new call is a
   door method or in ``PASSED_THROUGH``).
   ``ts::test_the_waiting_memo_holds_only_for_the_same_inputs_and_allocator``.
4. ``FastPath._waiting_inputs`` lists all the waiting loop reads besides
   its head and the allocator (a read added to ``Scheduler._admit_waiting``
   is added there); up to ``MAX_INPUTS`` idle loops are kept per head and
   version. ``ts::test_the_check_catches_a_waiting_loop_wrongly_skipped``,
   ``ts::test_the_waiting_memo_keeps_idle_loops_of_other_inputs_while_the_allocator_stays``.
5. A request in the lane has a stale ``Request``: read ``Scheduler.requests``
   only after ``EngineCore.flush`` (``kvsim serve`` runs without the lane).
   ``ts::test_without_the_hand_over_at_the_horizon_requests_lag``.
6. A kept request's ``limit`` and ``unstoppable`` are fixed when it enters
   the lane (its windows move only on a real call or a free).
   ``ts::test_the_check_catches_a_steady_step_across_a_boundary``.
7. The lane draws acceptances in ``ModelRunner.execute``'s order.
   ``ts::test_the_conformance_driver_compares_the_lanes_steps``.
8. Every output passes ``Scheduler.output_arrives`` before its requests'
   tokens are applied, the lane's too.
   ``tf::test_every_gate_scenario_gives_the_same_frames_with_and_without_the_fast_path``.
9. Async mode: a decode's window spans from its processed tokens, behind
   those in flight (``decode_span``); a waiter's drained stale output voids
   the waiting memo. ``tf::test_the_check_catches_an_async_window_blind_to_the_tokens_in_flight``,
   ``tas::test_the_check_catches_an_async_lane_blind_to_the_tokens_in_flight``.
10. A waiter's pin lookup with no hit finds none again while none of its
   own block hashes was inserted into the pool's cached-hash map and its
   tokens are the same (``missed_lookups.py``).
   ``tf::test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes``.
11. A pin pass that pinned nothing pins nothing again, and is skipped, while
   no hash was inserted, the queue holds the same waiters, none took tokens
   and the same are pinned; with only the queue changed, it passes over the
   waiters that pass met.
   ``tf::test_a_pin_pass_is_known_idle_only_with_the_same_queue_pins_hashes_and_tokens``,
   ``tvf::test_a_pass_after_an_idle_one_examines_only_the_waiters_it_did_not_meet``.
12. A waiting loop whose head's lookup found nothing admits nobody again
   while only running requests' allocations and caching changed the
   allocator (``release_version`` unmoved), none of the head's hashes was
   inserted and the pool has no more free blocks.
   ``ts::test_the_check_catches_a_head_taken_as_refused_after_blocks_came_free``,
   ``ts::test_a_release_bump_at_a_running_allocation_alone_is_caught``.

Every rule is also checked whole, in both engine modes: every gate
scenario's frames are the same with the fast path off, and the conformance
drivers step the lanes against vLLM's own ``Scheduler``.
"""
