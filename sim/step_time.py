"""How long one micro-batch takes on each pipeline stage of the rig: a pure
function of what the scheduler put in it. No twin in vLLM (the real engine
measures time; kvsim models it). The derivation of every default is in
docs/step-time-model.md.

The engine loop asks two things (the PP pipeline is built from them):

    stage_s(output, stage)  seconds stage ``stage`` spends on the micro-batch
    handoff_s(output)       the activation hand-off from one stage to the next

A stage's time is a roofline of the layers it owns, per TP rank (the ranks
of a stage work in parallel):

    stage_s = max(bytes / (bandwidth x memory_efficiency),
                  flops / (tensor_flops x clock fraction x compute_efficiency))
              + layers x (kernel overhead + 2 TP all-reduces, by degree and size)
              + RecoverSSM's replay kernels on a decode's GDN layers
              + [unfused GDN forward] GDN layers x a fixed cost per chunk a
                block boundary cut short of the budget
              + the first stage's host gathers (token embedding, PLE rows)
              + the last stage's sampling, MTP draft passes and step overhead

``bytes``: the stage's dense weights, the distinct routed experts the
micro-batch's tokens touch (expert parallel: as many as the busiest rank
holds), the QSA KV a decode reads (the indexer's compressed keys of the
whole context, the top-k selected entries), the GDN states read and
written (under RecoverSSM, once per decode token).
``flops``: two per active parameter per token, the QSA indexer over the
compressed keys and attention over the top-k selected keys, the GDN
recurrence. ``step_time_s`` is what a synchronous engine waits for: the
step's micro-batches pushed through the stages (``pipeline_s``).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from sim import model_arch
from sim.config import StrictModel
from sim.rig import GPU, Quantization, gpu, quantization
from sim.sched.output import ScheduledRequest, SchedulerOutput

# Groups every TP rank holds whole (the others are sharded over TP): vLLM's
# qwen4_exp builds the hyper-connections, the router, the indexer (one key
# head) and the PLE module as replicated layers.
REPLICATED = frozenset({"hyper_connections", "router", "indexer", "ple_module", "final_mixer"})

# Fitted (the one coefficient beyond the two of the release check): the
# unfused GDN forward's extra time per GDN layer on a chunk cut short by a
# block boundary. docs/step-time-model.md gives the fit and its range.
UNFUSED_CUT_CHUNK_PER_GDN_LAYER_S = 5.7e-3


class StepTimeConfig(StrictModel):
    """Coefficients of the step-time model; defaults: the Flash-Next
    deployment on 4x RTX 3090 (TP2 x PP2, layers 25/23). Every key can be
    overridden from a scenario's ``step_time:`` section."""

    gpu: str = "rtx3090-220w"  # scenarios/rig/gpus.yaml
    quantization: str = "w4a16-merlin"  # scenarios/rig/quantizations.yaml
    architecture: str | None = None  # an architecture file; None: the shipped Flash-Next
    memory_efficiency: float = Field(0.78, gt=0, le=1)
    compute_efficiency: float = Field(0.74, gt=0, le=1)
    # The GPU's power cap in W; None: the GPU entry's (rtx3090-220w: 220).
    power_cap_w: float | None = Field(None, gt=0)
    p2p_bandwidth_bytes_per_s: float = Field(20.0e9, gt=0)
    # Two PCIe ranks: vLLM's custom all-reduce over P2P, for messages
    # under its 8 MiB buffer. Otherwise (more ranks on PCIe only, or larger
    # messages) NCCL's ring with the rig's NCCL_PROTO=LL.
    allreduce_latency_s: float = Field(18e-6, ge=0)
    custom_allreduce_max_bytes: float = Field(8 * 1024 * 1024, ge=0)
    nccl_base_latency_s: float = Field(40.2e-6, ge=0)
    nccl_hop_latency_s: float = Field(1.0e-6, ge=0)
    nccl_ll_efficiency: float = Field(0.5, gt=0, le=1)
    # NCCL_PROTO: the rig forces LL; "auto" (NCCL's default, the v1 TP4
    # lane) takes the faster of LL and Simple (full lines, a longer base
    # and hop latency: NCCL's tuning model, ring on PCI).
    nccl_protocol: Literal["LL", "auto"] = "LL"
    nccl_simple_extra_base_latency_s: float = Field(1.8e-6, ge=0)
    nccl_simple_extra_hop_latency_s: float = Field(4.7e-6, ge=0)
    # RecoverSSM (deployment.use_replayssm with MTP): the verify steps each
    # decode's GDN state through its tokens one at a time and replays it.
    recover_ssm_replay: bool = False
    replay_kernel_overhead_per_layer_s: float = Field(5e-6, ge=0)
    # The GDN prefill forward: "fused" (the packed forward: every build the
    # cards measure but one) or "unfused" (v2.5.0's release candidate, which
    # turned it off under RecoverSSM). Unfused, a prefill chunk that a block
    # boundary cuts short of the chunk budget costs this much more on every
    # GDN layer: fitted on the candidate's 10K row against its block-4,096
    # row (docs/step-time-model.md, "The unfused GDN forward").
    gdn_forward: Literal["fused", "unfused"] = "fused"
    unfused_cut_chunk_per_gdn_layer_s: float = Field(UNFUSED_CUT_CHUNK_PER_GDN_LAYER_S, ge=0)
    # The KV block (align mode cuts prefill chunks at its boundaries) and
    # the scheduler's chunk budget; the engine sets the block the planner
    # resolved. Read only by the unfused forward's term.
    block_size: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    pp_send_latency_s: float = Field(30e-6, ge=0)
    host_read_efficiency: float = Field(0.3, gt=0, le=1)
    host_gather_latency_s: float = Field(30e-6, ge=0)
    # How the PLE rows reach the GPU: "pull" (v2 on: a host-mapped gather
    # inside the step) or "push" (v1, the TP4 lane: upstream's offload
    # process gathers them on the CPU and writes them back while the stage
    # waits at the PLE layer, one round trip a step; the fork measured pull
    # 4-10 % faster in decode, so 0.07 x its 18.7 ms step).
    ple_transport: Literal["pull", "push"] = "pull"
    ple_push_round_trip_s: float = Field(1.3e-3, ge=0)
    kernel_overhead_per_layer_s: float = Field(40e-6, ge=0)
    sampling_s: float = Field(0.3e-3, ge=0)
    step_overhead_s: float = Field(1.0e-3, ge=0)
    gdn_flops_per_state_entry: float = Field(8.0, ge=0)
    tensor_parallel_size: int = Field(2, gt=0)
    pipeline_parallel_size: int = Field(2, gt=0)
    layer_partition: tuple[int, ...] | None = None  # None: as even as it goes
    num_speculative_tokens: int = Field(3, ge=0)
    # A linear clock instead of the roofline (tests, what-ifs): a step is
    # step_overhead_s + tokens x seconds_per_token, spread over the stages.
    seconds_per_token: float | None = Field(None, ge=0)

    @property
    def architecture_path(self) -> Path:
        return Path(self.architecture) if self.architecture else model_arch.DEFAULT_ARCHITECTURE

    @model_validator(mode="after")
    def _partition_matches_pp(self) -> StepTimeConfig:
        if self.layer_partition is not None and len(self.layer_partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"layer_partition: {len(self.layer_partition)} stages for pp {self.pipeline_parallel_size}"
            )
        return self


