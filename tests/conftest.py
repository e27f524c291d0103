"""Shared fixtures: the shipped Flash-Next model and the reference deployment."""

from __future__ import annotations

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
