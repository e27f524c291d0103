"""The pool replay's pure parts, value by value: the fingerprint words and
what a found word says, where the pool lives and how many bytes it may
take, and the report's rows. Expected values are derived by hand from the
bit layout in ``sim/pool_replay/fingerprints.py``'s header and the rules
in docs/pool-replay.md (a quarter of the RAM on the CPU, the free memory on
CUDA); the devices are faked, so no test needs CUDA."""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from sim.config import ConfigError
from sim.pool_replay import devices
from sim.pool_replay.devices import device_memory_bytes, pool_bytes_for, resolve_device
from sim.pool_replay.fingerprints import describe_word, fingerprint
from sim.pool_replay.report import PoolReplayReport, ReplayStep

NAMES = {7: "r000006", 1: "r000000"}


def word(group: int, label: int, number: int, position: int) -> int:
    """A written word by hand: bits 56.. group + 1, 48.. label + 1, 24.. the
    request number, 0.. the position."""
    return ((group + 1) << 56) | ((label + 1) << 48) | (number << 24) | position


# ---------------------------------------------------------------- fingerprints
def test_a_fingerprint_is_the_request_number_above_24_position_bits():
    assert fingerprint(3, 5) == 3 * 2**24 + 5
    assert fingerprint(1, 2**24 - 1) == 2**25 - 1
    assert list(fingerprint(2, torch.tensor([0, 1]).numpy())) == [2**25, 2**25 + 1]


@pytest.mark.parametrize(
    ("found", "said"),
    [
        (0, "zeros"),
        (word(2, 5, 7, 9), "request r000006's fingerprint (group 2, layer label 5, position 9)"),
        # The lowest group and label fields (0 + 1) are still fingerprints.
        (word(0, 0, 1, 0), "request r000000's fingerprint (group 0, layer label 0, position 0)"),
        # The highest label (254 + 1) and position (2**24 - 1).
        (
            word(3, 254, 7, 2**24 - 1),
            "request r000006's fingerprint (group 3, layer label 254, position 16777215)",
        ),
        # A group field of 0 or a label field of 0: no writer's tag.
        (word(-1, 5, 7, 9), "bytes that are no fingerprint (0x0006000007000009)"),
        (word(2, -1, 7, 9), "bytes that are no fingerprint (0x0300000007000009)"),
        # A request number nobody was given.
        (word(2, 5, 8, 9), "bytes that are no fingerprint (0x0306000008000009)"),
        # A negative word (top bit set) is shown as its 64 unsigned bits.
        (-1, "bytes that are no fingerprint (0xffffffffffffffff)"),
        (-(2**63), "bytes that are no fingerprint (0x8000000000000000)"),
    ],
)
def test_a_found_word_names_its_writer_or_says_it_is_no_fingerprint(found, said):
    assert describe_word(found, NAMES) == said


def test_a_request_number_is_read_from_24_bits_only():
    """Bits above the request number's 24 belong to the label: a label of
    1 does not make request 7 into request 7 + 2**24."""
    names = {7: "r000006", 7 + 2**24: "wrong"}
    assert describe_word(word(0, 0, 7, 0), names).startswith("request r000006's")


# ---------------------------------------------------------------- devices
def test_available_ram_is_psutils_available_bytes(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=123_456.0, total=9))
    assert devices.available_ram_bytes() == 123_456
    assert type(devices.available_ram_bytes()) is int


def test_without_psutil_available_ram_is_free_pages_times_page_size(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    sizes = {"SC_AVPHYS_PAGES": 7, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name])
    assert devices.available_ram_bytes() == 7 * 4096


@pytest.mark.parametrize("name", ["cpu", "cpu:0"])
def test_the_cpu_is_always_a_device(name):
    assert resolve_device(name) == torch.device(name)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tpu", "--device tpu: not a device the replay can use (cpu, cuda or cuda:N)"),
        ("mps:0", "--device mps:0: not a device the replay can use (cpu, cuda or cuda:N)"),
        ("cuda:x", "--device cuda:x: not a torch device name"),
        ("cpu:-1", "--device cpu:-1: not a torch device name"),
    ],
)
def test_a_name_that_is_no_device_is_one_line(name, message):
    with pytest.raises(ConfigError) as caught:
        resolve_device(name)
    assert str(caught.value) == message


def fake_cuda(monkeypatch, *, available: bool, count: int = 0, built: str | None = "12.1") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.version, "cuda", built)


@pytest.mark.parametrize(
    ("built", "why"),
    [(None, f"torch {torch.__version__}, built without CUDA"), ("12.1", f"torch {torch.__version__}")],
)
def test_cuda_with_none_visible_says_how_torch_was_built(monkeypatch, built, why):
    fake_cuda(monkeypatch, available=False, built=built)
    with pytest.raises(ConfigError) as caught:
        resolve_device("cuda")
    assert str(caught.value) == f"--device cuda: no CUDA device is visible to torch ({why})"


