"""What one scheduler step hands the engine loop, and what the (simulated)
workers hand back: plain objects, vLLM's vocabulary (``SchedulerOutput``,
``ModelRunnerOutput``), only the fields a block-allocation simulator needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledRequest:
    """One request's share of a step."""

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


@dataclass(frozen=True, kw_only=True)
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

    # Cached: the stats and the step-time model read them once a step each.
    @cached_property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    @cached_property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_prompt_tokens_left for r in self.scheduled)

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


@dataclass
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