@dataclass(frozen=True, kw_only=True)
class _Batch:
    """What a micro-batch asks of every layer (sums over its requests)."""

    tokens: float
    requests: float
    logit_rows: float  # decode tokens, one per prefill chunk
    decode_index_keys: float  # compressed keys the decode requests' indexers read
    decode_topk: float  # selected KV entries the decode requests read
    query_index_keys: float  # sum over query tokens of the keys each one's indexer scores
    query_topk: float  # sum over query tokens of the keys each attends to
    replay_tokens: float = 0.0  # decode tokens past each request's first (RecoverSSM steps through them)


@dataclass(frozen=True, slots=True)
class _BatchCosts:
    """A micro-batch's figures that every stage reads, worked out once per
    micro-batch (each the same expression a per-stage call would evaluate,
    so the same float)."""

    batch: _Batch
    experts_bytes: float  # the distinct routed experts' bytes, per layer
    kv_bytes: float  # one QSA layer's KV read
    attention_flops: float  # one QSA layer's indexer and attention
    layer_fixed_s: float  # one layer's kernel gaps and all-reduces
    cut_chunks: int = 0  # prefill chunks a block boundary cut short of the budget (unfused forward only)


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """Per TP rank: the weights a stage owns and what a token multiplies."""

    num_layers: int
    num_qsa: int
    num_gdn: int
    dense_bytes: float
    is_first: bool
    is_last: bool
    token_params: float  # active per token: dense params (experts excluded) and the active experts'


