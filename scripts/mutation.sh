#!/usr/bin/env bash
# Mutation testing (mutmut 3) over the modules that hold kvsim's rules, one
# module at a time, each against the few test files that pin it (fast:
# mutmut imports vLLM once and forks per mutant, running only the tests
# that reach the mutated function). Slow on purpose-built hardware and not
# part of CI; see docs/testing.md.
#
#   scripts/mutation.sh                  every module below, in order
#   scripts/mutation.sh gates step_time  the named modules only
#
# Each module runs in a throwaway copy of the working tree
# (${KVSIM_MUTATION_DIR:-/tmp/kvsim-mutation}/<module>), so the checkout
# never holds mutants/; the survivors and the counts are printed and kept
# in <copy>/results.txt. KVSIM_VENV picks the environment (default .venv).
# KVSIM_MUTATION_CHILDREN caps the parallel mutant runs (mutmut's
# --max-children; default: every core), e.g. 1 on a shared machine:
#   nice -n 19 env KVSIM_MUTATION_CHILDREN=1 scripts/mutation.sh scheduler
# KVSIM_MUTANTS restricts a run to mutmut's mutant names matching its
# space-separated globs (e.g. the functions a change touched):
#   KVSIM_MUTANTS='*_take_steady__* *_schedule_running__*' scripts/mutation.sh scheduler
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVSIM_VENV:-$root/.venv}"
work="${KVSIM_MUTATION_DIR:-/tmp/kvsim-mutation}"
children=()
if [[ -n "${KVSIM_MUTATION_CHILDREN:-}" ]]; then
  children=(--max-children "$KVSIM_MUTATION_CHILDREN")
fi
read -r -a only_mutants <<<"${KVSIM_MUTANTS:-}"
# torch's OpenMP thread pool, once used, hangs in a forked child, and mutmut
# forks one per mutant: the pool replay's mutants all timed out. One thread.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# module -> "source file|test files" (the tests that pin that module's rules).
# The fast path's unit tests and one case that makes every skipped call
# anyway (decodes across block boundaries, the pool binding): seconds, not
# the minute the whole file takes. The async pool-bound audit (2 s) is the
# one that settles a call freeing a block behind the tokens in flight: the
# failing control replaces decode_span itself, so without it a span blind to
# those tokens passed (issue 41's hand mutants).
FAST_PATH_TESTS="tests/test_fast_path.py::test_a_window_is_one_block_interior_widened_by_the_margin \
tests/test_fast_path.py::test_a_window_needs_every_block_size \
tests/test_fast_path.py::test_only_a_second_call_in_the_same_window_is_settled \
tests/test_fast_path.py::test_a_settled_window_ends_exactly_at_its_bounds \
tests/test_fast_path.py::test_block_sizes_must_be_positive \
tests/test_fast_path.py::test_the_hash_unit_bounds_a_window_only_inside_the_prompt \
tests/test_fast_path.py::test_forgetting_a_request_never_recorded_is_harmless \
tests/test_fast_path.py::test_the_calls_skipped_across_a_block_boundary \
tests/test_fast_path.py::test_prefill_chunks_are_never_skipped \
tests/test_fast_path.py::test_a_stop_within_a_step_counts_the_tokens_up_to_it \
tests/test_fast_path.py::test_requests_of_one_output_length_share_their_sampling_params \
tests/test_fast_path.py::test_every_skipped_call_changes_nothing[heavy-preemption--off-sync] \
tests/test_fast_path.py::test_every_skipped_call_changes_nothing[decode-across-boundaries--off-sync] \
tests/test_fast_path.py::test_every_skipped_call_changes_nothing[heavy-preemption--off-async] \
tests/test_fast_path.py::test_every_skipped_call_changes_nothing[saturated-decode--off-async] \
tests/test_fast_path.py::test_the_check_catches_an_async_window_blind_to_the_tokens_in_flight"

