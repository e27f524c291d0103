"""How long one engine step takes on the rig: a pure function of what the
step scheduled. No twin in vLLM (the real engine measures time; kvsim
models it). The derivation of every default is in docs/step-time-model.md.

A step is priced as a roofline per pipeline stage. The step's requests are
split over ``m = min(pp, requests)`` micro-batches (PP keeps that many
batches in flight). Every request passes every stage once per step, and a
stage works on one micro-batch at a time, so the step period is ``pp``
stage-times of one micro-batch (the pipeline is full when ``m = pp``; with
fewer micro-batches the stages wait for each other):

    step_s = overhead_s + pp * stage_s(step / m)
    stage_s(b) = max(bytes(b) / stage_bandwidth, flops(b) / stage_flops) + comm_s(b)

``bytes`` counts the weights a micro-batch touches (dense weights plus the
distinct MoE experts its tokens route to), the attention KV its decode tokens
read (QSA reads compressed keys over the whole context and the top-k raw
entries), and the GDN/PLE states read and written. ``flops`` is two per
active parameter per token plus attention over the context. ``comm_s`` is
two TP all-reduces per layer and one PP hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from sim.config import StrictModel
from sim.sched.output import ScheduledRequest, SchedulerOutput


class StepTimeConfig(StrictModel):
    """Coefficients of the step-time model; defaults: the Flash-Next
    deployment on 4x RTX 3090 (TP2 x PP2). Every key can be overridden from
    a scenario's ``step_time:`` section."""

    gpu_memory_bandwidth_bytes_per_s: float = Field(936.2e9, gt=0)
    memory_efficiency: float = Field(0.35, gt=0, le=1)
    gpu_peak_flops: float = Field(71.0e12, gt=0)
    compute_efficiency: float = Field(0.12, gt=0, le=1)
    # Weights (Qwen3-Next-80B-A3B class MoE, 4-bit weights with scales).
    weight_bits: float = Field(4.5, gt=0)
    dense_params: float = Field(1.49e9, ge=0)  # non-expert params, read every step
    active_params_per_token: float = Field(3.0e9, gt=0)
    num_moe_layers: int = Field(49, ge=0)  # 48 layers + the MTP layer
    experts_per_layer: int = Field(512, gt=0)
    experts_per_token: int = Field(10, ge=0)
    params_per_expert: float = Field(3 * 2048 * 512, ge=0)
    # Attention (13 QSA layers incl. MTP; bytes per token per TP rank).
    num_attention_layers: int = Field(13, ge=0)
    kv_bytes_per_token: float = Field(512.0, ge=0)  # fp8 K+V, 1 KV head x 256
    compressed_key_bytes_per_token: float = Field(64.0, ge=0)  # 128 x bf16 / 4 tokens
    qsa_topk_tokens: int = Field(2048, ge=0)
    compressed_tokens_per_state: int = Field(4, gt=0)
    attention_flops_per_token_pair: float = Field(4 * 8 * 256, ge=0)  # 4 x q-heads x head per rank
    # Recurrent state read and written per request per step (per TP rank).
    num_gdn_layers: int = Field(36, ge=0)
    gdn_state_bytes: float = Field(1_634_304.0, ge=0)
    ple_state_bytes: float = Field(245_760.0, ge=0)
    # Interconnect (PCIe 4.0 x16 between the cards, no NVLink).
    hidden_size: int = Field(2048, gt=0)
    activation_bytes: int = Field(2, gt=0)
    interconnect_bandwidth_bytes_per_s: float = Field(12.0e9, gt=0)
    allreduce_latency_s: float = Field(20e-6, ge=0)
    pp_send_latency_s: float = Field(30e-6, ge=0)
    # Scheduler, sampling, MTP draft and launch overhead per step.
    step_overhead_s: float = Field(5.0e-3, ge=0)
    tensor_parallel_size: int = Field(2, gt=0)
    pipeline_parallel_size: int = Field(2, gt=0)


@dataclass(frozen=True, kw_only=True)
class _MicroBatch:
    num_tokens: float
    num_decode_requests: float
    decode_context_tokens: float  # sum of decode requests' contexts
    decode_topk_tokens: float  # sum of min(context, top-k)
    prefill_attention_pairs: float  # query x key pairs of prefill tokens
    num_requests: float