class StepTimeModel:
    """``stage_s``/``handoff_s`` per micro-batch; ``step_time_s`` per step."""

    def __init__(self, config: StepTimeConfig) -> None:
        self.config = c = config
        self.arch = a = model_arch.load_architecture(c.architecture_path)
        self.gpu: GPU = gpu(c.gpu)
        self.quant: Quantization = quantization(c.quantization)
        self._bandwidth = self.gpu.memory_bandwidth_bytes_per_s * c.memory_efficiency
        self._flops = self.gpu.sustained_flops(c.power_cap_w) * c.compute_efficiency
        tp = c.tensor_parallel_size
        self._expert_params = model_arch.layer_params(a, 0)["routed_experts"]
        self._expert_bytes = self._bytes("routed_experts", self._expert_params)
        self._max_of_ranks = expected_max_of_normals(tp)
        self._stages = _stages(self, partition(c, a.num_hidden_layers))
        mtp = model_arch.mtp_layer_params(a)
        self._mtp_bytes = self._dense_bytes(mtp)
        self._mtp_params = self._dense_params(mtp)
        head = model_arch.model_params(a)
        self._lm_head_bytes = self._dense_bytes(
            {"lm_head": head["lm_head"], "final_mixer": head["final_mixer"]}
        )
        self._lm_head_params = head["lm_head"] / tp
        # Constants of every micro-batch, worked out once.
        self._gdn_state_bytes_per_request = self._gdn_state_bytes()
        self._gdn_flops_per_token_rank = self._gdn_flops_per_token()
        self._draft_params = self._mtp_params + a.num_experts_per_tok * self._expert_params / tp
        # The last micro-batch's figures: every stage of the pipeline reads
        # the same ones (a reference to the scheduled tuple is kept, so its
        # identity cannot be reused by another tuple).
        self._last_batch: tuple[tuple[ScheduledRequest, ...], _BatchCosts] | None = None

    # ---------------------------------------------------------- interface
    def stage_s(self, output: SchedulerOutput, stage: int) -> float:
        """Seconds stage ``stage`` spends on the micro-batch ``output``."""
        if output.is_empty:
            return 0.0
        c = self.config
        if c.seconds_per_token is not None:
            work = output.total_num_scheduled_tokens * c.seconds_per_token / c.pipeline_parallel_size
            return work + (c.step_overhead_s if stage == c.pipeline_parallel_size - 1 else 0.0)
        costs = self._costs_of(output.scheduled)
        st = self._stages[stage]
        seconds = self._layers_s(st, costs) + st.num_layers * costs.layer_fixed_s
        seconds += st.num_gdn * costs.cut_chunks * c.unfused_cut_chunk_per_gdn_layer_s
        if st.is_first:
            seconds += self._host_gather_s(costs.batch)
        if st.is_last:
            seconds += self._last_stage_extra_s(costs)
        return seconds

    def handoff_s(self, output: SchedulerOutput) -> float:
        """The hidden states (every hyper-connection stream, BF16) sent
        from one stage to the next over PCIe P2P."""
        c = self.config
        if c.seconds_per_token is not None or c.pipeline_parallel_size == 1:
            return 0.0
        message = output.total_num_scheduled_tokens * self.arch.hc_hidden_size * 2
        return c.pp_send_latency_s + message / c.p2p_bandwidth_bytes_per_s

    def step_time_s(self, output: SchedulerOutput) -> float:
        """A synchronous step: the step's requests in ``min(pp, requests)``
        micro-batches pushed through the pipeline (``pipeline_s``)."""
        if output.is_empty:
            return 0.0
        return self.pipeline_s(split(output, min(self.config.pipeline_parallel_size, len(output.scheduled))))

    def pipeline_s(self, micro_batches: list[SchedulerOutput]) -> float:
        """When the last micro-batch leaves the last stage: micro-batch j
        enters stage s when it has left stage s-1 (and crossed the
        hand-off) and stage s has finished micro-batch j-1."""
        pp = self.config.pipeline_parallel_size
        free_at = [0.0] * pp
        for micro in micro_batches:
            ready = 0.0
            for stage in range(pp):
                ready = max(ready, free_at[stage]) + self.stage_s(micro, stage)
                free_at[stage] = ready
                ready += self.handoff_s(micro) if stage < pp - 1 else 0.0
        return free_at[-1]

    # ------------------------------------------------------------- pieces
    def _costs_of(self, scheduled: tuple[ScheduledRequest, ...]) -> _BatchCosts:
        """``_batch`` of ``scheduled`` and what every stage reads of it,
        once per micro-batch, not once per stage."""
        last = self._last_batch
        if last is not None and last[0] is scheduled:
            return last[1]
        batch = _batch(scheduled, self.arch)
        costs = _BatchCosts(
            batch,
            experts_bytes=self._busiest_rank_experts(batch.tokens) * self._expert_bytes,
            kv_bytes=self._kv_bytes(batch),
            attention_flops=self._attention_flops(batch),
            layer_fixed_s=self._layer_fixed_s(batch.tokens),
            cut_chunks=self._cut_chunks(scheduled),
        )
        self._last_batch = (scheduled, costs)
        return costs

    def _cut_chunks(self, scheduled: tuple[ScheduledRequest, ...]) -> int:
        """Chunks the unfused GDN forward pays extra for (none when fused)."""
        c = self.config
        if c.gdn_forward == "fused" or c.block_size is None or c.max_num_batched_tokens is None:
            return 0
        block, budget = c.block_size, c.max_num_batched_tokens
        return sum(
            is_block_cut_chunk(r.num_computed_tokens, r.num_prompt_tokens_left, block, budget)
            for r in scheduled
        )

    def _bytes(self, group: str, params: float) -> float:
        return params * self.quant.bytes_per_param(group)

    def _dense_bytes(self, groups: dict[str, int]) -> float:
        """Per TP rank, routed experts excluded."""
        tp = self.config.tensor_parallel_size
        return sum(
            self._bytes(g, n) / (1 if g in REPLICATED else tp)
            for g, n in groups.items()
            if g != "routed_experts"
        )

    def _dense_params(self, groups: dict[str, int]) -> float:
        tp = self.config.tensor_parallel_size
        return sum(n / (1 if g in REPLICATED else tp) for g, n in groups.items() if g != "routed_experts")

    def _distinct_experts(self, tokens: float) -> float:
        """Experts a batch of ``tokens`` routes to, per layer (top-k of N,
        independent tokens)."""
        a = self.arch
        return a.num_experts * (1 - (1 - a.num_experts_per_tok / a.num_experts) ** tokens)

    def _busiest_rank_experts(self, tokens: float) -> float:
        """The distinct experts the busiest rank reads per layer: expert
        parallel deals the 512 experts over the tp ranks, so a batch's
        ``D`` distinct experts land ``D/tp`` on a rank on average, spread
        as a hypergeometric draw (variance ``D p (1-p) (N-D)/(N-1)``,
        ``p = 1/tp``), and the step waits for the rank that drew the most:
        the mean plus the expected maximum of tp normal deviates."""
        a, tp = self.arch, self.config.tensor_parallel_size
        distinct = self._distinct_experts(tokens)
        if tp == 1:
            return distinct
        share = 1 / tp
        variance = distinct * share * (1 - share) * (a.num_experts - distinct) / (a.num_experts - 1)
        return distinct * share + math.sqrt(max(variance, 0.0)) * self._max_of_ranks

    def _roofline_s(self, bytes_read: float, flops: float) -> float:
        return max(bytes_read / self._bandwidth, flops / self._flops)

    def _layers_s(self, st: _Stage, costs: _BatchCosts) -> float:
        b = costs.batch
        bytes_read = st.dense_bytes + st.num_layers * costs.experts_bytes + st.num_qsa * costs.kv_bytes
        state_round_trips = b.requests + (b.replay_tokens if self.config.recover_ssm_replay else 0.0)
        bytes_read += st.num_gdn * state_round_trips * 2 * self._gdn_state_bytes_per_request
        flops = 2 * b.tokens * st.token_params + st.num_qsa * costs.attention_flops
        flops += st.num_gdn * b.tokens * self._gdn_flops_per_token_rank
        return self._roofline_s(bytes_read, flops) + self._replay_launch_s(st, b)

    def _replay_launch_s(self, st: _Stage, b: _Batch) -> float:
        """RecoverSSM's verify kernels on every GDN layer of a step that
        decodes (the state is replayed, then written back)."""
        c = self.config
        if not (c.recover_ssm_replay and b.replay_tokens):
            return 0.0
        return st.num_gdn * c.replay_kernel_overhead_per_layer_s

    def _kv_bytes(self, b: _Batch) -> float:
        """One QSA layer, one rank: compressed keys (BF16, one head, on every
        rank) and the selected FP8 K and V of the rank's KV heads."""
        a, tp = self.arch, self.config.tensor_parallel_size
        kv_heads = max(1, a.num_key_value_heads // tp)
        selected = 2 * kv_heads * a.head_dim * self.quant.kv_cache_bits / 8
        return b.decode_index_keys * a.indexer_head_dim * 2 + b.decode_topk * selected

    def _attention_flops(self, b: _Batch) -> float:
        """One QSA layer, one rank: the indexer scores compressed keys
        (replicated), attention scores and mixes the top-k (QK and PV)."""
        a, tp = self.arch, self.config.tensor_parallel_size
        indexer = 2 * a.indexer_n_heads * a.indexer_head_dim * b.query_index_keys
        return indexer + 4 * (a.num_attention_heads / tp) * a.head_dim * b.query_topk

    def _gdn_state_bytes(self) -> float:
        """One request's GDN state on one rank: the FP32 recurrent state of
        its value heads and the BF16 conv window."""
        a, tp = self.arch, self.config.tensor_parallel_size
        heads = a.linear_num_value_heads / tp
        conv = (
            2 * a.linear_num_key_heads * a.linear_key_head_dim
            + a.linear_num_value_heads * a.linear_value_head_dim
        )
        return (
            heads * a.linear_key_head_dim * a.linear_value_head_dim * 4
            + conv / tp * (a.linear_conv_kernel_dim - 1) * 2
        )

    def _gdn_flops_per_token(self) -> float:
        a, tp = self.arch, self.config.tensor_parallel_size
        heads = a.linear_num_value_heads / tp
        return self.config.gdn_flops_per_state_entry * heads * a.linear_key_head_dim * a.linear_value_head_dim

    def _layer_fixed_s(self, tokens: float) -> float:
        """Per layer: kernel gaps and two TP all-reduces (attention and MoE
        outputs, BF16 hidden)."""
        return self.config.kernel_overhead_per_layer_s + 2 * self.allreduce_s(
            tokens * self.arch.hidden_size * 2
        )

    def allreduce_s(self, message_bytes: float) -> float:
        """One all-reduce of ``message_bytes`` over the stage's ``n`` TP
        ranks on PCIe P2P: each rank moves ``2 (n-1)/n`` of the message.
        Two ranks and a message under its buffer: vLLM's custom all-reduce
        (one latency). Otherwise NCCL's ring: a base latency and one hop
        latency per ring step (``2 (n-1)`` steps), LL protocol lines
        carrying half data."""
        c, n = self.config, self.config.tensor_parallel_size
        if n == 1:
            return 0.0
        moved = 2 * (n - 1) / n * message_bytes
        if n == 2 and message_bytes < c.custom_allreduce_max_bytes:
            return c.allreduce_latency_s + moved / c.p2p_bandwidth_bytes_per_s
        steps = 2 * (n - 1)
        latency = c.nccl_base_latency_s + steps * c.nccl_hop_latency_s
        ll = latency + moved / (c.p2p_bandwidth_bytes_per_s * c.nccl_ll_efficiency)
        if c.nccl_protocol == "LL":
            return ll
        simple_latency = (
            latency + c.nccl_simple_extra_base_latency_s + steps * c.nccl_simple_extra_hop_latency_s
        )
        return min(ll, simple_latency + moved / c.p2p_bandwidth_bytes_per_s)

    def _host_gather_s(self, b: _Batch) -> float:
        """Token-embedding rows (BF16, the rank's shard) and the PLE n-gram
        rows (one per head) pulled from host memory over PCIe; or, with the
        push transport, the PLE rows' round trip through the offload
        process (its CPU gather and write-back are inside it)."""
        a, c = self.arch, self.config
        row = a.ple_embed_dim // a.ngram_heads
        bytes_read = 0.0
        if "embed_tokens" in self.quant.host:  # else a device gather of a few rows: negligible
            bytes_read += (
                b.tokens * a.hidden_size * self.quant.bytes_per_param("embed_tokens") / c.tensor_parallel_size
            )
        pushed = 0.0
        if a.ple_layer_ids and "ple_table" in self.quant.host:
            if c.ple_transport == "push":
                pushed = c.ple_push_round_trip_s
            else:
                bytes_read += b.tokens * a.ngram_heads * row * self.quant.bytes_per_param("ple_table")
        bandwidth = self.gpu.pcie_bandwidth_bytes_per_s * c.host_read_efficiency
        return c.host_gather_latency_s + bytes_read / bandwidth + pushed

    def _last_stage_extra_s(self, costs: _BatchCosts) -> float:
        """LM head and sampling of the step's rows, then the K MTP draft
        passes (the first over every token, the others one per request),
        each with the draft LM head and sampling; then the step overhead."""
        c, b = self.config, costs.batch
        seconds = self._head_s(b.logit_rows) + c.sampling_s + c.step_overhead_s
        k = c.num_speculative_tokens if self.arch.mtp_num_hidden_layers else 0
        if k:
            seconds += self._draft_pass_s(b.tokens, costs, costs.experts_bytes, costs.layer_fixed_s)
        if k > 1:
            # The later passes are alike (one token per request): priced once.
            later = self._draft_pass_s(
                b.requests,
                costs,
                self._busiest_rank_experts(b.requests) * self._expert_bytes,
                self._layer_fixed_s(b.requests),
            )
            for _ in range(k - 1):
                seconds += later
        return seconds

    def _head_s(self, rows: float) -> float:
        return self._roofline_s(self._lm_head_bytes, 2 * rows * self._lm_head_params)

    def _draft_pass_s(
        self, tokens: float, costs: _BatchCosts, experts_bytes: float, layer_fixed_s: float
    ) -> float:
        """One MTP pass over ``tokens``: its QSA layer (reading the
        requests' draft KV like any QSA layer; ``experts_bytes`` and
        ``layer_fixed_s`` are those of ``tokens``), the LM head for one row
        per request, draft sampling."""
        bytes_read = self._mtp_bytes + experts_bytes + costs.kv_bytes
        layer = self._roofline_s(bytes_read, 2 * tokens * self._draft_params) + layer_fixed_s
        return layer + self._head_s(costs.batch.requests) + self.config.sampling_s


def is_block_cut_chunk(
    num_computed_tokens: int, num_prompt_tokens: int, block_size: int, budget: int
) -> bool:
    """Whether a prefill chunk ends on a block boundary short of the chunk
    budget: vLLM's align mode cuts the chunk there so the GDN state is
    written at the boundary (a prompt whose end falls on a boundary counts
    its last chunk too: the step does not say which chunk is the last). A
    3,392-token block under a 1,024-token budget is three full chunks and
    one cut one; a 4,096-token block is four full ones; a prompt's last
    chunk ends where the prompt does::

        block 3,392: |1024|1024|1024|320|1024|1024|1024|320| ...  cut: the 320s
        block 4,096: |1024|1024|1024|1024|1024| ...              none cut

    >>> is_block_cut_chunk(3072, 320, 3392, 1024), is_block_cut_chunk(3072, 1024, 4096, 1024)
    (True, False)
    >>> is_block_cut_chunk(6784, 144, 3392, 1024)  # the 10,000-token prompt's last chunk
    False
    """
    end = num_computed_tokens + num_prompt_tokens
    return 0 < num_prompt_tokens < budget and end % block_size == 0


@functools.cache
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normal deviates]: the integral of
    ``x n phi(x) Phi(x)^(n-1)`` (0.5642 for two, 1.0294 for four)."""
    if n <= 1:
        return 0.0
    normal = statistics.NormalDist()
    step, total = 0.002, 0.0
    for i in range(-5000, 5001):
        x = i * step
        total += x * n * normal.pdf(x) * normal.cdf(x) ** (n - 1) * step
    return total


def partition(c: StepTimeConfig, num_layers: int) -> tuple[int, ...]:
    """Layers per stage: the configured partition, else vLLM's split."""
    if c.layer_partition is not None:
        return c.layer_partition
    return even_partition(num_layers, c.pipeline_parallel_size)


