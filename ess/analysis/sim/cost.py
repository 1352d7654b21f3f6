"""Decode-step cost model of DeepSeek-V3.2 (and V3) on a PD decode instance: one GPU of a data-parallel-attention,
expert-parallel deployment.

Every operator is a roofline: max(FLOPs / (peak x eta_compute), bytes / (HBM x eta_memory)). MoE layers add the EP
dispatch (FP8) and combine (bf16) all-to-all over the scale-out network. A step is the MTP draft passes (M passes of
the one-layer MTP module with B tokens, then its LM head) and the verify pass (all layers with T = B (M + 1) tokens,
LM head on T tokens). Two-Batch Overlap runs two half batches so that one's all-to-all hides under the other's
compute: a layer costs max(2 compute(T/2), 2 comm(T/2)) instead of compute(T) + comm(T).

ESS adds, per DSA layer, the H2D of the layer's misses (B x misses x 656 B at the FlashTrans bandwidth, plus a
launch latency) and places it per overlap mode on a copy stream beside the compute stream:
  none  serial after the indexer (SGLang HiSparse): all of it exposed;
  da    starts after the indexer and top-k, hides under PreAttn + Attn0 (all but the misses); costs a second
        attention launch and the log-sum-exp merge;
  dba   the indexer runs in two batch halves; half A's H2D hides under half B's indexer, half B's under
        PreAttn + Attn0; costs as da plus one more indexer launch.
The step's own rows go back to the host (D2H) on the copy stream after the layer's H2D; they are off the critical
path in every mode and reported, not charged. ESS's own terms (the H2D of a number of rows, the LRU step, what DA and
DBA add) come from an `EssCosts`: `modelled(cal)` (assumed constants) or ess.analysis.sim.measured (a GPU run's).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ess.core.memory import cache_bytes
from ess.core.settings import OVERLAP_MODES, PAGE_TOKENS
from ess.analysis.sim.specs import GIB, Hardware, ModelSpec

MODES = OVERLAP_MODES + ("plan",)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Efficiency constants. Fitted ones are refitted by `ess sim calibrate` on the paper's baseline rows only."""

    eta_compute: float  # fitted: achieved share of tensor-core peak
    eta_net: float  # fitted: achieved share of the scale-out NIC bandwidth in the EP all-to-all
    layer_overhead_us: float  # fitted: per layer and forward pass (launches, norms, routing, small kernels)
    a2a_latency_us: float = 0.0  # fitted: fixed latency of one MoE layer's dispatch + combine
    eta_memory: float = 0.8  # assumed: achieved share of HBM bandwidth (typical of large streaming kernels)
    mem_fraction_static: float = 0.85  # assumed: SGLang's static memory share for weights + caches
    runtime_reserve_gb: float = 2.5  # assumed: DeepEP buffers, CUDA-graph pools, activations (decimal GB)
    h2d_gbps: float = 37.0  # FlashTrans H2D on PCIe 5 (ESS paper)
    d2h_gbps: float = 43.0  # FlashTrans D2H on PCIe 5 (ESS paper)
    copy_latency_us: float = 5.0  # assumed: one FlashTrans launch
    split_attention_us: float = 8.0  # assumed: the second attention launch and the merge of DA / DBA
    split_indexer_us: float = 30.0  # assumed: DBA runs top-k, the LRU update and a FlashTrans launch twice