class StepTimeModel:
    """``step_time_s(output)``: seconds one scheduled step takes."""

    def __init__(self, config: StepTimeConfig) -> None:
        self.config = config
        c = config
        self._stage_bandwidth = (
            c.tensor_parallel_size * c.gpu_memory_bandwidth_bytes_per_s * c.memory_efficiency
        )
        self._stage_flops = c.tensor_parallel_size * c.gpu_peak_flops * c.compute_efficiency
        self._bytes_per_param = c.weight_bits / 8

    def step_time_s(self, output: SchedulerOutput) -> float:
        if output.is_empty:
            return 0.0
        pp = self.config.pipeline_parallel_size
        micro_batches = min(pp, len(output.scheduled))
        micro = _micro_batch(
            output.scheduled,
            self.config.qsa_topk_tokens,
            1 / self.config.compressed_tokens_per_state,
            micro_batches,
        )
        return self.config.step_overhead_s + pp * self._roofline_stage_s(micro)

    # ----------------------------------------------- the pipeline clock's view
    def stage_s(self, output: SchedulerOutput, stage: int) -> float:
        """Seconds PP stage ``stage`` spends on one micro-batch (``output``,
        one engine step), its TP all-reduces included, the hand-off not.
        The step overhead (sampling, the MTP draft, launch) falls on the
        last stage, which samples (``pipeline_clock.py``)."""
        if output.is_empty:
            return 0.0
        micro = self._whole(output)
        overhead_s = self.config.step_overhead_s if stage == self.config.pipeline_parallel_size - 1 else 0.0
        return self._roofline_stage_s(micro) - self._send_s(micro) + overhead_s

    def handoff_s(self, output: SchedulerOutput) -> float:
        """Seconds the PP hand-off of one micro-batch's activations takes."""
        return 0.0 if output.is_empty else self._send_s(self._whole(output))

    def _whole(self, output: SchedulerOutput) -> _MicroBatch:
        c = self.config
        return _micro_batch(output.scheduled, c.qsa_topk_tokens, 1 / c.compressed_tokens_per_state, 1)

    def _roofline_stage_s(self, micro: _MicroBatch) -> float:
        memory_s = self._stage_bytes(micro) / self._stage_bandwidth
        compute_s = self._stage_flops_needed(micro) / self._stage_flops
        return max(memory_s, compute_s) + self._comm_s(micro)

    def _stage_bytes(self, micro: _MicroBatch) -> float:
        c = self.config
        pp, tp = c.pipeline_parallel_size, c.tensor_parallel_size
        experts = c.experts_per_layer * (
            1 - (1 - c.experts_per_token / c.experts_per_layer) ** micro.num_tokens
        )
        weights = (
            (c.dense_params + c.num_moe_layers * experts * c.params_per_expert) * self._bytes_per_param / pp
        )
        # KV and state bytes are per TP rank; the stage has tp ranks reading.
        kv = (
            (c.num_attention_layers / pp)
            * tp
            * (
                micro.decode_context_tokens * c.compressed_key_bytes_per_token
                + micro.decode_topk_tokens * c.kv_bytes_per_token
            )
        )
        state = 2 * micro.num_requests * tp * (c.num_gdn_layers * c.gdn_state_bytes + c.ple_state_bytes) / pp
        return weights + kv + state

    def _stage_flops_needed(self, micro: _MicroBatch) -> float:
        c = self.config
        pp, tp = c.pipeline_parallel_size, c.tensor_parallel_size
        linear = 2 * c.active_params_per_token * micro.num_tokens / pp
        pairs = micro.prefill_attention_pairs + micro.decode_topk_tokens
        attention = (c.num_attention_layers / pp) * tp * c.attention_flops_per_token_pair * pairs
        return linear + attention

    def _comm_s(self, micro: _MicroBatch) -> float:
        c = self.config
        layers_per_stage = (c.num_gdn_layers + c.num_attention_layers) / c.pipeline_parallel_size
        message = micro.num_tokens * c.hidden_size * c.activation_bytes
        allreduce = 0.0
        if c.tensor_parallel_size > 1:
            ring = 2 * (c.tensor_parallel_size - 1) / c.tensor_parallel_size
            allreduce = (
                2
                * layers_per_stage
                * (c.allreduce_latency_s + ring * message / c.interconnect_bandwidth_bytes_per_s)
            )
        return allreduce + self._send_s(micro)

    def _send_s(self, micro: _MicroBatch) -> float:
        c = self.config
        message = micro.num_tokens * c.hidden_size * c.activation_bytes
        return c.pp_send_latency_s + message / c.interconnect_bandwidth_bytes_per_s


def _micro_batch(
    scheduled: tuple[ScheduledRequest, ...], topk: int, states_per_token: float, micro_batches: int
) -> _MicroBatch:
    """One of ``micro_batches`` equal shares of the step's totals."""
    tokens = decode_requests = context = topk_tokens = pairs = 0.0
    for item in scheduled:
        n = item.num_scheduled_tokens
        computed = item.num_computed_tokens
        tokens += n
        if item.is_decode:
            decode_requests += 1
            context += computed * n
            topk_tokens += min(computed, topk) * n
        else:
            # QSA: each query attends to its top-k keys of the causal context,
            # and the indexer scores every compressed key of that context.
            keys = computed + (n + 1) / 2
            pairs += n * (min(keys, topk) + keys * states_per_token)
    return _MicroBatch(
        num_tokens=tokens / micro_batches,
        num_decode_requests=decode_requests / micro_batches,
        decode_context_tokens=context / micro_batches,
        decode_topk_tokens=topk_tokens / micro_batches,
        prefill_attention_pairs=pairs / micro_batches,
        num_requests=float(len(scheduled)) / micro_batches,
    )
