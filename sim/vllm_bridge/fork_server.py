"""The fork's own ``Scheduler`` behind a pipe: run by ``kvsim conform --fork``
with the fork's interpreter (vLLM 0.30.0 plus the fork's scheduler-side
files, built by ``fork_venv.py``), never imported by kvsim.

It imports the standard library and the fork's vLLM only (kvsim's package
needs vLLM 0.33.0, which this interpreter does not have). One JSON object a
line on stdin, one answer a line on stdout; vLLM's own log goes to stderr.
The engine-side work (the clock, acceptance draws, the comparison) stays in
kvsim's process (``fork_backend.py``): this side holds the fork's state and
reports it.

Ops: ``init`` (settings, every worker's layer specs, the KV memory per
worker, the fork's switches), ``add`` (one request), ``schedule``,
``update`` (the sampled tokens of the step just scheduled), ``engine_step``
(one call of the batch queue), ``probe`` (the free queue), ``quit``. A
failure answers ``{"error": "..."}`` once and the process exits 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

# The smallest Qwen2-shaped MiMo config vLLM accepts: MiMo has an MTP draft
# (``num_nextn_predict_layers``) and both of its modules import on a CPU.
# The KV cache groups come from kvsim's layer specs, not from this model. Shared
# with ``scheduler.py`` (vLLM 0.33.0): this module imports only the standard
# library at its top, so kvsim's process can import it too.
STAND_IN_HF_CONFIG: dict[str, Any] = {
    "architectures": ["MiMoForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
# The stand-in's target and draft classes: registered already imported, so
# vLLM inspects them in this process instead of one subprocess each (two
# fresh vLLM imports; no CUDA to protect on a CPU machine).
STAND_IN_ARCHITECTURES = {
    "MiMoForCausalLM": ("vllm.model_executor.models.mimo", "MiMoForCausalLM"),
    "MiMoMTPModel": ("vllm.model_executor.models.mimo_mtp", "MiMoMTP"),
}
DRAFT_TOKEN_ID = 0
# vLLM's placeholder for a draft it pads a uniform decode with.
PAD_TOKEN_ID = -1


def register_stand_in_models() -> None:
    import importlib

    from vllm.model_executor.models.registry import ModelRegistry, _RegisteredModel

    for architecture, (module_name, class_name) in STAND_IN_ARCHITECTURES.items():
        if isinstance(ModelRegistry.models.get(architecture), _RegisteredModel):
            continue
        module = importlib.import_module(module_name)
        ModelRegistry.register_model(architecture, getattr(module, class_name))


def stand_in_model_dir(max_model_len: int) -> str:
    directory = tempfile.mkdtemp(prefix="kvsim-stand-in-model-")
    config = {**STAND_IN_HF_CONFIG, "max_position_embeddings": max(max_model_len, 4096)}
    (Path(directory) / "config.json").write_text(json.dumps(config))
    return directory


def build_vllm_config(s: dict[str, Any]) -> Any:
    """The engine arguments of the fork's launcher, on the stand-in model."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.config import SchedulerConfig as VllmSchedulerConfig

    register_stand_in_models()
    model = ModelConfig(
        model=stand_in_model_dir(s["max_model_len"]),
        skip_tokenizer_init=True,
        max_model_len=s["max_model_len"],
        dtype="bfloat16",
    )
    parallel = ParallelConfig(
        tensor_parallel_size=s["tensor_parallel_size"],
        pipeline_parallel_size=s["pipeline_parallel_size"],
    )
    speculative = (
        SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=s["num_speculative_tokens"],
            target_model_config=model,
            target_parallel_config=parallel,
        )
        if s["num_speculative_tokens"]
        else None
    )
    return VllmConfig(
        model_config=model,
        parallel_config=parallel,
        cache_config=CacheConfig(
            block_size=s["block_size"],
            mamba_cache_mode="align",
            enable_prefix_caching=s["enable_prefix_caching"],
            prefix_match_unit=s["prefix_match_unit"],
        ),
        scheduler_config=VllmSchedulerConfig(
            max_num_seqs=s["max_num_seqs"],
            max_num_batched_tokens=s["max_num_batched_tokens"],
            max_model_len=s["max_model_len"],
            long_prefill_token_threshold=s["long_prefill_token_threshold"],
            scheduler_reserve_full_isl=s["scheduler_reserve_full_isl"],
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        speculative_config=speculative,
    )


# ----------------------------------------------------------- layer specs
def _decode_value(value: Any) -> Any:
    """kvsim's encoding of a spec field (``fork_backend.encode_spec``)."""
    import torch

    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and "enum" in value:
        return value
    if isinstance(value, list):
        return tuple(_decode_value(v) for v in value)
    return value


def _decode_enum(cls: type, name: str, value: dict[str, Any]) -> Any:
    """An enum field by member name, on the type of the field's default
    (every enum field of a spec has one)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    enum_type: Any = type(field.default)
    return enum_type[value["enum"]]


def decode_spec(record: dict[str, Any]) -> Any:
    """A layer's spec from kvsim's record: the fork's class of the same name,
    every field it has; a field it lacks must hold its default in kvsim."""
    from vllm.v1 import kv_cache_interface

    cls = getattr(kv_cache_interface, record["type"])
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in record["fields"].items():
        if name not in known:
            continue
        decoded = _decode_value(value)
        if isinstance(decoded, dict) and "enum" in decoded:
            decoded = _decode_enum(cls, name, decoded)
        kwargs[name] = decoded
    return cls(**kwargs)


# ------------------------------------------------------------ the scheduler
def switch_pins(manager: Any, patches: dict[str, bool]) -> None:
    """The fork has no switch for its pins (0095-0097): waiter pins off is a
    bound of no waiters (nothing is pinned, so nothing yields), graces off
    as the fork turns them off under a KV connector."""
    if not patches.get("waiter_pins", True):
        manager.MAX_PINNED_WAITERS = 0
    if not patches.get("grace_pins", True):
        manager.enable_grace_pins = False


class ForkScheduler:
    """The fork's Scheduler as its engine core builds it, stepped one call
    at a time (``EngineCore.step``: schedule, execute, update)."""

    def __init__(self, params: dict[str, Any]) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.structured_output import StructuredOutputManager

        for name, value in params["environment"].items():
            os.environ[name] = value
        _clear_env_cache()
        settings = params["settings"]
        self.vllm_config = config = build_vllm_config(settings)
        if settings["async_scheduling"]:
            # The rig's mode (the launcher sets VLLM_USE_V2_MODEL_RUNNER=1,
            # which a CPU cannot build a config under, so only now); the CPU
            # platform turned async scheduling off while building. The config
            # then gives pp + 1 batches and selects the AsyncScheduler.
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            config.scheduler_config.async_scheduling = True
        # What the engine core resolves from its workers (kvsim's deployment).
        config.cache_config.kv_cache_layout = settings["kv_cache_layout"]
        workers = [{layer: decode_spec(spec) for layer, spec in worker} for worker in params["workers"]]
        planner: Any = kv_cache_utils  # the fork's 0.30.0 module (0.33.0 moved the planner)
        configs = planner.get_kv_cache_configs(config, workers, params["memory_bytes"])
        kv_cache_config = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config, config)
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        self.hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)
        switch_pins(self.scheduler.kv_cache_manager, settings.get("patches", {}))
        self.num_speculative_tokens = settings["num_speculative_tokens"]
        self.kv_cache_config = kv_cache_config
        self._output: Any = None

    def describe(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {
            "num_blocks": self.kv_cache_config.num_blocks,
            "block_size": scheduler.block_size,
            "hash_block_size": scheduler.hash_block_size,
            "defer_block_free": bool(scheduler.defer_block_free),
            "use_eagle_block_drop": bool(scheduler.use_eagle_block_drop),
            "num_prefill_lookahead": int(scheduler.num_prefill_lookahead),
            "groups": [
                {
                    "kind": type(g.kv_cache_spec).__name__,
                    "layers": len(g.layer_names),
                    "block_size": g.kv_cache_spec.block_size,
                    "slots_per_block": getattr(g, "slots_per_block", 1),
                    "is_eagle_group": bool(getattr(g, "is_eagle_group", False)),
                }
                for g in self.kv_cache_config.kv_cache_groups
            ],
            "enable_grace_pins": bool(getattr(scheduler.kv_cache_manager, "enable_grace_pins", False)),
            "max_pinned_waiters": int(getattr(scheduler.kv_cache_manager, "MAX_PINNED_WAITERS", 0)),
            "scheduler": type(scheduler).__name__,
            "max_concurrent_batches": int(self.vllm_config.max_concurrent_batches),
        }

    def add(self, params: dict[str, Any]) -> dict[str, Any]:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.scheduler.add_request(
            Request(
                request_id=params["request_id"],
                prompt_token_ids=params["prompt_token_ids"],
                sampling_params=SamplingParams(max_tokens=params["max_tokens"], ignore_eos=True),
                pooling_params=None,
                arrival_time=params["arrival_s"],
                block_hasher=self.hasher,
            )
        )
        return {}

    def schedule(self) -> dict[str, Any]:
        """One step of the fork's own ``Scheduler``: a padded uniform decode's
        drafts are vLLM's -1 placeholders (real drafts are ``DRAFT_TOKEN_ID``)."""
        self._output = out = self.scheduler.schedule()
        drafts = out.scheduled_spec_decode_tokens
        resumed = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
        return {
            **self._step_record(out, padded_ids={rid for rid, d in drafts.items() if _all_padding(d)}),
            "new": [r.req_id for r in out.scheduled_new_reqs],
            "resumed": [rid for rid in out.scheduled_cached_reqs.req_ids if rid in resumed],
        }

    def _step_record(self, out: Any, padded_ids: set[str]) -> dict[str, Any]:
        """What both engines report of a step: each scheduled request's row
        (``scheduled_row``; the drafts of ``padded_ids`` are padding) and who
        was preempted."""
        requests, drafts = self.scheduler.requests, out.scheduled_spec_decode_tokens
        return {
            "step_index": int(self.scheduler.current_step),
            "scheduled": [
                scheduled_row(requests[rid], n, len(drafts.get(rid, ())), rid in padded_ids)
                for rid, n in out.num_scheduled_tokens.items()
            ],
            "preempted": sorted(out.preempted_req_ids or ()),
        }

    def update(self, params: dict[str, Any]) -> dict[str, Any]:
        out, sampled = self._output, params["sampled"]
        req_ids = list(out.num_scheduled_tokens)
        engine_outputs = self.scheduler.update_from_output(out, runner_output(req_ids, sampled))
        finished = self._finished(engine_outputs)
        self._propose_drafts([rid for rid in req_ids if sampled.get(rid) and rid not in finished])
        stats = next((eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats), None)
        return {"finished": finished, **self._state(stats)}

    def _finished(self, engine_outputs: Any) -> list[str]:
        return sorted(
            o.request_id
            for eco in engine_outputs.values()
            for o in eco.outputs
            if o.finish_reason is not None
        )

    def probe(self, params: dict[str, Any]) -> dict[str, Any]:
        """The free queue (LRU first) for reading a difference by hand."""
        return {"free_queue": free_queue(self.scheduler.kv_cache_manager.block_pool)}

    def _propose_drafts(self, request_ids: list[str]) -> None:
        from vllm.v1.outputs import DraftTokenIds

        k = self.num_speculative_tokens
        if k and request_ids:
            drafts = [[DRAFT_TOKEN_ID] * k for _ in request_ids]
            self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids=request_ids, draft_token_ids=drafts))

    def _state(self, stats: Any) -> dict[str, Any]:
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        prefix = stats.prefix_cache_stats if stats is not None else None
        waiting = [*getattr(scheduler, "kv_holding_waiting", ()), *scheduler.waiting]
        return {
            "running": [r.request_id for r in scheduler.running],
            "waiting": [r.request_id for r in waiting],
            "num_free_blocks": manager.block_pool.get_num_free_blocks(),
            "prefix_cache_queries_tokens": (prefix.queries + prefix.preempted_queries) if prefix else 0,
            "prefix_cache_hits_tokens": (prefix.hits + prefix.preempted_hits) if prefix else 0,
            "fork": fork_state(scheduler),
            "has_unfinished": bool(scheduler.has_unfinished_requests()),
        }