STEADY_TESTS="tests/test_steady.py::test_a_decode_across_a_block_boundary_runs_steady_inside_its_windows \
tests/test_steady.py::test_where_the_scheduler_caches_at_allocation_only_the_allocation_window_alone_bounds_the_lane \
tests/test_steady.py::test_without_drafts_the_allocation_window_alone_bounds_the_lane \
tests/test_steady.py::test_a_kept_request_takes_its_tokens_first_at_the_step_that_may_stop_it \
tests/test_steady.py::test_a_requests_limit_is_the_last_step_start_its_windows_and_the_clip_leave_whole \
tests/test_steady.py::test_every_draft_accepted_stops_inside_the_lane \
tests/test_steady.py::test_a_steady_step_admits_an_arrival_after_its_decodes \
tests/test_steady.py::test_a_one_token_admission_beside_steady_decodes_is_padded_to_a_uniform_decode \
tests/test_steady.py::test_a_one_token_admission_with_nothing_else_scheduled_is_not_padded \
tests/test_steady.py::test_the_max_model_len_clip_ends_the_lane \
tests/test_steady.py::test_a_step_that_reaches_max_model_len_stops_the_request_in_the_lane \
tests/test_steady.py::test_a_steady_decode_runs_beside_an_earlier_prefill \
tests/test_steady.py::test_a_clipped_budget_hands_a_steady_decode_back \
tests/test_steady.py::test_a_long_prefill_threshold_below_a_decode_hands_it_back \
tests/test_steady.py::test_every_call_a_steady_step_skips_changes_nothing[decode-across-boundaries-['deployment.max_num_seqs=16']-off] \
tests/test_steady.py::test_every_call_a_steady_step_skips_changes_nothing[heavy-preemption-[]-off] \
tests/test_steady.py::test_every_call_a_steady_step_skips_changes_nothing[saturated-decode-['workload.max_requests=60']-off] \
tests/test_steady.py::test_pool_bound_decode_gives_the_same_frames_in_the_lane[off-eagle-drop] \
tests/test_steady.py::test_requests_stopped_by_the_horizon_hold_every_token_they_sampled \
tests/test_steady.py::test_the_conformance_driver_compares_the_lanes_steps \
tests/test_steady.py::test_a_head_that_found_nothing_stays_refused_while_running_requests_only_take_blocks \
tests/test_steady.py::test_a_head_whose_own_hash_is_inserted_is_looked_up_again \
tests/test_steady.py::test_a_head_forgotten_then_remembered_again_by_a_pin_lookup_is_looked_up_again \
tests/test_steady.py::test_a_refused_head_that_found_nothing_is_neither_looked_up_nor_allocated_again \
tests/test_steady.py::test_a_lookup_found_nothing_only_with_no_block_no_token_and_no_boundary \
tests/test_steady.py::test_the_check_catches_a_head_taken_as_refused_after_blocks_came_free \
tests/test_steady.py::test_a_refused_admission_is_known_only_for_the_same_request_tokens_running_set_and_empty_lookup \
tests/test_steady.py::test_each_audited_lookup_that_finds_nothing_counts_once \
tests/test_steady.py::test_rule_12_keeps_the_idle_loops_of_other_inputs_across_the_changes_it_allows \
tests/test_steady.py::test_only_a_decode_with_the_last_known_token_left_and_k_drafts_enters_the_lane \
tests/test_steady.py::test_a_request_the_entry_test_keeps_out_has_no_limit_however_wide_its_windows \
tests/test_steady.py::test_the_check_catches_a_steady_step_across_a_boundary \
tests/test_steady.py::test_each_audited_lane_step_counts_once_and_the_audit_off_makes_none \
tests/test_steady.py::test_the_lane_audits_a_taken_step_from_its_start_with_its_lookahead"

# The async conformance gate (vLLM's own step_with_batch_queue over its
# AsyncScheduler, step for step): the two preempting shapes, both hashing
# modes, fenced frees, and the controls (a stagger of one, a budget per
# pipeline cycle, a fence of depth two) that must fail where vLLM says.
ASYNC_CONFORMANCE_TESTS="tests/test_async_conformance.py::test_every_engine_step_is_identical[heavy-preemption-off-eagle-drop] \
tests/test_async_conformance.py::test_every_engine_step_is_identical[heavy-preemption-on-lookahead] \
tests/test_async_conformance.py::test_every_engine_step_is_identical[prefix-hits-off-eagle-drop] \
tests/test_async_conformance.py::test_every_engine_step_is_identical[long-chunked-on-lookahead] \
tests/test_async_conformance.py::test_every_engine_step_is_identical_with_fenced_frees[heavy-preemption]"

# kvsim bench's figures and verdicts (the RSS test is left out: it measures memory).
BENCH_TESTS="tests/test_cli.py::test_bench_measures_a_run \
tests/test_cli.py::test_bench_ratios_are_per_step_cpu_cost_within_one_run \
tests/test_cli.py::test_bench_says_where_the_speed_targets_stand \
tests/test_cli.py::test_bench_says_a_missed_target_is_out_of_reach_where_the_allocators_calls_leave_no_room \
tests/test_cli.py::test_the_allocator_timer_counts_outermost_calls_only \
tests/test_cli.py::test_bench_times_the_allocator_in_the_same_run \
tests/test_cli.py::test_bench_repeats_each_measurement_in_turn_and_keeps_its_least_disturbed_run \
tests/test_cli.py::test_bench_saves_its_figures_as_json"

