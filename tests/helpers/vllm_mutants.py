"""vLLM-side mutants for the conformance gates (issue 41): a patched copy
of one of vLLM's own functions, its source text changed in one place and
compiled in the function's own module, for a test to put in place with
``monkeypatch.setattr`` (never an edit of the installed files). The gate
must report a difference against it: the reference can fail.

Each mutant is a method of vLLM's Scheduler, patched on the reference's
scheduler instance only, so only the reference backend changes.
"""

from __future__ import annotations

import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmMutant:
    """``owner.name`` with ``old`` (exactly once in its source) replaced by ``new``."""

    name: str  # what the mutant is, for test ids
    owner: Any
    function: str
    old: str
    new: str

    def patched(self) -> Callable[..., Any]:
        original = getattr(self.owner, self.function)
        source = inspect.getsource(original)  # as indented in its file
        assert source.count(self.old) == 1, f"{self.name}: {self.old!r} is not once in {self.function}"
        mutated = textwrap.dedent(source.replace(self.old, self.new))
        namespace: dict[str, Any] = {}
        code = compile(mutated, inspect.getsourcefile(original) or "<vllm>", "exec")
        exec(code, original.__globals__, namespace)  # noqa: S102 (vLLM's own source, one edit)
        return namespace[self.function]

    def apply(self, monkeypatch: Any) -> None:
        """On every vLLM Scheduler built while the patch holds (the
        reference's), as an attribute of the instance: kvsim calls some of
        vLLM's scheduler functions itself (the block-aligned split, bound to
        a stand-in, ``sim/vllm_bridge``), and those calls keep the original."""
        patched, init = self.patched(), self.owner.__init__

        def init_with_the_mutant(scheduler: Any, *args: Any, **kwargs: Any) -> None:
            init(scheduler, *args, **kwargs)
            setattr(scheduler, self.function, types.MethodType(patched, scheduler))

        monkeypatch.setattr(self.owner, "__init__", init_with_the_mutant)


def vllm_scheduler() -> Any:
    # Through the bridge: it prepares the process before vLLM's first import.
    from sim.vllm_bridge import Scheduler

    return Scheduler


def budget_one_short() -> VllmMutant:
    """vLLM's step token budget one token short: a chunk clipped by the
    budget ends one token earlier, which the block-aligned split floors a
    whole block earlier only when the budget's edge is a block boundary."""
    return VllmMutant(
        "budget-one-short",
        vllm_scheduler(),
        "schedule",
        "token_budget = self.max_num_scheduled_tokens\n",
        "token_budget = self.max_num_scheduled_tokens - 1\n",
    )


def block_end_floored_one_early() -> VllmMutant:
    """vLLM's split flooring a mid-prompt chunk's end from one token
    before it: the same block unless the chunk ends exactly on one."""
    return VllmMutant(
        "block-end-floored-one-early",
        vllm_scheduler(),
        "_mamba_block_aligned_split",
        "aligned_end = end // block_size * block_size",
        "aligned_end = (end - 1) // block_size * block_size",
    )


def stale_output_forgotten() -> VllmMutant:
    """vLLM's preemption not marking the output in flight as stale (async
    only: a synchronous step has none in flight)."""
    return VllmMutant(
        "stale-output-forgotten",
        vllm_scheduler(),
        "_preempt_request",
        "request.num_stale_output_tokens = request.num_in_flight_tokens",
        "request.num_stale_output_tokens = 0",
    )


def abort_in_flight_keeps_blocks() -> VllmMutant:
    """vLLM's abort keeping the blocks of a request with a step in flight
    (as if a KV transfer were pending): the same as vLLM for an abort
    between steps, different only while a step is in flight."""
    return VllmMutant(
        "abort-in-flight-keeps-blocks",
        vllm_scheduler(),
        "finish_requests",
        "            delay_free_blocks = False\n",
        "            delay_free_blocks = request.num_in_flight_tokens > 0\n",
    )


def checkpoint_on_the_block() -> VllmMutant:
    """vLLM's split taking the prompt's checkpoint on the block, not on the
    hash unit, with partial-block hits on (the two sizes swapped): the same
    wherever the hash unit is the block."""
    return VllmMutant(
        "checkpoint-on-the-block",
        vllm_scheduler(),
        "_mamba_block_aligned_split",
        "self.hash_block_size if self.mamba_partial_cache_hit else self.block_size",
        "self.block_size if self.mamba_partial_cache_hit else self.hash_block_size",
    )


def tail_on_the_block() -> VllmMutant:
    """vLLM's split stopping at the prompt's last whole block, not its last
    whole hash unit (the tail boundary of partial-block hits)."""
    return VllmMutant(
        "tail-on-the-block",
        vllm_scheduler(),
        "_mamba_block_aligned_split",
        "                request.num_prompt_tokens,\n                self.hash_block_size,\n",
        "                request.num_prompt_tokens,\n                block_size,\n",
    )
