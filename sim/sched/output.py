"""What one scheduler step hands the engine loop, and what the (simulated)
workers hand back: plain objects, vLLM's vocabulary (``SchedulerOutput``,
``ModelRunnerOutput``), only the fields a block-allocation simulator needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class ScheduledRequest(NamedTuple):
    """One request's share of a step. A named tuple, not a frozen dataclass:
    one is built per request per step, and a frozen dataclass sets each
    field through ``object.__setattr__`` (twice the cost)."""

    request_id: str
    num_scheduled_tokens: int  # query tokens this step, drafts included
    num_computed_tokens: int  # context already in the KV cache before the step
    num_spec_tokens: int  # MTP drafts among the scheduled tokens
    num_prompt_tokens_left: int  # prompt (or recompute) tokens among them
    # Padded to a uniform decode: the drafts are placeholders, never accepted.
    is_padded: bool = False

    @property
    def is_decode(self) -> bool:
        return self.num_prompt_tokens_left == 0


def is_decoding(num_computed_tokens: int, num_known_tokens: int) -> bool:
    """Whether only the last known token (and drafts) is left to compute:
    the prompt, and every output but the last, computed. The one test of
    "decoding" (the scheduler's record of a step, the fast path's windows
    and lanes, the conformance driver); async scheduling counts output
    placeholders as known.

    >>> is_decoding(99, 100), is_decoding(98, 100)
    (True, False)
    """
    return num_computed_tokens >= num_known_tokens - 1


def reaches_max_tokens(num_computed_tokens: int, num_output_placeholders: int, max_tokens_end: int) -> bool:
    """Async scheduling: whether a request's step in flight is sure to reach
    ``max_tokens`` (its prompt plus ``max_tokens``: ``max_tokens_end``) even
    if all its drafts are rejected, so the running loop skips it.

    >>> reaches_max_tokens(100, 4, 98), reaches_max_tokens(100, 4, 99), reaches_max_tokens(100, 0, 0)
    (True, False, False)
    """
    return num_output_placeholders > 0 and num_computed_tokens + 2 - num_output_placeholders >= max_tokens_end


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerOutput:
    """One step: who runs, with how many tokens, and what the step changed."""

    step_index: int
    scheduled: tuple[ScheduledRequest, ...]
    new_request_ids: tuple[str, ...] = ()
    resumed_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    # Prefix-cache hit (tokens) of every request admitted this step.
    admitted_hits: dict[str, int] = field(default_factory=dict)
    # vLLM's PrefixCacheStats for this step, recorded at admission (tokens).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Cached blocks whose hash was dropped because the block was reused.
    num_evicted_blocks: int = 0
    new_ring_block_ids: tuple[int, ...] = ()

    # Derived from ``scheduled`` once (the stats and the step-time model read
    # them every step; a cached_property takes a lock on Python 3.11).
    total_num_scheduled_tokens: int = field(init=False, compare=False, repr=False)
    num_prefill_tokens: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        total = prefill = 0
        for _, num_scheduled, _, _, num_prompt_tokens_left, _ in self.scheduled:  # unpacked: every step
            total += num_scheduled
            prefill += num_prompt_tokens_left
        object.__setattr__(self, "total_num_scheduled_tokens", total)
        object.__setattr__(self, "num_prefill_tokens", prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.total_num_scheduled_tokens - self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, kw_only=True)
class ModelRunnerOutput:
    """Tokens sampled per request (the bonus token plus accepted drafts);
    requests in the middle of a prefill sample nothing."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What ``update_from_output`` did with one step's output."""

    # Finished requests and the output tokens each generated in all.
    finished: dict[str, int] = field(default_factory=dict)
    first_token_request_ids: tuple[str, ...] = ()
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class StepTally:
    """A step's outcome while its requests' outputs are applied, in order."""

    finished: dict[str, int] = field(default_factory=dict)
    first_token_request_ids: list[str] = field(default_factory=list)
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def outcome(self) -> StepOutcome:
        return StepOutcome(
            finished=self.finished,
            first_token_request_ids=tuple(self.first_token_request_ids),
            num_generated_tokens=self.num_generated_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