def even_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's default split (``get_pp_indices``): even, one more layer on
    each of the ``remainder`` stages before the last (the last holds the
    final norm)."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if pp - 1 - extra <= stage < pp - 1 else 0) for stage in range(pp))


def _stages(model: StepTimeModel, layers_per_stage: tuple[int, ...]) -> list[_Stage]:
    a = model.arch
    stages: list[_Stage] = []
    first = 0
    for index, count in enumerate(layers_per_stage):
        layers = range(first, min(first + count, a.num_hidden_layers))
        groups: dict[str, float] = {}
        for layer in layers:
            for group, n in model_arch.layer_params(a, layer).items():
                groups[group] = groups.get(group, 0) + n
            if a.is_ple_layer(layer):
                groups["ple_module"] = groups.get("ple_module", 0) + model_arch.ple_params(a)["ple_module"]
        num_layers = len(layers)
        dense_params = model._dense_params(groups)  # type: ignore[arg-type]
        experts_params = (
            num_layers * a.num_experts_per_tok * model._expert_params / model.config.tensor_parallel_size
        )
        stages.append(
            _Stage(
                num_layers=num_layers,
                num_qsa=sum(a.is_qsa_layer(i) for i in layers),
                num_gdn=sum(not a.is_qsa_layer(i) for i in layers),
                dense_bytes=model._dense_bytes(groups),  # type: ignore[arg-type]
                is_first=index == 0,
                is_last=index == len(layers_per_stage) - 1,
                token_params=dense_params + experts_params,
            )
        )
        first += count
    return stages


