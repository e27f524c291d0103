"""Pool replay (``kvsim replay-pool``): the simulated block tables written into
one rank's real torch pool, every page checked against its owner.

The CPU runs use tests/data/pool-replay.yaml (tiny Flash-Next states,
32-token blocks, a 93-block pool): preemption, prefix hits and, in the new
layout, several requests' rings in one pool block. Each of the four
corruptions the layout could suffer is injected (a monkeypatched allocator,
scheduler or view binding) and must be reported naming the step, the
request, the group and the byte range.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sim.analysis.runs import scenario_workload
from sim.cli import main
from sim.fork.side_cache_rings import RingSlotPool
from sim.pool_replay import PoolCorruption, PoolReplay, replay_pool, with_pool_bytes
from sim.pool_replay.views import WorkerViews, allocate_worker_views
from sim.scenario import load_scenario
from sim.sched.scheduler import Scheduler
from sim.vllm_bridge import KVCacheBlock

DATA = Path(__file__).parent / "data"
SMALL = DATA / "pool-replay.yaml"
FULL = DATA / "pool-replay-full.yaml"
PLE = "language_model.model.layers.2.ple"
RING_GROUP = 3  # the packed ring group of the new layout (both stages)
# What every corruption message carries: where, who, which group, which bytes.
NAMED = re.compile(r"^step \d+: request r\d+, group \d+, layer \S+, bytes \[\d+, \d+\): ")


@pytest.fixture(scope="module")
def small():
    scenario = load_scenario(str(SMALL))
    return scenario, scenario_workload(scenario)


def replay(small, layout="on", **kwargs):
    scenario, workload = small
    return replay_pool(scenario, layout, workload, **kwargs)


# ---------------------------------------------------------------------------
# Clean runs.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["off", "on"])
def test_a_small_pool_replays_clean(small, layout):
    report = replay(small, layout)
    counts = report.counts
    # The scenario exercises what the layout must survive.
    assert counts["num_preemptions"] > 0
    assert counts["prefix_hit_tokens"] > 0 and counts["prefix_hits_verified"] > 0
    # Every request is freed once per admission (finish or preemption), and
    # every free is verified.
    assert counts["frees_verified"] == counts["num_requests"] + counts["num_preemptions"]
    assert counts["fences_verified"] > 0
    # One ring claim per admission, each zeroed.
    assert counts["ring_slots_zeroed"] == counts["frees_verified"]
    if layout == "on":
        assert counts["max_ring_slots_sharing_a_block"] > 1
    else:
        assert counts["max_ring_slots_sharing_a_block"] == 0  # no packed group
    # The pool is the planner's: 12 MB over the larger stage stride.
    assert report.num_blocks == 12_000_000 // 129_024
    assert report.bytes_written > 0 and report.bytes_verified > report.bytes_written
    assert len(report.steps) > 50


# ---------------------------------------------------------------------------
# The four corruptions (FAILING CONTROLS).
# ---------------------------------------------------------------------------
def test_two_requests_given_one_ring_slot_are_caught(small, monkeypatch):
    """The slot pool hands the second claim of a page the first claim's slot."""
    claim = RingSlotPool._claim_slot

    def claim_a_taken_slot(self):
        block = claim(self)
        if block.block_id % self.slots_per_block == 1:
            return KVCacheBlock(block.block_id - 1, ref_cnt=1, pool=self)
        return block

    monkeypatch.setattr(RingSlotPool, "_claim_slot", claim_a_taken_slot)
    with pytest.raises(PoolCorruption) as caught:
        replay(small)
    message = str(caught.value)
    assert NAMED.match(message), message
    assert f"group {RING_GROUP}," in message and "is held by 2 requests" in message


def shifted_ring_views(plan, rank, **kwargs) -> WorkerViews:
    """Every ring layer's view shifted by one slot (one view block shorter,
    so the last slot of the pool stays inside the buffer)."""
    views = allocate_worker_views(plan, rank, **kwargs)
    shifted = dict(views.views)
    for name, view in views.views.items():
        if name.endswith("raw_key_cache"):
            assert isinstance(view, torch.Tensor)
            shape = (view.shape[0] - 1, *view.shape[1:])
            shifted[name] = view.as_strided(shape, view.stride(), view.storage_offset() + view.stride(0))
    return replace(views, views=shifted)


def test_a_slot_view_shifted_by_one_slot_is_caught(small):
    with pytest.raises(PoolCorruption) as caught:
        replay(small, bind=shifted_ring_views)
    message = str(caught.value)
    assert NAMED.match(message), message
    assert f"group {RING_GROUP}," in message and "lies outside slot" in message