class ForkEngine(ForkScheduler):
    """The fork's engine core in the rig's mode (PP, Model Runner V2, async
    scheduling): its own ``step_with_batch_queue`` and ``post_step`` over its
    ``AsyncScheduler``, with the workers replaced by an executor that asks
    kvsim (``ask``) what each step sampled, as ``sim/vllm_bridge/engine_core.py``
    does for vLLM 0.33.0. The core is a shell: only the fields those two
    methods read are set (its ``__init__`` profiles workers and loads a model)."""

    def __init__(self, params: dict[str, Any], ask: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        from collections import deque

        super().__init__(params)
        self.ask = ask
        self.core = _engine_core_shell(self.vllm_config, self.scheduler, self)
        self._in_flight: deque[dict[str, Any]] = deque()
        self._scheduled: dict[str, Any] | None = None
        self._samples = False
        self._last: Any = None

    # -- the executor
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        self._last = scheduler_output
        self._scheduled = converted = self._convert(scheduler_output)
        self._in_flight.append(converted)
        return _done(EMPTY_MODEL_RUNNER_OUTPUT if converted["empty"] else None)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:

        out, requests = self._last, self.scheduler.requests
        samples = {rid: not requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
        self._samples = any(samples.values())
        sampled = self.ask({"callback": "sample", "scheduled": self._scheduled, "samples": samples})[
            "sampled"
        ]
        return _done(runner_output(list(out.num_scheduled_tokens), sampled))

    def take_draft_token_ids(self, step_id: Any = None) -> None:
        return None  # drafts stay in the worker under async scheduling

    def _convert(self, out: Any) -> dict[str, Any]:
        """The step as kvsim's engine reads it. Model Runner V2 lists resumed
        requests among the new ones. Under async scheduling every draft is a
        -1 placeholder; only an admitted request's are padding."""
        requests = self.scheduler.requests
        new_ids = [r.req_id for r in out.scheduled_new_reqs]
        resumed = [rid for rid in new_ids if requests[rid].num_preemptions > 0]
        return {
            **self._step_record(
                out, padded_ids={rid for rid in new_ids if out.scheduled_spec_decode_tokens.get(rid)}
            ),
            "new": [rid for rid in new_ids if rid not in resumed],
            "resumed": resumed,
            "empty": out.total_num_scheduled_tokens == 0,
        }

    # -- one engine call
    def engine_step(self, params: dict[str, Any]) -> dict[str, Any]:
        self._scheduled, self._samples = None, False
        outputs, executed = self.core.step_with_batch_queue()
        self.core.post_step(executed)
        scheduled = self._scheduled
        processed = self._in_flight.popleft() if outputs is not None else None
        requests = self.scheduler.requests
        stats = None
        if outputs is not None:
            stats = next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats), None)
        return {
            "has_work": bool(self.scheduler.has_requests() or self.core.batch_queue),
            "scheduled": scheduled,
            "samples": self._samples,
            "processed": processed is not None,
            "in_flight_empty": all(entry["empty"] for entry in self._in_flight),
            "finished": self._finished(outputs) if outputs is not None else [],
            "placeholders": {
                entry[0]: requests[entry[0]].num_output_placeholders
                for entry in (scheduled["scheduled"] if scheduled else ())
                if entry[0] in requests
            },
            **self._state(stats),
        }