def _batch(scheduled: tuple[ScheduledRequest, ...], a: model_arch.Architecture) -> _Batch:
    tokens = rows = decode_keys = decode_topk = query_keys = query_topk = replay = 0.0
    ratio, budget = a.indexer_compress_ratio, a.indexer_budget
    # Unpacked, not read by name, and ``min`` written out (``budget if budget
    # < x else x`` is ``min(x, budget)``): it runs for every request of every step.
    for _, n, context, _, prompt_tokens_left, _ in scheduled:
        tokens += n
        # Query tokens see on average the context plus half the new tokens.
        keys = context + (n + 1) / 2
        query_keys += n * keys / ratio
        query_topk += n * (budget if budget < keys else keys)
        if prompt_tokens_left == 0:  # a decode (``ScheduledRequest.is_decode``)
            rows += n
            replay += n - 1
            decode_keys += (context + n) / ratio  # read once for the request's tokens
            seen = context + n
            decode_topk += budget if budget < seen else seen
        else:
            rows += 1
            decode_keys += (context + n) / ratio  # a prefill chunk reads its context's keys once too
    return _Batch(
        tokens=tokens,
        requests=float(len(scheduled)),
        logit_rows=rows,
        decode_index_keys=decode_keys,
        decode_topk=decode_topk,
        query_index_keys=query_keys,
        query_topk=query_topk,
        replay_tokens=replay,
    )


def split(output: SchedulerOutput, parts: int) -> list[SchedulerOutput]:
    """The step's requests dealt round-robin into ``parts`` micro-batches."""
    if parts <= 1:
        return [output]
    return [
        SchedulerOutput(step_index=output.step_index, scheduled=output.scheduled[part::parts])
        for part in range(parts)
    ]