def test_a_cuda_index_must_be_below_the_device_count(monkeypatch):
    fake_cuda(monkeypatch, available=True, count=2)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError) as caught:
        resolve_device("cuda:2")
    assert str(caught.value) == "--device cuda:2: only 2 CUDA device(s) here"


def test_a_cuda_pool_may_take_the_devices_free_memory(monkeypatch):
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 1_000, 5_000_000

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    device = torch.device("cuda:1")
    assert device_memory_bytes(device) == (1_000, "free memory of cuda:1 (5,000,000 B in all)")
    assert asked == [device]


def test_a_cpu_pool_may_take_a_quarter_of_the_available_ram(monkeypatch):
    monkeypatch.setattr(devices, "available_ram_bytes", lambda: 4_003)
    bound, why = device_memory_bytes(torch.device("cpu"))
    assert bound == 1_000 and type(bound) is int  # floor(4003 / 4)
    assert why == "a quarter of the 4,003 B of available RAM"


@pytest.fixture
def bound_1000(monkeypatch):
    monkeypatch.setattr(devices, "device_memory_bytes", lambda device: (1_000, "the bound's reason"))


CPU, CUDA = torch.device("cpu"), torch.device("cuda:0")


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_a_requested_pool_is_taken_up_to_the_bound_inclusive(bound_1000, device):
    assert pool_bytes_for(device, 1_000, pinned=10**12) == (1_000, None)
    assert pool_bytes_for(device, 1, pinned=10**12) == (1, None)
    with pytest.raises(ConfigError) as caught:
        pool_bytes_for(device, 1_001, pinned=1)
    assert str(caught.value) == (
        f"--pool-bytes 1,001: more than the 1,000 B the {device} allows (the bound's reason)"
    )


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_the_scenarios_pin_is_taken_up_to_the_bound_inclusive(bound_1000, device):
    assert pool_bytes_for(device, None, pinned=1_000) == (1_000, None)
    assert pool_bytes_for(device, None, pinned=999) == (999, None)


def test_a_pin_over_the_cpu_bound_is_capped_with_a_note(bound_1000):
    assert pool_bytes_for(CPU, None, pinned=1_001) == (
        1_000,
        "pool capped at 1,000 B on the cpu (the bound's reason); the scenario pins 1,001 B",
    )


def test_a_pin_over_the_cuda_bound_is_an_error(bound_1000):
    with pytest.raises(ConfigError) as caught:
        pool_bytes_for(CUDA, None, pinned=1_001)
    assert str(caught.value) == "the scenario's pool (1,001 B) exceeds the 1,000 B free on cuda:0"


# ---------------------------------------------------------------- the report
def report(steps: list[ReplayStep], replay_s: float = 2.0, wall_s: float = 4.0) -> PoolReplayReport:
    return PoolReplayReport(
        scenario="s",
        layout="on",
        rank=0,
        device="cpu",
        num_blocks=1,
        block_stride_bytes=8,
        pool_bytes=8,
        steps=steps,
        counts={},
        wall_s=wall_s,
        replay_s=replay_s,
    )


def test_a_step_starts_with_nothing_written_or_verified():
    step = ReplayStep(step=3, time_s=0.5)
    assert (step.bytes_written, step.bytes_verified, step.replay_s) == (0, 0, 0.0)


def test_each_rows_rate_is_its_bytes_moved_over_its_replay_time():
    steps = [
        ReplayStep(step=1, time_s=0.5, bytes_written=3e9, bytes_verified=1e9, replay_s=2.0),
        ReplayStep(step=2, time_s=0.75, bytes_written=8, bytes_verified=0, replay_s=0.0),
    ]
    assert report(steps).step_rows() == [
        {"step": 1, "time_s": 0.5, "bytes_written": 3e9, "bytes_verified": 1e9, "gb_per_s": 2.0},
        # No replay time measured: a rate of 0, not a division by zero.
        {"step": 2, "time_s": 0.75, "bytes_written": 8, "bytes_verified": 0, "gb_per_s": 0.0},
    ]


def test_the_runs_totals_and_rates():
    steps = [
        ReplayStep(step=1, time_s=0.0, bytes_written=3e9, bytes_verified=1e9),
        ReplayStep(step=2, time_s=0.0, bytes_written=1e9, bytes_verified=3e9),
    ]
    run = report(steps, replay_s=4.0, wall_s=4.0)
    assert (run.bytes_written, run.bytes_verified) == (4e9, 4e9)
    assert run.gb_per_s == 2.0 and run.steps_per_s == 0.5
    assert math.isnan(report(steps, replay_s=0.0).gb_per_s)
    assert math.isnan(report(steps, wall_s=0.0).steps_per_s)