def scheduled_row(request: Any, num_scheduled: int, num_drafts: int, is_padded: bool) -> list[Any]:
    """One request's share of a step, as ``fork_backend.scheduler_output``
    reads it back: its id, the tokens scheduled, its computed tokens (after
    ``schedule()`` advanced them) and all its tokens, its drafts, whether
    they are padding."""
    return [
        request.request_id,
        num_scheduled,
        request.num_computed_tokens,
        request.num_tokens,
        num_drafts,
        is_padded,
    ]


def _all_padding(drafts: list[int]) -> bool:
    return bool(drafts) and all(token == PAD_TOKEN_ID for token in drafts)


def runner_output(req_ids: list[str], sampled: dict[str, list[int]]) -> Any:
    """The workers' output of a step: each scheduled request's sampled ids."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
    )


def _done(value: Any) -> Any:
    from concurrent.futures import Future

    future: Future = Future()
    future.set_result(value)
    return future


def _engine_core_shell(vllm_config: Any, scheduler: Any, executor: Any) -> Any:
    """An ``EngineCore`` whose ``step_with_batch_queue`` and ``post_step``
    are the fork's own, over ``scheduler``."""
    import queue
    from collections import deque

    from vllm.v1.engine.core import EngineCore

    core = EngineCore.__new__(EngineCore)
    core.scheduler = scheduler
    core.vllm_config = vllm_config
    core.model_executor = executor
    core.batch_queue_size = vllm_config.max_concurrent_batches
    core.batch_queue = deque(maxlen=core.batch_queue_size)
    core.log_stats = True
    core.is_ec_consumer = True
    core.is_mm_encoder_only = False
    core.is_pooling_model = False
    core.async_scheduling = vllm_config.scheduler_config.async_scheduling
    core.check_for_draft_tokens = vllm_config.speculative_config is not None
    core.aborts_queue = queue.Queue()
    core._weight_version = "default"
    return core