# The async lane: the audit on the shortest checked shapes (every skipped
# call made anyway), its failing controls and its conformance runs; the
# long shapes (decode across boundaries, saturated decode) are left out.
ASYNC_STEADY_TESTS="tests/test_async_steady.py::test_every_call_the_async_lane_skips_changes_nothing[heavy-preemption--off] \
tests/test_async_steady.py::test_every_call_the_async_lane_skips_changes_nothing[prefix-hits-0-on] \
tests/test_async_steady.py::test_the_check_catches_an_async_lane_across_a_boundary \
tests/test_async_steady.py::test_the_check_catches_an_async_lane_blind_to_the_tokens_in_flight \
tests/test_async_steady.py::test_the_conformance_gate_runs_through_the_lane \
tests/test_async_steady.py::test_a_lane_that_ignores_the_stagger_fails_the_conformance_gate \
tests/test_async_steady.py::test_a_lane_that_never_rolls_back_a_draft_fails_the_conformance_gate"

# The fast path's rules 10-11 (the waiters' pin lookups that found no hit,
# pin passes known idle): the value tests, the memo's unit tests, the audit on prefix-shared
# with its failing control (under a second each) and the saturated-decode
# audit, the one checked shape that skips pin lookups and whole passes (4 s).
MISSED_LOOKUP_TESTS="tests/test_values_fast_path.py \
tests/test_fast_path.py::test_a_waiter_with_no_hit_is_looked_up_again_once_a_hash_is_cached_or_its_tokens_grow \
tests/test_fast_path.py::test_a_pin_pass_is_known_idle_only_with_the_same_queue_pins_hashes_and_tokens \
tests/test_fast_path.py::test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes[False] \
tests/test_fast_path.py::test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes[True] \
tests/test_fast_path.py::test_every_skipped_call_changes_nothing[saturated-decode--off-sync]"

# The replay's fast tests beyond its value file: an unreachable server, the
# flags, what a replay records and sends against the fault server, the
# requests frame's labels, a Ctrl-C's stop against kvsim serve (under a
# second each). The fault-server replays of tests/test_replay.py (HTTP
# errors, a bad page, a server that dies, Ctrl-C: 2-3 s each, the dying
# one flaky on a loaded machine) are left out: the value file reaches the
# same paths in a fraction of the time.
REPLAY_FAST_TESTS="tests/test_replay.py::test_unreachable_url_is_one_line_and_exit_2 \
tests/test_replay.py::test_replay_flags_are_checked \
tests/test_values_replay.py::test_a_replay_records_what_the_page_states_and_sends_each_requests_length \
tests/test_values_replay.py::test_the_requests_frame_labels_each_outcome \
tests/test_serve_hostile.py::test_a_replay_stopped_with_ctrl_c_leaves_no_running_request_and_its_blocks_free[True]"

