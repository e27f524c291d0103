#!/usr/bin/env bash
# Re-record the golden frames (tests/data/fork-golden/): the fork's own
# Scheduler's steps on the fork-conformance shapes, both layouts.
#
#   scripts/record-fork-golden.sh FORK
#
# FORK: a checkout of halt95/qwen38-flash-next-3090s or its combined diff
# (release/v2.5/v2.5.1-combined.diff). The fork's environment is built once,
# outside the repository (KVSIM_FORK_CACHE, default ~/.cache/kvsim/fork).
# Each recording also checks kvsim against the fork; a difference stops the
# script (exit 1) with the first differing step.
set -euo pipefail
fork="${1:?usage: scripts/record-fork-golden.sh FORK (checkout or combined diff)}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=tests/data/fork-golden

record() {  # NAME SCENARIO LAYOUT [--set ...]
  local name=$1 scenario=$2 layout=$3
  shift 3
  ./kvsim conform "$scenario" --fork "$fork" --layout "$layout" "$@" --record "$out/$name-$layout.jsonl.gz"
}

for layout in on off; do
  # The rig's v2.5.1 settings, the pool binding: pins, graces, retention.
  record fork-mooncake scenarios/conformance/fork-mooncake.yaml "$layout"
  # The agent bench's sessions, closed loop: sub-block hits, 0093's holds.
  record agent-sessions-150s scenarios/agent-sessions.yaml "$layout" --set workload.sessions.duration_s=150
  # The upstream conformance shapes in fork mode: preemption and resumes,
  # chunked prompts under the long-prefill threshold, block-sized hits.
  record heavy-preemption scenarios/conformance/heavy-preemption.yaml "$layout" --set fork.base=fork
  record long-chunked scenarios/conformance/long-chunked.yaml "$layout" --set fork.base=fork
  record prefix-hits scenarios/conformance/prefix-hits.yaml "$layout"
done
record fork-mooncake-8seqs scenarios/conformance/fork-mooncake.yaml on --set deployment.max_num_seqs=8
# The rig's engine: the fork's batch queue (pp + 1 micro-batches, every
# free fenced behind the steps in flight: 0018, 0023, 0096's deferred path).
for layout in on off; do
  record agent-sessions-150s-async scenarios/agent-sessions.yaml "$layout" --engine async \
    --set workload.sessions.duration_s=150
done
record heavy-preemption-async scenarios/conformance/heavy-preemption.yaml on --engine async --set fork.base=fork
# Prefix caching off: the fork retains no checkpoint (and reserves none).
record heavy-preemption-nocache scenarios/conformance/heavy-preemption.yaml on \
  --set fork.base=fork --set allocator.enable_prefix_caching=false
# v2.5.0 as the card ran it (the fork's v2.5.1 code with 0093-0097 off: a
# 4,096-token match unit, no waiter pins), the whole agent bench, seed 1:
# the fork's own scheduler preempts one deep follow-up 12 times near the end
# (docs/agent-bench.md, "v2.5.0's preemptions").
record agent-sessions-v250-seed1-async scenarios/agent-sessions.yaml on --engine async --set seed=1 \
  --set deployment.prefix_match_unit=4096 --set fork.mamba_hold_partial_tail=false \
  --set fork.waiter_pins=false --set fork.grace_pins=false