def fork_state(scheduler: Any) -> dict[str, Any]:
    """What the fork exposes of its own additions: waiter pins, graces (in
    release order), retained checkpoints per Mamba group, fenced frees."""
    manager = scheduler.kv_cache_manager
    graces = list(getattr(manager, "_grace_pins", {}))
    return {
        "pinned_waiters": sorted(getattr(manager, "_pinned_hits", {})),
        "graces": graces,
        "num_grace_pinned_blocks": int(getattr(manager, "num_grace_pinned_blocks", 0)),
        "retained": _retained_checkpoints(manager),
        "num_deferred_frees": num_fenced_blocks(e[1] for e in getattr(scheduler, "deferred_frees", ())),
        "free_queue": free_queue_digest(manager.block_pool),
    }


def free_queue(block_pool: Any) -> list[list[Any]]:
    """Each free block, eviction order: [block id, hashed token position or None]."""
    return [
        [block.block_id, getattr(block, "block_hash_num_tokens", None) if block.block_hash else None]
        for block in block_pool.free_block_queue.get_all_free_blocks()
    ]


def num_fenced_blocks(lists: Any) -> int:
    """Blocks waiting behind a fence (the null block, which a free skips, not counted)."""
    return sum(1 for blocks in lists for block in blocks if not block.is_null)


