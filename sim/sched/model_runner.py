"""A stand-in for the GPU workers: it samples how many MTP drafts each step
accepts. No twin in vLLM (the real workers run the model); this is the only
place kvsim draws random numbers during a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.sched.output import ModelRunnerOutput, SchedulerOutput

# Sampled output tokens are ids far from any prompt token: outputs then never
# fake a prefix match with another request's prompt.
OUTPUT_TOKEN_BASE = 1 << 50


@dataclass(frozen=True, kw_only=True)
class AcceptanceModel:
    """MTP draft acceptance with per-position conditional rates: draft ``i``
    is accepted with probability ``conditional_rates[i]`` given drafts
    ``0..i-1`` were, and verification stops at the first rejection.

    >>> AcceptanceModel(conditional_rates=(0.8, 0.5, 0.5)).mean_accepted(3)
    1.4
    """

    conditional_rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if any(not 0.0 <= rate <= 1.0 for rate in self.conditional_rates):
            raise ValueError(f"conditional_rates must lie in [0, 1]: {self.conditional_rates}")

    def rate(self, position: int) -> float:
        if position < len(self.conditional_rates):
            return self.conditional_rates[position]
        return self.conditional_rates[-1] if self.conditional_rates else 0.0

    def sample(self, num_drafts: int, rng: np.random.Generator) -> int:
        """Accepted drafts out of ``num_drafts``."""
        accepted = 0
        while accepted < num_drafts and rng.random() < self.rate(accepted):
            accepted += 1
        return accepted

    def mean_accepted(self, num_drafts: int) -> float:
        """Expected accepted drafts: the sum of the prefix products."""
        total, survive = 0.0, 1.0
        for position in range(num_drafts):
            survive *= self.rate(position)
            total += survive
        return round(total, 12)


class ModelRunner:
    """Executes a step: each request that reached the end of its known tokens
    samples one token plus its accepted drafts."""

    def __init__(self, acceptance: AcceptanceModel, rng: np.random.Generator) -> None:
        self.acceptance = acceptance
        self.rng = rng

    def execute(self, output: SchedulerOutput, num_tokens: dict[str, int]) -> ModelRunnerOutput:
        """``num_tokens``: each scheduled request's token count (prompt plus
        outputs, drafts excluded) when the step was scheduled."""
        sampled: dict[str, list[int]] = {}
        for item in output.scheduled:
            reached = item.num_computed_tokens + item.num_scheduled_tokens - item.num_spec_tokens
            if reached < num_tokens[item.request_id]:
                continue  # a prefill chunk short of the prompt's end
            # Placeholder drafts (uniform-decode padding) are never accepted.
            accepted = 0 if item.is_padded else self.acceptance.sample(item.num_spec_tokens, self.rng)
            position = num_tokens[item.request_id]
            sampled[item.request_id] = [OUTPUT_TOKEN_BASE + position + i for i in range(accepted + 1)]
        return ModelRunnerOutput(sampled_token_ids=sampled)