@dataclasses.dataclass(frozen=True)
class Deployment:
    ep: int = 32  # GPUs that share the experts
    gpus_per_node: int = 8
    tbo: bool = True

    @property
    def nodes(self) -> int:
        return max(1, self.ep // self.gpus_per_node)


def _roofline(flops: float, bytes_: float, peak_tflops: float, hw: Hardware, cal: Calibration) -> float:
    """Seconds."""
    return max(flops / (peak_tflops * 1e12 * cal.eta_compute), bytes_ / (hw.hbm_tbps * 1e12 * cal.eta_memory))


@dataclasses.dataclass
class LayerCost:
    """Seconds of one layer's phases on the compute stream (for T tokens of B requests at context L)."""

    pre_indexer: float  # q_a / kv_a projections and norms
    indexer: float  # indexer projections, logits over the context, top-k
    pre_attn: float  # q_b, w_kc absorption, RoPE
    attention: float  # sparse (or dense) MLA
    post: float  # w_vc, o_proj, FFN or MoE compute
    comm: float  # EP all-to-all of this layer (0 for dense layers)

    @property
    def compute(self) -> float:
        return self.pre_indexer + self.indexer + self.pre_attn + self.attention + self.post


def layer_cost(spec: ModelSpec, hw: Hardware, cal: Calibration, dep: Deployment, T: float, B: float, L: float, moe: bool,
               rest=None, indexer=None) -> LayerCost:
    """rest: the measured rest of a layer (ess.analysis.sim.measured.MeasuredRest) in place of the roofline's post;
    indexer: the measured logits and top-k (MeasuredIndexer) in place of the roofline's."""
    fp8, bf16 = hw.fp8_tflops, hw.bf16_tflops
    p = spec.mla_params
    pre_indexer = _roofline(2 * T * (p["q_a"] + p["kv_a"]), p["q_a"] + p["kv_a"], fp8, hw, cal)
    if spec.index_heads:
        idx_proj = _roofline(2 * T * spec.indexer_params, spec.indexer_params, fp8, hw, cal)
        logits = _roofline(2 * T * spec.index_heads * spec.index_dim * L, B * L * spec.index_row_bytes, fp8, hw, cal)
        topk = _roofline(0, 2 * 4 * T * L, fp8, hw, cal)
        indexer = idx_proj + (logits + topk if indexer is None else indexer.time(T, L))
    else:
        indexer = 0.0
    pre_attn = _roofline(2 * T * p["q_b"], p["q_b"], fp8, hw, cal) + _roofline(2 * T * p["w_kc"], 2 * p["w_kc"], bf16, hw, cal)
    k_eff = min(spec.index_topk, L) if spec.index_topk else L
    attn_flops = 2 * T * spec.heads * (2 * spec.kv_lora + spec.rope) * k_eff
    # Sparse decode gathers each query token's own rows; dense decode streams each request's cache once.
    attn_bytes = T * k_eff * spec.latent_row_bytes if spec.index_topk else B * L * spec.latent_row_bytes
    attention = _roofline(attn_flops, attn_bytes, bf16, hw, cal)
    post = _roofline(2 * T * p["w_vc"], 2 * p["w_vc"], bf16, hw, cal) + _roofline(2 * T * p["o"], p["o"], fp8, hw, cal)
    if moe:
        # Balanced EP: each GPU serves T x experts_per_token (token, expert) pairs on its experts, plus the shared one.
        pairs = T * spec.experts_per_token
        experts_here = math.ceil(spec.experts / dep.ep)
        w = (min(experts_here, pairs) + spec.shared_experts) * spec.expert_params
        post += _roofline(2 * (pairs + T * spec.shared_experts) * spec.expert_params, w, fp8, hw, cal)
        post += _roofline(2 * T * spec.hidden * spec.experts, 4 * spec.hidden * spec.experts, bf16, hw, cal)
        comm = _all_to_all(spec, hw, cal, dep, T)
    else:
        post += _roofline(2 * T * 3 * spec.hidden * spec.dense_inter, 3 * spec.hidden * spec.dense_inter, fp8, hw, cal)
        comm = 0.0
    if rest is not None:
        post = rest.post(T, moe)
    return LayerCost(pre_indexer, indexer, pre_attn, attention, post, comm)


def _all_to_all(spec: ModelSpec, hw: Hardware, cal: Calibration, dep: Deployment, T: float) -> float:
    """Dispatch (FP8 hidden) and combine (bf16 hidden) of T tokens to the distinct GPUs of their experts."""
    if dep.ep <= 1:
        return 0.0
    per_gpu = spec.experts / dep.ep
    # Expected distinct GPUs among a token's experts (uniform routing without replacement).
    miss_all = math.prod((spec.experts - per_gpu - i) / (spec.experts - i) for i in range(spec.experts_per_token))
    targets = dep.ep * (1 - miss_all)
    bytes_ = T * targets * spec.hidden * 3
    remote = (dep.nodes - 1) / dep.nodes
    return cal.a2a_latency_us * 1e-6 + bytes_ * remote / (hw.net_gbps * 1e9 * cal.eta_net) + bytes_ * (1 - remote) / (hw.nvlink_gbps * 1e9 * cal.eta_net)


def _pass_time(costs: list[LayerCost], half: list[LayerCost] | None, cal: Calibration, extra: list[float]) -> float:
    """One forward pass over layers; `half` holds the same layers at T/2 when Two-Batch Overlap is on."""
    total = 0.0
    for i, c in enumerate(costs):
        if half is not None:
            h = half[i]
            t = max(2 * (h.compute + extra[i] / 2), 2 * h.comm)
        else:
            t = c.compute + extra[i] + c.comm
        total += t + cal.layer_overhead_us * 1e-6
    return total


def lm_head_time(spec: ModelSpec, hw: Hardware, cal: Calibration, T: float) -> float:
    return _roofline(2 * T * spec.hidden * spec.vocab, 2 * spec.hidden * spec.vocab, hw.bf16_tflops, hw, cal)


@dataclasses.dataclass
class EssSetting:
    sparse_ratio: float
    misses: list[float]  # per layer (verify layers, then the MTP layer): mean misses per request-step
    modes: list[str]  # per layer: none | da | dba


class EssCosts:
    """ESS's own terms, in seconds. This class holds the modelled ones (assumed constants of a Calibration);
    ess.analysis.sim.measured.MeasuredCosts reads them from a GPU run. `source` names where they come from."""

    rest = None  # the rest of a layer: modelled (the roofline); MeasuredCosts may hold a measured one
    indexer = None  # the indexer's logits and top-k: the same

    def __init__(self, cal: Calibration, row_bytes: int):
        self.cal, self.row_bytes = cal, row_bytes
        self.source = "modelled"

    def h2d(self, rows: float) -> float:
        """FlashTrans H2D of `rows` latent rows in one launch."""
        if rows <= 0:
            return 0.0
        return rows * self.row_bytes / (self.cal.h2d_gbps * 1e9) + self.cal.copy_latency_us * 1e-6

    def d2h(self, rows: float) -> float:
        return 0.0 if rows <= 0 else rows * self.row_bytes / (self.cal.d2h_gbps * 1e9) + self.cal.copy_latency_us * 1e-6

    def lru(self, batch: float, rows_per_step: int, slots: float | None = None) -> float:
        """One layer's LRU step for `batch` requests of `rows_per_step` query rows and `slots` GPU slots each: not
        modelled (0)."""
        return 0.0

    def describe(self) -> dict:
        return {"source": self.source}

    def split(self, mode: str, batch: float, misses: float = 0.0) -> float:
        """What an overlap mode adds to a layer's compute: DA a second attention launch and the merge, DBA also a
        second top-k, LRU update and FlashTrans launch (misses per request: unused by the modelled terms)."""
        us = {"none": 0.0, "da": self.cal.split_attention_us,
              "dba": self.cal.split_attention_us + self.cal.split_indexer_us}
        if mode not in us:
            raise ValueError(f"overlap mode must be one of none, da, dba; got {mode!r}")
        return us[mode] * 1e-6


def modelled(cal: Calibration, spec: ModelSpec) -> EssCosts:
    return EssCosts(cal, spec.latent_row_bytes)


def exposed_transfer(c: LayerCost, h2d: float, mode: str, costs: EssCosts, batch: float,
                     misses: float = 0.0, other: LayerCost | None = None) -> tuple[float, float]:
    """(exposed H2D seconds, added compute seconds) of one layer's misses (`misses` per request) under an overlap mode.
    A split mode costs its extra launches even when no row misses: a captured step cannot skip them.
    other: the decode stack's dba under two-batch overlap (benchmark/decode_gpu.py --tbo; docs/gpu.md): the other
    micro-batch's layer (half the tokens); each micro-batch's half of the H2D hides under the other's post-attention
    compute and all-to-all, and one attention call follows (nothing added)."""
    if mode == "dba" and other is not None:
        return 2 * max(0.0, h2d / 2 - (other.post + other.comm)), 0.0
    added = costs.split(mode, batch, misses)
    if mode == "none" or h2d <= 0:
        return h2d, added
    hide = c.pre_attn + c.attention  # Attn0 covers nearly all rows: misses are a small share of top-k
    if mode == "da":
        return max(0.0, h2d - hide), added
    i = c.indexer  # dba
    a_end = i / 2 + h2d / 2
    b_end = max(i, a_end) + h2d / 2
    return max(0.0, b_end - (i + hide)), added


def h2d_seconds(B: float, misses: float, costs: EssCosts) -> float:
    """One layer's H2D: B requests' misses in one FlashTrans launch."""
    return costs.h2d(B * misses)


@dataclasses.dataclass
class StepResult:
    step_s: float
    verify_s: float
    draft_s: float
    exposed_transfer_s: float
    h2d_bytes: float
    d2h_bytes: float
    per_layer_exposed_s: list[float]
    lru_s: float = 0.0  # ESS's LRU steps of the step (verify and draft layers)
    split_s: float = 0.0  # what DA / DBA added to the step's compute


def step_time(
    spec: ModelSpec,
    hw: Hardware,
    cal: Calibration,
    dep: Deployment,
    batch: float,
    context: float,
    mtp: int,
    ess: EssSetting | None = None,
    costs: EssCosts | None = None,
) -> StepResult:
    """One decode step (draft + verify) on one GPU; `costs`: ESS's own terms (default: modelled)."""
    B = float(batch)
    T = B * (mtp + 1)
    n_layers = spec.layers + (1 if mtp else 0)
    if ess is not None and (len(ess.misses) != n_layers or len(ess.modes) != n_layers):
        raise ValueError(f"ESS setting needs {n_layers} per-layer misses and modes")

    ess_costs = costs or modelled(cal, spec)
    rest, indexer = ess_costs.rest, ess_costs.indexer

    def layers_at(tokens: float) -> list[LayerCost]:
        return [layer_cost(spec, hw, cal, dep, tokens, B, context, moe=i >= spec.dense_layers, rest=rest,
                           indexer=indexer) for i in range(spec.layers)]

    def head(tokens: float) -> float:
        return lm_head_time(spec, hw, cal, tokens) if rest is None else rest.lm_head(tokens)

    layers = layers_at(T)
    half = layers_at(T / 2) if dep.tbo else None
    extra = [0.0] * spec.layers
    exposed = [0.0] * n_layers
    h2d_bytes = 0.0
    draft_cost = layer_cost(spec, hw, cal, dep, B, B, context, moe=True, rest=rest, indexer=indexer) if mtp else None
    lru_s = split_s = 0.0
    if ess is not None:
        # The LRU step runs on the compute stream before the H2D, per micro-batch under TBO; verify layers track
        # mtp + 1 query rows per request, the MTP layer one.
        micro = 2 if dep.tbo else 1
        slots = math.ceil(ess.sparse_ratio * context)
        lru_verify = micro * ess_costs.lru(B / micro, mtp + 1, slots)
        lru_draft = ess_costs.lru(B, 1, slots)
        for i in range(n_layers):
            verify_layer = i < spec.layers
            c = layers[i] if verify_layer else draft_cost
            h = h2d_seconds(B, ess.misses[i], ess_costs)
            times = 1 if verify_layer else mtp
            h2d_bytes += B * ess.misses[i] * spec.latent_row_bytes * times
            e, added = exposed_transfer(c, h, ess.modes[i], ess_costs, B, ess.misses[i])
            lru = lru_verify if verify_layer else lru_draft
            exposed[i] = e * times
            lru_s += lru * times
            split_s += added * times
            if verify_layer:
                extra[i] = e + added + lru
            else:
                draft_extra = e + added + lru
    verify = _pass_time(layers, half, cal, extra) + head(T)
    draft = 0.0
    if mtp:
        per_draft = draft_cost.compute + draft_cost.comm + cal.layer_overhead_us * 1e-6 + head(B)
        if ess is not None:
            per_draft += draft_extra
        draft = mtp * per_draft
    d2h_bytes = T * n_layers * spec.latent_row_bytes if ess is not None else 0.0
    return StepResult(verify + draft, verify, draft, sum(exposed), h2d_bytes, d2h_bytes, exposed, lru_s, split_s)


# ---- memory --------------------------------------------------------------------------------------------------


def cache_budget_bytes(spec: ModelSpec, hw: Hardware, cal: Calibration, dep: Deployment) -> float:
    return hw.memory_gib * GIB * cal.mem_fraction_static - spec.weight_bytes_per_gpu(dep.ep) - cal.runtime_reserve_gb * 1e9


def request_bytes(spec: ModelSpec, context: float, sparse_ratio: float | None = None) -> float:
    """Device cache bytes of one request (ess.core.memory.cache_bytes) at a context, with ESS at a ratio."""
    slots = None if sparse_ratio is None else math.ceil(sparse_ratio * context)
    return cache_bytes(spec.layers, context, spec.latent_row_bytes, spec.index_row_bytes, slots)


def host_request_bytes(spec: ModelSpec, context: float) -> float:
    """Pinned host bytes of one ESS request: every token's latent row on every layer (the Total Memory Pool)."""
    return spec.layers * context * spec.latent_row_bytes


def max_batch_host(spec: ModelSpec, hw: Hardware, context: float) -> int:
    """The host-memory wall: the largest ESS batch per GPU whose Total Memory Pool fits the GPU's pinnable share."""
    return max(0, int(hw.host_budget_bytes() // host_request_bytes(spec, context)))


SECTOR_BYTES = 4096  # the drive's read granularity (direct I/O)


def sectors_per_row(row_bytes: int) -> float:
    """Mean 4 KiB sectors one latent row spans in a disk page (rows packed from the 4 KiB-aligned page's start)."""
    start = np.arange(PAGE_TOKENS) * row_bytes
    return float(np.mean((start + row_bytes - 1) // SECTOR_BYTES - start // SECTOR_BYTES + 1))


def disk_share(spec: ModelSpec, batch: float, context: float, host_budget_bytes: float) -> float:
    """The share of the batch's latent pages past the host budget: on disk."""
    need = batch * host_request_bytes(spec, context)
    return max(0.0, 1.0 - host_budget_bytes / need) if need > 0 else 0.0


def disk_read_seconds(spec: ModelSpec, hw: Hardware, rows: float, nvme_gbps_per_node: float,
                      nvme_kiops_per_node: float) -> tuple[float, float]:
    """A disk tier under the Total Memory Pool (docs/design.md, "Disk tier") reading `rows` missing rows of one step at
    the drive's granularity: each row one read of the 4 KiB sectors that hold it (adjacent missing rows read as
    one would cost less: an upper bound), bounded by the node's drives' bandwidth and IOPS, shared by its GPUs, and
    exposed (the layer's H2D waits for it). (bytes read, seconds)."""
    read = rows * sectors_per_row(spec.latent_row_bytes) * SECTOR_BYTES
    per_gpu = hw.gpus_per_node
    seconds = max(read / (nvme_gbps_per_node * 1e9 / per_gpu), rows / (nvme_kiops_per_node * 1e3 / per_gpu))
    return read, seconds


def max_batch(spec: ModelSpec, hw: Hardware, cal: Calibration, dep: Deployment, context: float, sparse_ratio: float | None = None) -> int:
    return max(0, int(cache_budget_bytes(spec, hw, cal, dep) // request_bytes(spec, context, sparse_ratio)))