def misplaced_ple_views(plan, rank, **kwargs) -> WorkerViews:
    """The folded PLE page placed where its own group put it in the old
    layout (page 0 of the block), on top of its GDN group's first page."""
    views = allocate_worker_views(plan, rank, **kwargs)
    states = views.views[PLE]
    assert isinstance(states, tuple)
    page_offset = min(s.storage_offset() * s.element_size() for s in states)
    moved = tuple(
        s.as_strided(s.shape, s.stride(), s.storage_offset() - page_offset // s.element_size())
        for s in states
    )
    return replace(views, views={**views.views, PLE: moved})


def test_a_folded_page_sized_for_the_wrong_group_is_caught(small):
    with pytest.raises(PoolCorruption) as caught:
        replay(small, bind=misplaced_ple_views)
    message = str(caught.value)
    assert NAMED.match(message), message
    # A GDN layer's page of the PLE's group reads back the PLE's fingerprint.
    assert "linear_attn" in message and "right after the write" in message
    assert re.search(r"found request r\d+'s fingerprint \(group 1, layer label 24,", message), message


def test_a_block_reused_before_its_fenced_free_drains_is_caught(small, monkeypatch):
    """The scheduler frees at once what it should fence."""
    monkeypatch.setattr(
        Scheduler, "_free_request_blocks", lambda self, request: self.kv_cache_manager.free(request)
    )
    with pytest.raises(PoolCorruption) as caught:
        replay(small, layout="off")
    message = str(caught.value)
    assert NAMED.match(message), message
    assert "fenced until step seq" in message


def test_the_fenced_pages_themselves_show_the_reuse(small, monkeypatch):
    """The same broken scheduler with the replay's write-time fence check
    off: the bytes catch it when the fence passes, the old owner's pages
    holding the new owner's fingerprint."""
    monkeypatch.setattr(
        Scheduler, "_free_request_blocks", lambda self, request: self.kv_cache_manager.free(request)
    )
    check = PoolReplay._check_ownership

    def without_the_fence_check(self, *args):
        fenced, self.fenced = self.fenced, {}
        try:
            check(self, *args)
        finally:
            self.fenced = fenced

    monkeypatch.setattr(PoolReplay, "_check_ownership", without_the_fence_check)
    with pytest.raises(PoolCorruption) as caught:
        replay(small, layout="off")
    message = str(caught.value)
    assert NAMED.match(message), message
    assert re.search(
        r"when the fence of r\d+ \(freed at step \d+\) passes: expected its position \d+, "
        r"found request r\d+'s fingerprint",
        message,
    ), message


# ---------------------------------------------------------------------------
# Full size on a CUDA device.
# ---------------------------------------------------------------------------
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA device visible to torch {torch.__version__}: the full-size replay "
    "(4.1e9 B per rank) runs on the rig (docs/pool-replay.md)",
)
@pytest.mark.parametrize("layout", ["off", "on"])
def test_the_full_pool_replays_clean_on_cuda(layout):
    scenario = with_pool_bytes(load_scenario(str(FULL)), 4_100_000_000)
    report = replay_pool(scenario, layout, scenario_workload(scenario), rank=2, device=torch.device("cuda"))
    assert report.num_blocks == 317 and report.pool_bytes == 317 * 12_902_400
    assert report.counts["prefix_hits_verified"] > 0


# ---------------------------------------------------------------------------
# Bad input: one line, exit 2.
# ---------------------------------------------------------------------------
def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvsim: error: ") and "\n" not in err, err
    return err


def test_a_device_that_does_not_exist_is_an_error(capsys):
    err = _one_line_error(capsys, ["replay-pool", str(SMALL), "--device", "tpu"])
    assert "--device tpu" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present here")
def test_cuda_without_a_cuda_device_is_an_error(capsys):
    err = _one_line_error(capsys, ["replay-pool", str(SMALL), "--device", "cuda"])
    assert "no CUDA device" in err


def test_a_pool_larger_than_memory_is_an_error(capsys):
    err = _one_line_error(capsys, ["replay-pool", str(SMALL), "--pool-bytes", "1e15"])
    assert "--pool-bytes 1,000,000,000,000,000" in err and "available RAM" in err


def test_a_rank_the_deployment_lacks_is_an_error(capsys):
    err = _one_line_error(capsys, ["replay-pool", str(SMALL), "--rank", "4"])
    assert "--rank 4: the deployment has ranks 0..3" in err


def test_the_cli_prints_bytes_and_speed(capsys):
    argv = ["replay-pool", str(SMALL), "--layout", "on", "--set", "workload.num_requests=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "verified clean:" in out and "GB/s" in out and "steps/s" in out
    assert re.search(r"^\s+1\s+[\d.]+\s+[\d,]+\s+[\d,]+\s+[\d.]+$", out, re.MULTILINE), out