declare -A MODULES=(
  [allocator_invariants]="sim/allocator_invariants.py|tests/test_allocator_invariant_rules.py tests/test_allocator_properties.py"
  [step_time]="sim/step_time.py|tests/test_step_time.py tests/test_engine_timeline.py"
  # The gates tests that run gate scenarios take seconds each: only the
  # pure-function ones (judging, tolerances, the baseline rewrite) and
  # tests/test_gate_reports.py (run, report, --update on a sub-second gate).
  [gates]="sim/analysis/gates.py|tests/test_gate_reports.py tests/test_ordering_rules.py tests/test_gates.py::test_judge tests/test_gates.py::test_parse_tolerance tests/test_gates.py::test_parse_tolerance_rejects tests/test_gates.py::test_rewrite_changes_only_the_values"
  # The old single_type_kv_cache_manager.py, split by issue 42: the ring
  # slot spec, pool and manager (0088, 0049) against the allocator's rules
  # and the layout pass and pool plan that build slot-packed rings; Mamba
  # retention and the partial-tail hold (0086, 0087, 0093, 0094) against the
  # fork's retention tests (partial_tail below: two classes of it only).
  [side_cache_rings]="sim/fork/side_cache_rings.py|tests/test_allocator.py tests/test_ordering_rules.py tests/test_allocator_invariant_rules.py tests/test_layout.py tests/test_values_pool_plan.py tests/test_scheduler.py"
  [retention]="sim/fork/retention.py|tests/test_fork_retention.py tests/test_fork_partial_tail.py tests/test_fork_draft_group.py tests/test_fork_prompt_tail.py tests/test_fork_eviction_order.py tests/test_values_fork_mamba.py tests/test_allocator.py tests/test_allocator_invariant_rules.py"
  # The conformance gate (kvsim's scheduler and allocator step for step
  # against vLLM's own Scheduler, 12 short runs, about 6 s) runs last:
  # mutmut runs the fastest tests first.
  [kv_cache_manager]="sim/kv_cache_manager.py sim/fork/frees.py|tests/test_mtp_hashing.py tests/test_allocator.py tests/test_scheduler.py tests/test_scheduler_rules.py tests/test_ordering_rules.py tests/test_conformance.py::test_every_step_is_identical"
  [scheduler]="sim/sched/scheduler.py sim/sched/fast_path/memos.py|tests/test_scheduler.py tests/test_scheduler_rules.py tests/test_ordering_rules.py tests/test_engine_timeline.py tests/test_steady.py tests/test_conformance.py::test_every_step_is_identical tests/test_aborts.py $FAST_PATH_TESTS"
  [settled]="sim/sched/fast_path/settled.py|$FAST_PATH_TESTS tests/test_values_fast_path.py"
  # The steady lane: its hand counts, its checks that make every skipped
  # call (three shapes), the frames against step by step, the horizon and
  # conformance: about 5 s, not the 13 s of the whole file. SteadyLane holds
  # the async lane's limit, offer and audits too: the async lane's value
  # tests and its audited shapes.
  [steady]="sim/sched/fast_path/steady.py|$STEADY_TESTS tests/test_values_async.py tests/test_values_async_lane.py $ASYNC_STEADY_TESTS"
  [model_runner]="sim/sched/model_runner.py|tests/test_scheduler.py tests/test_scheduler_rules.py tests/test_ordering_rules.py tests/test_steady.py::test_the_stream_gives_the_generators_own_draws_across_blocks tests/test_steady.py::test_the_streams_acceptance_draws_are_the_rules tests/test_steady.py::test_a_steps_acceptance_draws_in_one_call_are_the_rules tests/test_steady.py::test_a_runners_acceptance_draws_are_its_per_request_draws"
  # The rest of sim/sched/: the engine core's step, the scheduler's output
  # records (what the step-time model reads; async scheduling's max_tokens
  # skip, vLLM's rule by hand), the stats records and columns.
  [engine_core]="sim/sched/engine_core.py|tests/test_values_async.py tests/test_scheduler.py tests/test_engine_timeline.py $STEADY_TESTS $ASYNC_STEADY_TESTS $ASYNC_CONFORMANCE_TESTS"
  [output]="sim/sched/output.py|tests/test_step_time.py tests/test_scheduler_rules.py tests/test_engine_timeline.py tests/test_values_async.py::test_a_step_in_flight_reaches_max_tokens_as_vllms_running_loop_counts"
  [stats]="sim/sched/stats.py|tests/test_engine_stats.py tests/test_metrics.py tests/test_engine_timeline.py"
  # tests/test_simulation.py pins the engine too but takes seconds a test.
  [engine]="sim/engine.py|tests/test_engine_timeline.py"
  # The one engine assembly (scheduler_config, allocator_options, the
  # runner's stream, each mode's parts): each argument and fork switch by
  # value in the parts it builds (both modes), the runs it builds, the
  # config's fields, the stream against its seed by hand.
  [engine_assembly]="sim/engine_assembly.py|tests/test_values_engine_assembly.py tests/test_engine_timeline.py tests/test_metrics.py tests/test_values_conformance.py::test_the_backends_sample_through_the_engines_own_rng_stream"
  # Where simulation meets measurement (issue 26): the value tests
  # (tests/test_values_*.py, hand frames and numpy, vLLM's metric
  # definitions, a fault server) and the fast tests already pinning each.
  [validate]="sim/analysis/validate.py|tests/test_values_validate.py tests/test_validate.py::test_curve_error_matches_hand_derivation tests/test_validate.py::test_a_run_that_stops_early_is_charged_for_the_rest tests/test_validate.py::test_a_missing_source_column_reads_as_the_simulator"
  # calibrate: the value tests and the fast tests of tests/test_calibrate.py;
  # the two full fits (15 s and 4 s alone, half a minute each on a shared
  # machine) are left out: each survivor would cost a minute. The fit itself
  # is pinned by the fits on a closed-form model (milliseconds).
  [calibrate]="sim/analysis/calibrate*.py|tests/test_values_calibrate.py::test_finished_times_are_ttft_and_e2e_from_arrival_of_finished_requests \
tests/test_values_calibrate.py::test_residuals_are_relative_to_the_measurement_floored_at_ten_ms \
tests/test_values_calibrate.py::test_rms_of_hand_residuals \
tests/test_values_calibrate.py::test_log_bounds_are_a_decade_each_way_within_the_fields_limits \
tests/test_values_calibrate.py::test_a_coefficient_starting_at_zero_cannot_be_fitted \
tests/test_values_calibrate.py::test_the_fit_list_must_name_something \
tests/test_values_calibrate.py::test_screening_moves_each_coefficient_ten_percent_each_way_within_its_bounds \
tests/test_values_calibrate.py::test_alike_pairs_are_parallel_or_opposite_effects_of_coefficients_that_act \
tests/test_values_calibrate.py::test_the_alike_threshold_is_a_cosine_of_095_inclusive \
tests/test_values_calibrate.py::test_a_coefficient_the_scenario_sets_is_the_start_and_the_fit_wins_over_it \
tests/test_values_calibrate.py::test_the_fit_recovers_the_closed_form_models_coefficients \
tests/test_values_calibrate.py::test_a_truth_past_the_bound_is_at_the_bound_not_fitted \
tests/test_values_calibrate.py::test_a_spent_budget_fits_nothing_it_cannot_bound \
tests/test_values_calibrate.py::test_a_replay_with_nothing_finished_cannot_be_calibrated \
tests/test_values_calibrate.py::test_the_fit_list_messages_name_every_coefficient_comma_separated \
tests/test_values_calibrate.py::test_a_sensitivity_exactly_at_the_threshold_is_fitted_and_alike_is_inclusive \
tests/test_values_calibrate.py::test_the_fit_starts_from_a_25_percent_simplex_and_leaves_fixed_coefficients_at_zero \
tests/test_values_calibrate.py::test_the_fit_stops_at_half_a_percent_where_the_error_is_flat \
tests/test_values_calibrate.py::test_the_fit_goes_on_while_the_error_moves_more_than_fatol \
tests/test_values_calibrate.py::test_log_bounds_honour_every_kind_of_pydantic_limit \
tests/test_values_calibrate.py::test_times_and_residuals_are_floats_from_object_columns \
tests/test_values_calibrate.py::test_the_rms_of_nothing_is_nan_without_a_warning \
tests/test_calibrate.py::test_a_coefficient_without_effect_is_unidentifiable \
tests/test_calibrate.py::test_screening_sees_a_coefficient_that_has_an_effect \
tests/test_calibrate.py::test_coefficients_that_act_alike_are_reported \
tests/test_calibrate.py::test_residuals_are_relative_and_count_unfinished_requests \
tests/test_calibrate.py::test_bad_fit_lists_are_one_line_errors \
tests/test_calibrate.py::test_bounds_keep_an_efficiency_at_most_one \
tests/test_calibrate.py::test_a_replay_without_its_scenario_is_a_one_line_error"
  [conformance]="sim/conformance/*|tests/test_values_conformance.py tests/test_conformance.py::test_every_step_is_identical tests/test_conformance.py::test_the_modes_differ_where_vllm_says tests/test_conformance.py::test_a_scheduler_that_cannot_be_built_gives_one_line_and_exit_2"
  [serving]="sim/serving/*|tests/test_values_replay.py tests/test_replay.py tests/test_serve.py"
  # kvsim serve split by file (issue 26 item 2), each against its value
  # tests (LiveEngine driven without HTTP, /metrics against vLLM's
  # definitions) and the few in-process server tests (127.0.0.1 only) that
  # reach what those do not: seconds a mutant, not the minute of every
  # serve test.
  [server_metrics]="sim/serving/server_metrics.py|tests/test_values_serving.py tests/test_values_replay.py::test_the_fault_servers_page_is_read_into_its_own_columns tests/test_values_replay.py::test_engines_add_up_and_a_missing_metric_is_nan tests/test_values_replay.py::test_engines_add_up_on_a_page_typed_by_the_family_name tests/test_values_replay.py::test_a_counter_without_a_type_line_is_read_by_its_total tests/test_values_replay.py::test_an_unparsable_page_is_all_nan_with_one_warning tests/test_values_replay.py::test_every_vllm_metric_kvsim_serves_has_vllms_name_type_and_help tests/test_values_replay.py::test_record_step_counts_as_vllm_defines_each_counter tests/test_values_replay.py::test_a_step_without_drafts_counts_no_draft tests/test_values_replay.py::test_gauges_are_set_each_to_its_own_value tests/test_values_replay.py::test_spec_decode_counters_of_a_request_as_vllm_counts_them"
  # (The engine's lag is pinned by tests/test_serve.py's too-slow engine:
  # add it when mutating LiveEngine.run.)
  [live_engine]="sim/serving/live_engine.py|tests/test_values_serving.py"
  # openai_requests: its value tests (vLLM's front end on the same bytes),
  # the serve tests that send bodies (vLLM's parse, budget, errors, chunk
  # shapes) and the fuzzed-field case.
  [openai_requests]="sim/serving/openai_requests.py|tests/test_values_openai_requests.py tests/test_serve.py tests/test_serve_hostile.py::test_fuzzed_fields_never_get_a_server_error"
  # server.py: its value tests (a scripted token queue, answers against
  # vLLM's shapes) and the chunked body past the app's size bound, the
  # serve tests (each well under a second) and the hostile cases that
  # reach a bound, a disconnect or the token wait; not the Ctrl-C replay
  # whose engine never aborts (6 s, the control only).
  [server]="sim/serving/server.py|tests/test_values_server.py tests/test_serve.py \
tests/test_values_openai_requests.py::test_a_chunked_body_past_16_mib_is_413 \
tests/test_serve_hostile.py::test_a_connection_past_the_cap_is_closed_and_health_returns \
tests/test_serve_hostile.py::test_requests_past_the_in_flight_bound_get_429_and_the_rest_finish \
tests/test_serve_hostile.py::test_a_request_given_no_tokens_in_time_is_aborted \
tests/test_serve_hostile.py::test_fuzzed_fields_never_get_a_server_error \
tests/test_serve_hostile.py::test_a_replay_stopped_with_ctrl_c_leaves_no_running_request_and_its_blocks_free[True] \
tests/test_serve_hostile.py::test_hostile_clients_leave_the_server_responsive_and_accounted"
  # The replay's I/O (issue 26 item 2): the value tests of
  # tests/test_values_replay_io.py (hand frames, a scripted server, the
  # fault server's stated page, SplitMix64's published outputs, a server
  # process started and stopped in a finally) and the fast replay tests.
  [recording]="sim/serving/recording.py|tests/test_values_replay_io.py $REPLAY_FAST_TESTS"
  [client]="sim/serving/client.py|tests/test_values_replay_io.py $REPLAY_FAST_TESTS"
  [launch]="sim/serving/launch.py|tests/test_values_replay_io.py tests/test_serve.py::test_boot_log_lines_are_what_launch_parses tests/test_serve.py::test_launch_command_is_the_scenario_deployment_as_vllm_reads_it tests/test_replay.py::test_a_server_that_dies_mid_run_gives_failures_whole_frames_and_incomplete"
  [loaders]="sim/workloads/loaders.py|tests/test_values_loaders.py tests/test_values_bounds.py tests/test_workloads.py tests/test_trace_interchange.py"
  # config: its value tests, the bound tables, and the bad-input cases that
  # read config files (the rest of tests/test_bad_input.py runs whole
  # commands: a minute, for nothing config.py decides).
  [config]="sim/config.py|tests/test_values_config.py tests/test_values_bounds.py tests/test_bad_input.py::test_non_utf8_scenario_names_file_and_line tests/test_bad_input.py::test_non_utf8_model_names_file_and_line tests/test_bad_input.py::test_yaml_byte_count_like_the_command_line tests/test_bad_input.py::test_absurd_pool_is_bounded_with_its_reason tests/test_bad_input.py::test_yaml_aliases_are_refused tests/test_bad_input.py::test_negative_seed_is_a_one_line_error tests/test_bad_input.py::test_missing_absolute_scenario_path_message"
  # The async conformance harness (vLLM's step_with_batch_queue against
  # kvsim's batch queue): its record-by-value tests, three gate cases (one
  # per shape, both layouts, both modes), the fenced case, the test that
  # reads vLLM's run and one control; about 10 s, not the 22 s of the file.
  [async_engine]="sim/conformance/async_engine.py|tests/test_values_async_engine.py tests/test_async_conformance.py::test_every_engine_step_is_identical[long-chunked-off-eagle-drop] tests/test_async_conformance.py::test_every_engine_step_is_identical[heavy-preemption-on-eagle-drop] tests/test_async_conformance.py::test_every_engine_step_is_identical[prefix-hits-on-lookahead] tests/test_async_conformance.py::test_every_engine_step_is_identical_with_fenced_frees[heavy-preemption] tests/test_async_conformance.py::test_the_shapes_exercise_the_async_loop tests/test_async_conformance.py::test_control_a_stagger_of_one"
  # The pool replay package: its value tests (the checks on a hand-laid
  # pool and the pure parts in milliseconds, then the whole replay's
  # controls), the replay's own tests (the full-size CUDA case skips without
  # a device) and the worker views. Split it by file with KVSIM_MUTANTS,
  # e.g. KVSIM_MUTANTS='sim.pool_replay.verify.*'.
  # The value files alone (seconds): a first pass over many mutants, whose
  # survivors then run against the whole set above.
  [pool_replay_fast]="sim/pool_replay/*|tests/test_values_pool_checks.py tests/test_values_pool_writes.py tests/test_values_pool_plan.py tests/test_values_pool_replay_parts.py tests/test_values_pool_replay.py tests/test_values_pool_views.py"
  [pool_replay]="sim/pool_replay/*|tests/test_values_pool_checks.py tests/test_values_pool_writes.py tests/test_values_pool_plan.py tests/test_values_pool_replay_parts.py tests/test_values_pool_replay.py tests/test_values_pool_views.py tests/test_worker_views.py tests/test_pool_replay.py"
  # The fork's patches 0093 and 0095-0097 (issue 26): the pins on the
  # manager and the scheduler's pin points, each against the fork's values
  # (tests/test_fork_pins.py, about 10 s), and the missed-lookup value tests
  # that read the flag a waiter's pin lookup leaves for the fast path
  # (pin_lookup_found_no_hit); the partial-tail hold and the
  # retention it extends, restricted by a third field (default mutant
  # globs, overridden by KVSIM_MUTANTS) to those two classes of their file.
  [kv_cache_pins]="sim/fork/pins.py|tests/test_fork_pins.py tests/test_values_fork_pins.py tests/test_values_fast_path.py"
  [sched_pins]="sim/fork/scheduler_pins.py|tests/test_fork_pins.py tests/test_values_fork_pins.py tests/test_values_fast_path.py"
  # The fork's fence gate and deferred-free order (0018, 0023, 0086's
  # checkpoints freed last): the allocator's rules and the fork's order and
  # fenced-victim tests; the layout pass (0088) against its own tests and
  # the deployments the fork boots.
  [frees]="sim/fork/frees.py|tests/test_fork_eviction_order.py tests/test_fork_retention.py tests/test_allocator.py tests/test_ordering_rules.py tests/test_fork_fenced_victim.py"
  [side_cache_layout]="sim/fork/side_cache_layout.py|tests/test_values_side_cache_layout.py tests/test_layout.py tests/test_fork_deployment.py"
  # The patch switches (the old sim/fork_patches.py): the fork: section's
  # defaults, upstream and single-patch overrides, and the engine assembly's
  # value tests that pass each switch into the parts it builds.
  [fork_patches]="sim/fork/patches.py|tests/test_fork_section.py tests/test_values_engine_assembly.py"
  [partial_tail]="sim/fork/retention.py|tests/test_fork_partial_tail.py tests/test_fork_retention.py tests/test_fork_draft_group.py tests/test_fork_prompt_tail.py tests/test_allocator.py tests/test_allocator_invariant_rules.py tests/test_values_fork_mamba.py|*ǁPartialTailHoldingMambaManagerǁ* *ǁRetainingMambaManagerǁ*"
  # The async engine (issue 26 item 3): the pipeline clock, the one engine
  # loop, the AsyncScheduler twin, its steady lane, the batch-queue core.
  # Hand timelines (tests/test_values_async.py) and a few async conformance
  # runs (vLLM's own step_with_batch_queue, under a second each).
  [pipeline_clock]="sim/pipeline_clock.py|tests/test_values_async.py tests/test_async_engine.py"
  [engine_loop]="sim/sched/engine_loop.py|tests/test_values_async.py tests/test_engine_timeline.py tests/test_async_engine.py $ASYNC_CONFORMANCE_TESTS"
  [async_scheduler]="sim/sched/async_scheduler.py|tests/test_values_async.py $ASYNC_CONFORMANCE_TESTS"
  [async_steady]="sim/sched/fast_path/async_steady.py|tests/test_values_async.py tests/test_values_async_lane.py $ASYNC_STEADY_TESTS $ASYNC_CONFORMANCE_TESTS"
  # The fast path's own file: its settled-call, lane and pin-lookup sets, and
  # the waiting memo's hand cases with the audit's failing control (rules 3-4).
  [fast_path]="sim/sched/fast_path/memos.py sim/sched/fast_path/kv_cache_manager.py|$FAST_PATH_TESTS $STEADY_TESTS $ASYNC_STEADY_TESTS $MISSED_LOOKUP_TESTS \
tests/test_steady.py::test_the_waiting_memo_holds_only_for_the_same_inputs_and_allocator \
tests/test_steady.py::test_the_waiting_memo_keeps_idle_loops_of_other_inputs_while_the_allocator_stays \
tests/test_steady.py::test_an_arrival_voids_the_waiting_memo \
tests/test_steady.py::test_the_check_catches_a_waiting_loop_wrongly_skipped"
  [missed_lookups]="sim/sched/fast_path/missed_lookups.py|$MISSED_LOOKUP_TESTS"
  # The waiting queue's change count (rule 11) and the pin pass's walk of
  # it, apart from the scheduler's whole set; restricted by default to them.
  [waiting_queue]="sim/sched/fast_path/waiting_queue.py sim/sched/scheduler.py|$MISSED_LOOKUP_TESTS tests/test_aborts.py tests/test_scheduler.py|*WaitingQueue* *__counted__* *ǁ_waiting_requests__*"
  # Issue 41: the two modules no run had reached. The scenario record (the
  # two functions of sim/scenario.py a results directory is written and
  # read with) against its value file and the round trip's refusals; the
  # sessions workload against its value file and the workload tests of
  # tests/test_sessions.py (the simulations there take seconds each).
  [scenario_record]="sim/scenario.py|tests/test_values_scenario_record.py tests/test_roundtrip.py::test_a_record_changed_by_hand_is_refused_naming_the_key tests/test_roundtrip.py::test_the_record_of_a_trace_scenario_names_the_synthetic_defaults|*scenario_to_dict* *scenario_from_record*"
  [sessions]="sim/workloads/sessions.py|tests/test_values_sessions.py tests/test_sessions.py::test_turn_n_prompt_is_the_prefix_plus_the_history_so_far tests/test_sessions.py::test_every_turn_is_a_token_prefix_of_the_next_and_sessions_share_only_the_prefix tests/test_sessions.py::test_the_workload_is_deterministic_per_seed"
  [bench]="sim/bench.py|$BENCH_TESTS|*target_lines* *_target_line* *AllocatorTimer* *_allocator_shares* *step_cost_ratios* *x__measure__*"
)
ORDER=(engine engine_assembly scheduler settled steady engine_core pipeline_clock engine_loop async_scheduler async_steady fast_path missed_lookups output stats gates kv_cache_manager step_time allocator_invariants model_runner side_cache_rings retention validate calibrate conformance serving server_metrics live_engine server openai_requests recording client launch loaders config async_engine pool_replay kv_cache_pins sched_pins frees side_cache_layout fork_patches partial_tail waiting_queue bench scenario_record sessions)

