"""What a pool replay wrote and verified, step by step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.scenario import SideCacheSwitch


@dataclass
class ReplayStep:
    step: int
    time_s: float
    bytes_written: int = 0
    bytes_verified: int = 0
    replay_s: float = 0.0


@dataclass
class PoolReplayReport:
    """What a replay wrote and verified."""

    scenario: str
    layout: SideCacheSwitch
    rank: int
    device: str
    num_blocks: int
    block_stride_bytes: int
    pool_bytes: int
    steps: list[ReplayStep]
    counts: dict[str, int]
    wall_s: float
    replay_s: float

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written for s in self.steps)

    @property
    def bytes_verified(self) -> int:
        return sum(s.bytes_verified for s in self.steps)

    @property
    def gb_per_s(self) -> float:
        moved = self.bytes_written + self.bytes_verified
        return moved / self.replay_s / 1e9 if self.replay_s else float("nan")

    @property
    def steps_per_s(self) -> float:
        return len(self.steps) / self.wall_s if self.wall_s else float("nan")

    def step_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "step": s.step,
                "time_s": s.time_s,
                "bytes_written": s.bytes_written,
                "bytes_verified": s.bytes_verified,
                "gb_per_s": (s.bytes_written + s.bytes_verified) / s.replay_s / 1e9 if s.replay_s else 0.0,
            }
            for s in self.steps
        ]
