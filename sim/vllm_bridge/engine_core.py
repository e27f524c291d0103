"""vLLM 0.33.0's own engine core in the rig's mode (PP 2, Model Runner V2,
async scheduling): the real ``EngineCore.step_with_batch_queue`` and
``post_step`` over the real ``AsyncScheduler``, with the workers replaced
by a fake executor. The reference ``kvsim conform --engine async`` compares
kvsim's async engine loop with.

Imported only by the conformance backend, like ``scheduler.py`` beside it.

The engine core is a shell (``EngineCore.__new__``, then only the fields
the two methods read): its real ``__init__`` profiles workers, plans the KV
cache and warms up a model. The scheduler is built as ``scheduler.py``
builds vLLM's ``Scheduler``, from a real ``VllmConfig`` in which async
scheduling is switched on after the config is built (the CPU platform
forces it off while building); the config then derives
``max_concurrent_batches`` = pp + 1 and ``get_scheduler_cls()`` returns
``AsyncScheduler`` by itself.
"""

from __future__ import annotations

import contextlib
import os
import queue
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from sim.vllm_bridge import KVCacheConfig
from sim.vllm_bridge.scheduler import build_vllm_scheduler

__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "EngineCore",
    "FakeExecutor",
    "ModelRunnerOutput",
    "build_engine_core",
]


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class FakeExecutor:
    """The workers: ``execute_model`` tells ``on_schedule`` of the step;
    ``sample_tokens`` returns what ``sample`` says the step sampled, as a
    resolved future (the driver's clock decides when the engine may read
    it: it waits only on the oldest). Drafts stay in the worker (async
    scheduling never asks for them)."""

    def __init__(
        self, sample: Callable[[Any], ModelRunnerOutput], on_schedule: Callable[[Any], None]
    ) -> None:
        self._sample = sample
        self._on_schedule = on_schedule
        self._last: Any = None

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        self._last = scheduler_output
        self._on_schedule(scheduler_output)
        empty = scheduler_output.total_num_scheduled_tokens == 0
        return _done(EMPTY_MODEL_RUNNER_OUTPUT if empty else None)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Future:
        return _done(self._sample(self._last))

    def take_draft_token_ids(self) -> None:
        return None


def enable_async_scheduling(vllm_config: VllmConfig) -> None:
    """The rig's mode on a config built on a CPU (the platform forced it
    off while building)."""
    vllm_config.scheduler_config.async_scheduling = True


@contextlib.contextmanager
def _model_runner_v2() -> Iterator[None]:
    """Model Runner V2 selected while the scheduler is built (vLLM reads the
    variable on every access of ``use_v2_model_runner``; the scheduler keeps
    what it read), and the process environment restored afterwards, so a
    synchronous Scheduler built later in the same process is unchanged."""
    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = before


def build_engine_core(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, executor: FakeExecutor
) -> EngineCore:
    """An ``EngineCore`` shell whose ``step_with_batch_queue`` and
    ``post_step`` are vLLM's own, over the scheduler class the config
    selects, with a batch queue of ``max_concurrent_batches``."""
    core = EngineCore.__new__(EngineCore)
    with _model_runner_v2():
        if not vllm_config.use_v2_model_runner:
            raise ValueError("vLLM did not select Model Runner V2")
        core.scheduler = build_vllm_scheduler(
            vllm_config, kv_cache_config, scheduler_cls=vllm_config.scheduler_config.get_scheduler_cls()
        )
        core.batch_queue_size = vllm_config.max_concurrent_batches
    core.vllm_config = vllm_config
    core.model_executor = executor
    core.log_stats = True
    core.batch_queue = deque(maxlen=core.batch_queue_size)
    core.is_mm_encoder_only = False
    core.is_pooling_model = False
    core.async_scheduling = vllm_config.scheduler_config.async_scheduling
    core.check_for_draft_tokens = vllm_config.speculative_config is not None
    core.aborts_queue = queue.Queue()
    core._weight_version = "default"  # as EngineCore.__init__ sets it
    return core