toml_list() { printf '"%s", ' "$@" | sed 's/, $//'; }

mutate_one() {
  local name=$1 entry=${MODULES[$1]:?unknown module $1 (known: ${ORDER[*]})}
  local source=${entry%%|*} rest=${entry#*|}
  local tests=${rest%%|*} globs=()
  # A third field names the module's default mutants (KVSIM_MUTANTS wins).
  if ((${#only_mutants[@]})); then
    globs=("${only_mutants[@]}")
  elif [[ $rest == *"|"* ]]; then
    read -r -a globs <<<"${rest#*|}"
  fi
  local copy="$work/$name"
  rm -rf "$copy" && mkdir -p "$copy"
  # Tracked and new (not ignored) files only: no results/, no .venv.
  (cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$copy")
  # This module's section replaces the whole-set one.
  awk '/^\[tool\.mutmut\]/{skip=1; next} /^\[/{skip=0} !skip' "$root/pyproject.toml" >"$copy/pyproject.toml"
  # shellcheck disable=SC2086
  cat >>"$copy/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["sim"]
only_mutate = [$(set -f; toml_list $source)]
pytest_add_cli_args_test_selection = [$(toml_list $tests)]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-x"]
also_copy = ["tests", "scenarios", "README.md", "docs"]
TOML
  echo "== $name: $source against $tests${globs[*]:+ (mutants: ${globs[*]})}"
  (cd "$copy" && "$venv/bin/mutmut" run "${children[@]}" "${globs[@]}" >run.log 2>&1 || true
   "$venv/bin/mutmut" results --all true >results.txt 2>&1 || true
   summarise "$name" results.txt)
}

summarise() {
  local name=$1 results=$2
  local killed survived other
  killed=$(grep -c ': killed$' "$results" || true)
  survived=$(grep -c ': survived$' "$results" || true)
  other=$(grep -vc ': killed$\|: survived$' "$results" || true)
  echo "$name: killed $killed, survived $survived, other $other"
  grep ': survived$' "$results" | sed 's/^/  survived: /' || true
}

for name in "${@:-${ORDER[@]}}"; do
  mutate_one "$name"
done
