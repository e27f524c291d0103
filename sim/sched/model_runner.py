"""A stand-in for the GPU workers: it samples how many MTP drafts each step
accepts. No twin in vLLM (the real workers run the model); this is the only
place kvsim draws random numbers during a simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np

from sim.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

# Sampled output tokens are ids far from any prompt token: outputs then never
# fake a prefix match with another request's prompt.
OUTPUT_TOKEN_BASE = 1 << 50


class Uniforms(Protocol):
    """Uniform draws in [0, 1) (a numpy ``Generator`` is one)."""

    def random(self) -> float: ...


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

    def sample(self, num_drafts: int, rng: Uniforms) -> int:
        """Accepted drafts out of ``num_drafts``."""
        return accepted_drafts(self.rates(num_drafts), rng)

    def rates(self, num_drafts: int) -> tuple[float, ...]:
        """The rates of draft positions ``0 .. num_drafts - 1``."""
        return tuple(self.rate(position) for position in range(num_drafts))

    def mean_accepted(self, num_drafts: int) -> float:
        """Expected accepted drafts: the sum of the prefix products."""
        total, survive = 0.0, 1.0
        for position in range(num_drafts):
            survive *= self.rate(position)
            total += survive
        return round(total, 12)


def accepted_drafts(rates: tuple[float, ...], rng: Uniforms) -> int:
    """Drafts accepted when draft ``i`` passes with probability ``rates[i]``
    given the drafts before it did; verification stops at the first reject."""
    for position, rate in enumerate(rates):
        if rng.random() >= rate:
            return position
    return len(rates)


class UniformStream:
    """The generator's uniforms, drawn a block at a time: the same numbers in
    the same order as one ``rng.random()`` per draw (numpy fills a block
    from the same stream), without a numpy call per draw."""

    BLOCK = 4096

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self._block: list[float] = []
        self._next = 0

    def random(self) -> float:
        if self._next == len(self._block):
            self._refill()
        value = self._block[self._next]
        self._next += 1
        return value

    def accepted_drafts(self, rates: tuple[float, ...]) -> int:
        """``accepted_drafts(rates, self)``, the same draws, without a call
        per draw (it runs for every decode of every step)."""
        return self.accepted_drafts_each((rates,))[0]

    def accepted_drafts_each(self, rates_each: Sequence[tuple[float, ...]]) -> list[int]:
        """``accepted_drafts`` for each rate tuple in turn, in one call (a
        step's requests): the same draws in the same order."""
        block, index = self._block, self._next
        end = len(block)
        accepted = []
        for rates in rates_each:
            count = len(rates)
            for position, rate in enumerate(rates):
                if index == end:
                    block, index = self._refill(), 0
                    end = len(block)
                value = block[index]
                index += 1
                if value >= rate:
                    count = position
                    break
            accepted.append(count)
        self._next = index
        return accepted

    def _refill(self) -> list[float]:
        self._block = self.rng.random(self.BLOCK).tolist()
        self._next = 0
        return self._block


class ModelRunner:
    """Executes a step: each request that reached the end of its known tokens
    samples one token plus its accepted drafts."""

    def __init__(self, acceptance: AcceptanceModel, rng: np.random.Generator) -> None:
        self.acceptance = acceptance
        self.uniforms = UniformStream(rng)
        # Each step draws with the same few rate tuples: build each once.
        self._rates: dict[int, tuple[float, ...]] = {}

    def num_accepted(self, num_drafts: int) -> int:
        """One request's accepted drafts this step, from the runner's stream."""
        return self.uniforms.accepted_drafts(self._rates_of(num_drafts))

    def acceptance_draws(self, num_drafts: int) -> Callable[[], int]:
        """``num_accepted(num_drafts)`` as a call without arguments, for a
        loop over a step's requests (the same draws from the same stream)."""
        return partial(self.uniforms.accepted_drafts, self._rates_of(num_drafts))

    def _rates_of(self, num_drafts: int) -> tuple[float, ...]:
        rates = self._rates.get(num_drafts)
        if rates is None:
            rates = self._rates[num_drafts] = self.acceptance.rates(num_drafts)
        return rates

    @staticmethod
    def sampled_token_ids(position: int, count: int) -> list[int]:
        """The ids of ``count`` tokens sampled from ``position`` on."""
        return list(range(OUTPUT_TOKEN_BASE + position, OUTPUT_TOKEN_BASE + position + count))

    def execute(self, output: SchedulerOutput, num_tokens: dict[str, int]) -> ModelRunnerOutput:
        """``num_tokens``: each scheduled request's token count (prompt plus
        outputs, drafts excluded) when the step was scheduled. A request
        samples when its step reaches that count (a step never schedules
        past it: drafts clipped by the budget are the ones cut)."""
        return self.execute_sampling(
            output,
            {
                item.request_id: item.num_computed_tokens + item.num_scheduled_tokens - item.num_spec_tokens
                >= num_tokens[item.request_id]
                for item in output.scheduled
            },
        )

    def execute_sampling(self, output: SchedulerOutput, samples: dict[str, bool]) -> ModelRunnerOutput:
        """Each request's sampling judged when it was scheduled
        (``samples``; async scheduling judges it then, ``execute`` from the
        token counts): a request that samples does so from the position its
        step reaches, drawing its accepted drafts in the step's order. One
        loop without a call per request (it runs for every request of every
        step)."""
        sampling = [item for item in output.scheduled if samples[item.request_id]]
        # Placeholder drafts (uniform-decode padding) are never accepted: no draws.
        rates_of = self._rates.get  # built once per draft count (``_rates_of``); () when none
        drawn = iter(
            self.uniforms.accepted_drafts_each(
                [
                    rates_of(num_spec) or self._rates_of(num_spec)
                    for _, _, _, num_spec, _, is_padded in sampling
                    if not is_padded
                ]
            )
        )
        sampled: dict[str, list[int]] = {}
        for request_id, num_new, computed, num_spec, _, is_padded in sampling:
            # ``sampled_token_ids`` written out: the first id, then 1 + accepted.
            first = OUTPUT_TOKEN_BASE + computed + num_new - num_spec
            sampled[request_id] = list(range(first, first + 1 + (0 if is_padded else next(drawn))))
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def sample(self, item: ScheduledRequest, num_tokens: int) -> list[int] | None:
        """One scheduled request's sampled tokens, given its token count when
        scheduled; None for a prefill chunk short of the prompt's end."""
        reached = item.num_computed_tokens + item.num_scheduled_tokens - item.num_spec_tokens
        if reached < num_tokens:
            return None
        # Placeholder drafts (uniform-decode padding) are never accepted.
        accepted = 0 if item.is_padded else self.num_accepted(item.num_spec_tokens)
        return self.sampled_token_ids(num_tokens, accepted + 1)
