"""Shared fixtures: the shipped Flash-Next model, the reference deployment,
and Python's own Ctrl-C handling for tests that start children."""

from __future__ import annotations

import signal

import pytest

from sim.config import DeploymentConfig, ModelConfig, load_model
from sim.paths import DEFAULT_MODEL


@pytest.fixture(scope="session")
def flash_next() -> ModelConfig:
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def reference() -> DeploymentConfig:
    """TP2 x PP2, 25/23, 4.1e9 B per rank, 262,144 tokens, 8 sequences."""
    return DeploymentConfig()


@pytest.fixture(scope="session")
def default_run_checked():
    """The shipped default scenario under both layouts, with the allocator
    invariants checked after every step (checking changes no state, so the
    frames are those of ``kvsim compare``). Run once per session and shared:
    it is the suite's most expensive simulation (~35 s unchecked)."""
    from sim.analysis.runs import run_scenario
    from sim.scenario import load_scenario

    return run_scenario(load_scenario("chat-slice", ["simulation.check_invariants=true"]))


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handling (its handler, SIGINT unblocked), whatever
    earlier tests in this process left; restored afterwards. A child started
    meanwhile inherits SIGINT unblocked and not ignored (a blocked mask and
    an ignored signal both survive ``exec``), as from a terminal's shell."""
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    signal.signal(signal.SIGINT, previous_handler)
