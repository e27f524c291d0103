"""Where kvsim finds what it ships: scenarios, the default model and trace."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = PACKAGE_DIR.parent
SCENARIOS_DIR = PROJECT_ROOT / "scenarios"
DATA_DIR = PACKAGE_DIR / "data"
DEFAULT_MODEL = SCENARIOS_DIR / "models" / "flash-next.yaml"
DEFAULT_GATES = SCENARIOS_DIR / "gates.yaml"