def free_queue_digest(block_pool: Any) -> str:
    """The free queue's order and which of its blocks still hold a prefix
    hash, as one short digest: equal free counts can hide different blocks
    (and so different future hits)."""
    import hashlib

    return hashlib.sha1(json.dumps(free_queue(block_pool)).encode()).hexdigest()[:16]


def _retained_checkpoints(manager: Any) -> list[int]:
    """Per Mamba group that retains (0086), how many requests hold a state."""
    return [
        len(single._retained_checkpoints)
        for single in manager.coordinator.single_type_managers
        if isinstance(getattr(single, "_retained_checkpoints", None), dict)
    ]


def _clear_env_cache() -> None:
    import vllm.envs

    cache_clear = getattr(getattr(vllm.envs, "__getattr__", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


# ------------------------------------------------------------------ the pipe
def serve(lines: TextIO, answers: TextIO) -> int:
    server: ForkScheduler | None = None

    def send(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    def ask(message: dict[str, Any]) -> dict[str, Any]:
        """A question to kvsim in the middle of an op (what a step sampled)."""
        send(message)
        return json.loads(lines.readline())

    handlers: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
        "add": ForkScheduler.add,
        "schedule": lambda s, p: s.schedule(),
        "update": ForkScheduler.update,
        "probe": ForkScheduler.probe,
        "engine_step": ForkEngine.engine_step,
    }
    for line in iter(lines.readline, ""):
        message = json.loads(line)
        op = message.pop("op")
        try:
            if op == "quit":
                return 0
            if op == "init":
                async_engine = message["settings"]["async_scheduling"]
                server = ForkEngine(message, ask) if async_engine else ForkScheduler(message)
                answer = server.describe()
            else:
                assert server is not None, "init first"
                answer = handlers[op](server, message)
        except Exception as error:  # one line back to kvsim, then stop
            first = (str(error).strip().splitlines() or [""])[0][:300]
            send({"error": f"{op}: {type(error).__name__}: {first}"})
            return 1
        send(answer)
    return 0


def main() -> int:
    # The protocol owns the real stdout; everything vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
    return serve(sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(main())
