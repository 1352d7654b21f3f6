"""Decode throughput on one GPU: ESS against the whole-cache baseline, each at its largest batch under the memory wall.

An L-layer DeepSeek-V3.2 decode stack at the full dimensions (128 heads, top-k 2048, 656-byte FP8 latent rows, 132-byte
index-K rows; random weights, shared by the layers: time does not depend on their values). Per layer, measured:
q_a and kv_a projections, the indexer (index-K of the whole context, logits, top-k 2048), PreAttn (q_b, w_kc, RoPE),
the cache step and FlashMLA's sparse FP8 decode; for ESS the LRU step (fused kernel on a GPU), FlashTrans H2D of the
misses and D2H of the own rows, in the mode's order (ess.reference.overlap). Then the rest of each layer, measured
(`--rest measured`, the default; ess.reference.layer_rest): w_vc, o_proj, the norm, the router, this GPU's share of
the routed experts under EP `--ep` as grouped GEMMs, the shared expert, and the LM head once a step; the EP all-to-all
is the one modelled part, a one-SM spin of the simulator's length (docs/gpu.md, "The whole layer"). `--rest
modelled`: the simulator's time for the rest, added to the measured attention path (the hybrid figures before).

Memory: the per-layer cache budget of the paper's deployment (the simulator's per-GPU cache budget / 61 x L). The
baseline holds latent and index-K of every token on the GPU; ESS holds index-K of every token, and residency first
(ess.core.residency, docs/design.md): the rest of the budget is one pool of latent rows, in which as many requests as
fit are RESIDENT (every row of theirs on the GPU: no LRU step, no transfer; with none offloaded the step skips the
policy altogether) and the others OFFLOADED with C = ratio x context slots each (`--residency off`: every request
offloaded, as before 2026-11-27). Each arm runs at the batches of `--batches` (default 1, 2, 8, 32), at the
baseline's memory wall and at its own largest batch (ESS per ratio). A batch with every request resident runs mode
none only: with nothing offloaded there is nothing to overlap, and the step is the same in every mode.
Mode `hisparse` is the arm a user would pick instead: SGLang's HiSparse policy at its defaults, modelled on this
stack (docs/gpu.md, "The HiSparse arm").

Top-k: replayed from a SYNTHETIC trace (ess trace synth at the context; `--topk-source synth`, the default: the
locality the ESS paper reports, not a measurement) or the computed indexer's (`indexer`: random weights, no locality,
the worst case). With a trace, the cache starts from LRU-Warmup and `--warm-steps` eager steps of the trace; the
timed step is the next one, replayed as a CUDA graph from the same state each time. `exposed_transfer_ms` is the
step's time minus its time with every selected row resident.
`--fit [FILE]`: ESS's and HiSparse's largest batches again with the locality of
the generator fitted to real traces (default: the SmolLM2 fit), rows labelled `locality`.

`--tbo`: every arm from batch 2 as two micro-batches under two-batch overlap, in SGLang's decode order
(ess.reference.decode_stack.TwoBatch; docs/gpu.md, "Two-batch overlap"); mode dba there hides each micro-batch's H2D
under the other's experts and all-to-all.

    python benchmark/decode_gpu.py --out benchmark/results/gpu/<device>     # on a GPU (the sgl-flash-mla wheel)
    python benchmark/decode_gpu.py --smoke --out /tmp/decode                 # a CPU run of tiny shapes: checks the script

MTP verify (`--query-rows 1,3`, the default): 3 query rows per request at consecutive positions, one LRU step over
their union with 3 own tokens (as the plugin runs target-verify), FlashMLA over every row; the draft passes are
modelled (the simulator's), and a verify step yields `--accept` tokens per request (1.7). A ratio whose slots cannot
hold 3 x (top-k + 1) is skipped, as the plugin refuses it. `--check` compares every ESS mode's attention outputs with
the baseline's (the smoke run does).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import platform
import sys
import time

import torch

from ess.analysis.sim import cost
from ess.analysis.sim.engine import load_calibration, plan_modes
from ess.analysis.sim.measured import MeasuredError, load_measured
from ess.analysis.sim.paper import EP, HARDWARE as PAPER_HARDWARE
from ess.analysis.sim.specs import get_hardware, get_model
from ess.analysis.synth import SynthOptions, synth_trace
from ess.analysis.synth_fit import load_fitted, scaled
from ess.analysis.decode_report import plot, summary
from ess.analysis.timing import graph_us, median_us
from ess.core import layout
from ess.core.kernels import flashtrans, indexer
from ess.core.memory import cache_bytes, hisparse_largest_batch, largest_batch
from ess.core.pinned import pinned_zeros
from ess.core.settings import WARMUP_WINDOWS
from ess.reference import attention as A
from ess.reference.config import get_config
from ess.reference.decode_stack import Setup, Stack, make_stack, two_batch
from ess.reference.flashmla import sparse_decode
from ess.reference.layer_rest import LayerRest, MoeShape, RestWeights, comm_wait, spin_cycles_per_us

# the command line (benchmark/decode_flags.py), loaded by its path: this folder is on sys.path when the script runs,
# not when a test loads the script by its path
CLI_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_flags.py")
_spec = importlib.util.spec_from_file_location("decode_flags", CLI_PATH)
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)

# The HiSparse arm: SGLang 0.5.23's --enable-hisparse at its defaults, as its source sets them (docs/gpu.md, "The
# HiSparse arm"): a device buffer of 2 x top-k LRU slots per request and layer plus a page it reserves, the step's
# misses copied before attention on the forward stream (no overlap), the first buffer-full of prompt tokens resident
# when decode starts, and a logical token space twice its device latent pool (host_to_device_ratio 2,
# ess.core.memory.HISPARSE_HOST_RATIO).
HISPARSE_BUFFER_PER_TOPK = 2
MODEL_LAYERS = 61  # DeepSeek-V3.2's decoder layers, for the per-model figures


def smoke_setup() -> Setup:
    cfg = get_config("mini", num_layers=2)
    return Setup(cfg, 2, [256], [0.6], [1, 2], 2, 1, torch.device("cpu"), "reference", 3, [1, 2], check=True)


def gpu_setup(args) -> Setup:
    if not torch.cuda.is_available():
        raise SystemExit("decode_gpu.py: needs a CUDA device (or --smoke)")
    return Setup(get_config("full", num_layers=args.layers), args.layers, args.contexts, args.ratios, args.batches,
                 args.warm_steps, args.iters, torch.device("cuda"), "flashmla", args.max_batch, args.query_rows,
                 args.check, cli.DTYPES[args.dtype or "bf16"])


def trace_topk(s: Setup, batch: int, context: int, rows: int, fitted: SynthOptions | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """SYNTHETIC top-k (ess trace synth at this context, with the ESS paper's locality, or `fitted`'s: a fit to
    real traces carried to this shape, ess.analysis.synth_fit.scaled): decode sets [steps, L, B * S, K] (query row j
    of step t replays trace step t * S + j, at the same position) and warm-up sets [L, B, W, K]; request b replays
    trace request b mod 4."""
    K, steps = s.cfg.index_topk, s.warm_steps + 1
    shape = dict(requests=min(batch, 4), steps=steps * rows, layers=s.layers, warmup_windows=WARMUP_WINDOWS,
                 seed=context)
    if fitted is not None:
        opt = dataclasses.replace(scaled(fitted, K, context), **shape)
    else:
        opt = SynthOptions(topk=K, context=context, sinks=4, window=min(128, K // 8), churn_min=min(8, K // 16),
                           churn_max=min(600, K // 4), pool=min(8192, context // 2), **shape)
    tr = synth_trace(opt)
    reqs = [b % tr.topk.shape[0] for b in range(batch)]
    decode = torch.as_tensor(tr.topk[reqs]).reshape(batch, steps, rows, s.layers, K)  # [B, steps, S, L, K]
    decode = decode.permute(1, 3, 0, 2, 4).reshape(steps, s.layers, batch * rows, K).contiguous()
    warm = torch.as_tensor(tr.prefill_topk[reqs]).permute(2, 0, 1, 3).contiguous()  # [L, B, W, K]
    return decode.to(s.device), warm.to(s.device)


def measure(s: Setup, modes: list[str], batch: int, context: int, ratio: float | None, rows: int, source: str,
            plan, budget: float | None = None, rest=None, fitted: SynthOptions | None = None) -> dict:
    """The attention path of one decode (rows 1) or MTP verify step of the L layers, per mode, on one stack (the
    baseline's, or ESS's at `ratio`, residency first in `budget` when given): {mode: {"attention_ms", "exposed_ms",
    "misses" (ESS: per request and layer), "modes" (plan), "resident" (requests)}}. plan(per_layer_misses, batch,
    context) -> modes, for mode "plan". rest: the rest of each layer, measured (Stack's argument), with its parts
    under "rest"."""
    hisparse = ratio == "hisparse"
    if hisparse:  # its LRU slots, plus one for the step's own row (HiSparse keeps that in its reserved page)
        buffer = hisparse_slots(s) + 1
    else:
        buffer = None if ratio is None else slots(s, ratio, context)
    decode, warm = trace_topk(s, batch, context, rows, fitted) if source == "synth" else (None, None)
    if hisparse:  # decode starts with the prompt's first buffer-full resident, not LRU-Warmup's sets
        first = torch.arange(min(hisparse_slots(s), context), device=s.device, dtype=torch.int32)
        warm = first.expand(s.layers, batch, 1, first.numel())
        modes = ["none"]
    stack = make_stack(s, batch, context, buffer, rows, decode, warm, None if hisparse else budget, rest)
    all_resident = not hisparse and stack.all_resident()
    if all_resident:  # nothing offloaded: nothing to overlap, every mode is the same step (module docstring)
        modes = ["none"]
    t = s.warm_steps
    for i in range(t):  # the cache's state before the timed step: the same requests' earlier steps
        stack.step(i, "baseline" if buffer is None else "none")  # every ESS mode leaves the same LRU state
    timer = graph_us if s.device.type == "cuda" else median_us
    rest_ms = rest_times(stack.first, t, timer)  # under two-batch overlap: micro-batch A's
    if buffer is None:
        return {"baseline": {"attention_ms": timer(lambda: stack.step(t, "baseline"), s.iters) / 1e3,
                             "exposed_ms": 0.0, "misses": None, "parts_ms": part_times(stack.first, t, timer),
                             "rest": rest_ms}}
    # the timed replays restore the LRU tables only (they decide the misses; row contents do not change the time); the
    # check restores the GPU pool's rows as well
    def state():
        return stack.state(s.check)

    snap = [x.clone() for x in state()]

    def restore(saved=snap):
        for x, y in zip(state(), saved):
            x.copy_(y)

    stack.clear_misses()
    stack.step(t, "none")  # eager, from the snapshot: the timed step's misses, per layer
    per_layer = stack.layer_misses()
    want = None
    if s.check:  # lossless: the baseline's stack, same inputs, gives the outputs every ESS mode must give
        base = make_stack(s, batch, context, None, rows, decode, warm)
        for i in range(t):
            base.step(i, "baseline")
        want = base.step(t, "baseline")
        del base
    stack.without_misses(t)
    resident = [x.clone() for x in state()]
    out = {}
    for mode in modes:
        stack.modes = plan(per_layer, batch, context) if mode == "plan" else []
        diff = None
        if want is not None:
            restore()
            got = stack.step(t, mode)
            diff = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
        attn_us = timer(lambda: stack.step(t, mode), s.iters, restore)
        free_us = attn_us if all_resident else timer(lambda: stack.step(t, mode), s.iters, lambda: restore(resident))
        out[mode] = {"attention_ms": attn_us / 1e3, "exposed_ms": max(0.0, attn_us - free_us) / 1e3,
                     "misses": sum(per_layer) / len(per_layer), "modes": list(stack.modes) or None, "diff": diff,
                     "resident": stack.resident}
    restore()
    parts = part_times(stack.first, t, timer, restore)
    probe = parts.pop("h2d_probe", None) if parts else None
    if all_resident:
        probe = None  # nothing moves
    for m in out.values():
        m["parts_ms"], m["h2d_probe"], m["rest"] = parts, probe, rest_ms
    return {"hisparse": out["none"]} if hisparse else out


def rest_times(stack: Stack, t: int, timer) -> dict | None:
    """One layer's measured rest, each timed alone (ms): the MoE layer's (w_vc, o_proj, norm, router, dispatch wait,
    routed experts, shared expert, combine wait), its attention output projections and routed experts alone, the dense
    layer's rest, the two waits alone against their modelled length, and the LM head. None where the stack models the
    rest."""
    rest = stack.rest
    if rest is None:
        return None
    s, h = stack.s, stack.h[t]
    o = torch.randn(h.shape[0], s.cfg.num_heads, layout.NOPE_DIM, device=s.device).to(h.dtype)

    def ms(fn) -> float:
        return round(timer(fn, s.iters) / 1e3, 4)

    def waits():
        comm_wait(rest.dispatch_us, s.device)
        comm_wait(rest.combine_us, s.device)

    return {"moe_layer": ms(lambda: rest(o, h)), "attn_output": ms(lambda: A.attn_output(stack.w, o)),
            "routed_experts": ms(rest.routed),
            "dense_layer": ms(lambda: rest(o, h, dense=True)), "comm_wait": ms(waits),
            "comm_modelled": round((rest.dispatch_us + rest.combine_us) / 1e3, 4), "lm_head": ms(lambda: rest.lm_head(h)),
            "routed_pairs": sum(rest.counts), "experts_gemm": rest.gemm}


def part_times(stack: Stack, t: int, timer, restore=lambda: None) -> dict | None:
    """Layer 0 of step t part by part, each timed alone from the state the step starts in, in the serial order (what
    dominates a layer; the overlap modes reorder these parts, the step's own time is attention_ms): q_a and kv_a,
    the indexer with its top-k, PreAttn, FlashMLA; for ESS also the LRU step (its tables restored before each
    replay), the H2D of its misses and the D2H of the own rows. Decode steps only (None for verify rows)."""
    if stack.S != 1:
        return None
    s, cfg, w, li = stack.s, stack.s.cfg, stack.w, 0
    pos, h = stack.positions(t), stack.h[t]
    q_lora, own = A.q_lora_of(w, h), A.kv_latent_rows(w, cfg, h, pos)
    q_nope, q_pe = A.pre_attn(w, cfg, q_lora, pos)
    sel = A.indexer_topk(w, cfg, h, q_lora, pos, stack.index_k) if stack.topk_steps is None else stack.topk_steps[t, li]

    def ms(fn, setup=lambda: None) -> float:
        return round(timer(fn, s.iters, setup) / 1e3, 4)

    out = {"q_a": ms(lambda: A.q_lora_of(w, h)), "kv_a": ms(lambda: A.kv_latent_rows(w, cfg, h, pos)),
           "indexer_topk": ms(lambda: A.indexer_topk(w, cfg, h, q_lora, pos, stack.index_k)),
           "pre_attn": ms(lambda: A.pre_attn(w, cfg, q_lora, pos))}
    if stack.buffer is None:
        idx = torch.where(sel >= 0, stack.row_req.unsqueeze(1) * stack.max_len + sel, -1)
        rows = stack.cache.rows[li].view(-1, layout.LATENT_ROW_BYTES)
        out["flashmla"] = ms(lambda: sparse_decode(q_nope, q_pe, rows, idx, cfg.softmax_scale, s.attention))
        return out
    cache = stack.cache
    cache.set_step(t)
    restore()
    out["lru_step"] = ms(lambda: cache.update(li, sel, pos), restore)
    restore()
    r = cache.update(li, sel, pos)  # the step's result, for the parts that read it
    out["h2d"] = ms(lambda: cache.fetch(li, r))
    out["h2d_probe"] = h2d_probe(cache, li, r, out["h2d"], ms)
    cache.store_own(li, r, own)
    out["d2h"] = ms(lambda: cache.streams.wait(cache.backup_own(li, r, pos)))
    pool = cache.serving.gpu[li]
    out["flashmla"] = ms(lambda: sparse_decode(q_nope, q_pe, pool, r.attn_slot, cfg.softmax_scale, s.attention))
    restore()
    return out


PROBE_ROWS = 409_600  # the small host buffer of the H2D probe: 256 MiB of rows, about the kit's FlashTrans buffer


def h2d_probe(cache, li: int, r, h2d_ms: float, ms) -> dict:
    """Layer 0's misses' H2D (h2d_ms) against the same lists over a small pinned buffer (their rows modulo
    PROBE_ROWS), with the rows it moves counted: separates the host pool's size and spread from the lists' shape (on
    the H200 both ran at FlashTrans' rate, docs/gpu.md). Reads the miss count (a sync, untimed)."""
    sc = cache.serving
    rows = sc.miss_rows(li, cache.slots, cache.token_table, r)
    moved = int(r.n_miss.sum())
    small = pinned_zeros((min(PROBE_ROWS, sc.host[li].shape[0]), layout.LATENT_ROW_BYTES), pin=rows.is_cuda)
    small_rows = torch.where(rows >= 0, rows % small.shape[0], rows)
    small_ms = ms(lambda: flashtrans.gather_lists(small, small_rows, sc.gpu[li], r.miss_slot, r.n_miss, sc.backend))

    def gbps(t: float):
        return round(moved * layout.LATENT_ROW_BYTES / (t * 1e-3) / 1e9, 2) if t > 0 else None

    return {"rows": moved, "gbps": gbps(h2d_ms), "small_buffer_ms": small_ms, "small_buffer_gbps": gbps(small_ms),
            "host_pool_gib": round(sc.host[li].numel() / 2**30, 4)}


def hisparse_slots(s: Setup) -> int:
    return HISPARSE_BUFFER_PER_TOPK * s.cfg.index_topk


def slots(s: Setup, ratio: float, context: int) -> int:
    return max(s.cfg.index_topk + 1, math.ceil(ratio * context))


def make_rest(s: Setup, spec, hw, cal, dep):
    """The measured rest of each layer (the stack's `rest` argument: (attention weights, tokens) -> LayerRest), the
    all-to-all's length the simulator's for those tokens under `dep` (EP s.ep); the weights made once, shared."""
    shape = MoeShape.mini(s.cfg.hidden, s.cfg.vocab) if s.cfg.name == "mini" else MoeShape.dsv32()
    weights = RestWeights.random(shape, s.ep, s.dtype, s.device, experts=s.experts)
    spin_cycles_per_us(s.device)  # the spin's clock, timed once before any graph captures a wait

    def rest(attn, tokens: int) -> LayerRest:
        # dispatch moves FP8 hidden states, combine bf16: a third and two thirds of the bytes (cost.py)
        comm_us = cost.layer_cost(spec, hw, cal, dep, tokens, tokens, 0, moe=True).comm * 1e6
        return LayerRest(shape, attn, weights, tokens, s.ep, comm_us / 3, 2 * comm_us / 3)

    return rest


def run(s: Setup, modes: list[str], source: str, hardware: str, progress=print, accept: float = 1.7,
        checkpoint=lambda rows, errors: None, measured=None) -> dict:
    """Every configuration's rows and the summary. A configuration that raises is recorded in "errors" (with its
    message) and the rest still run: one lent GPU session is all there is. checkpoint(rows, errors) runs after each
    configuration, so a run cut short keeps what it measured. measured: ESS's terms from a GPU run
    (ess.analysis.sim.measured) for mode "plan"'s choice; None: the simulator's modelled ones."""
    spec, cal = get_model("dsv32"), load_calibration()
    paper_hw = get_hardware(PAPER_HARDWARE)
    dep = cost.Deployment(ep=EP, tbo=True)
    hw = get_hardware(hardware)
    # the paper's deployment's cache budget per GPU, the share of L layers
    budget = cost.cache_budget_bytes(spec, paper_hw, cal, dep) / spec.layers * s.layers
    if s.device.type == "cpu":  # the smoke run: a tiny model, a budget that holds a few of its requests
        budget = 3 * cache_bytes(s.layers, s.contexts[0], layout.LATENT_ROW_BYTES, layout.INDEX_ROW_BYTES, None)

    def sim_layer(tokens: int, context: int):
        return cost.layer_cost(spec, hw, cal, dep, tokens, tokens, context, moe=True)

    def plan(per_layer, batch, context):  # under --tbo, dba as the stack runs it there
        # the stack's layers are MoE layers: the model's first after its dense ones
        return plan_modes(spec, hw, cal, dep, batch, context, 0, per_layer, measured,
                          tbo_dba=two_batch(s, batch), first_layer=spec.dense_layers)

    rest = make_rest(s, spec, hw, cal, dataclasses.replace(dep, ep=s.ep)) if s.whole_layer else None

    # the paper's locality; with a fit, ESS's and HiSparse's largest batches again with it (the baseline's time, and
    # ESS's with its requests resident, do not depend on it)
    localities = ["paper"] + (["fit"] if s.fitted is not None and source == "synth" else [])
    rows, errors = [], []
    for context in s.contexts:
        wall = largest_batch(budget, s.layers, context, None, s.max_batch)
        ess_modes = [m for m in modes if m not in ("baseline", "hisparse")]
        stacks = []
        if "hisparse" in modes:  # decode only: HiSparse's verify path swaps differently
            top = hisparse_largest_batch(budget, s.layers, context, hisparse_slots(s), s.max_batch)
            stacks += [("hisparse", b, 1, "paper") for b in sorted({*s.small_batches, min(wall, top), top}) if b >= 1]
            stacks += [("hisparse", top, 1, loc) for loc in localities[1:]]
        for S in s.query_rows:
            if "baseline" in modes:
                stacks += [(None, b, S, "paper") for b in sorted({*s.small_batches, wall}) if 1 <= b <= wall]
            for ratio in s.ratios if ess_modes else []:
                C = slots(s, ratio, context)
                if C < S * (s.cfg.index_topk + 1):  # the plugin refuses it too: every row's set and own token
                    progress(f"{context} ratio {ratio}: {C} slots < {S} rows x (top-k + 1); skipped")
                    continue
                top = largest_batch(budget, s.layers, context, C, s.max_batch)
                at = {*s.small_batches, top} | ({min(wall, top)} if s.residency else set())
                stacks += [(ratio, b, S, "paper") for b in sorted(at) if 1 <= b <= top]
                stacks += [(ratio, top, S, loc) for loc in localities[1:]]  # where requests are offloaded
        for ratio, batch, S, loc in stacks:
            t0 = time.perf_counter()
            try:
                results = measure(s, ["baseline"] if ratio is None else ess_modes, batch, context, ratio, S, source,
                                  plan, budget if s.residency else None, rest, s.fitted if loc == "fit" else None)
            except (RuntimeError, AssertionError, ValueError) as e:  # e.g. out of memory: record it, go on
                errors.append({"context": context, "ratio": ratio, "batch": batch, "query_rows": S, "locality": loc,
                               "error": f"{type(e).__name__}: {e}"[:500]})
                progress(f"{context} ratio {ratio} batch {batch} rows {S}: FAILED {errors[-1]['error']}")
                if s.device.type == "cuda":
                    torch.cuda.empty_cache()
                checkpoint(rows, errors)
                continue
            hisparse, ratio = ratio == "hisparse", None if ratio == "hisparse" else ratio
            lc = sim_layer(batch * S, context)
            rest_ms = (lc.post + lc.comm) * 1e3  # the modelled rest of a layer (w_vc, o_proj, MoE, all-to-all)
            # MTP: the draft passes that make the S - 1 draft tokens, modelled (the simulator's), and the tokens a
            # verify step yields per request on average (accept)
            draft_ms = cost.step_time(spec, hw, cal, dep, batch, context, S - 1).draft_s * 1e3 if S > 1 else 0.0
            tokens = accept if S > 1 else 1.0
            for mode, m in results.items():
                sim_attn = lc.pre_indexer + lc.indexer + lc.pre_attn + lc.attention  # seconds per layer
                if ratio is not None or hisparse:
                    costs = cost.modelled(cal, spec)
                    h2d = cost.h2d_seconds(batch, m["misses"], costs)
                    other = sim_layer(batch * S / 2, context) if two_batch(s, batch) else None
                    sim_attn += sum(sum(cost.exposed_transfer(lc, h2d, md, costs, batch, m["misses"], other))
                                    for md in (m["modes"] or ["none" if hisparse else mode] * s.layers)) / s.layers
                parts = m.get("rest")
                if parts:  # measured: the L layers' whole step and the LM head; the model's dense layers' rest in
                    # place of the MoE's (the stack's layers are MoE layers)
                    step_ms, head = m["attention_ms"], parts["lm_head"]
                    attention_ms = step_ms - head - s.layers * parts["moe_layer"]  # derived
                    model_ms = ((step_ms - head) / s.layers * MODEL_LAYERS + head
                                + spec.dense_layers * (parts["dense_layer"] - parts["moe_layer"]))
                else:  # the hybrid figure: the measured attention path and the simulator's rest
                    attention_ms = m["attention_ms"]
                    step_ms = attention_ms + s.layers * rest_ms
                    model_ms = step_ms / s.layers * MODEL_LAYERS
                row = {"context": context, "mode": mode, "ratio": ratio, "batch": batch, "query_rows": S, "locality": loc,
                       "tbo": two_batch(s, batch),
                       "attention_step_ms": round(attention_ms, 4), "step_ms": round(step_ms, 4),
                       "model_step_ms": round(model_ms, 4),
                       "tokens_per_s": round(batch * tokens / (model_ms + draft_ms) * 1e3, 2),
                       "tokens_per_step": tokens, "draft_ms": round(draft_ms, 4),
                       "draft": "modelled (the simulator's)" if S > 1 else None,
                       "exposed_transfer_ms": round(m["exposed_ms"], 4),
                       "misses_per_request_layer": None if m["misses"] is None else round(m["misses"], 2),
                       "simulator_step_ms": round(sim_attn * s.layers * 1e3, 4), "memory_wall_batch": wall}
                if m.get("resident") is not None:  # ESS: its requests resident on the GPU (residency first)
                    row["resident_requests"] = m["resident"]
                if hisparse:
                    row["buffer_tokens"] = hisparse_slots(s)
                if m.get("parts_ms") is not None:  # layer 0, part by part, beside the modelled rest of a layer
                    row["parts_ms"] = m["parts_ms"] | {"modelled_rest": round(rest_ms, 4)}
                    # the indexer against reading its index-K once at the part's HBM bandwidth (parts: micro-batch
                    # A's under two-batch overlap)
                    floor_ms = (batch // 2 if row["tbo"] else batch) * context * layout.INDEX_ROW_BYTES \
                        / (hw.hbm_tbps * 1e12) * 1e3
                    row["indexer_over_floor"] = round(m["parts_ms"]["indexer_topk"] / floor_ms, 2)
                if parts:
                    row["rest_ms"] = parts | {"modelled_rest": round(rest_ms, 4)}
                if m.get("h2d_probe") is not None:
                    row["h2d_probe"] = m["h2d_probe"]
                if m.get("diff") is not None:
                    row["max_abs_diff_vs_baseline"] = m["diff"]
                if m.get("modes"):
                    row["plan"] = {x: m["modes"].count(x) for x in ("none", "da", "dba")}
                rows.append(row)
                progress(f"{context} {mode} ratio {ratio} batch {batch} rows {S}: {row['attention_step_ms']} ms attention, "
                         f"{row['tokens_per_s']} tok/s")
            progress(f"  ({time.perf_counter() - t0:.1f} s)")
            checkpoint(rows, errors)
    return {"rows": measured_drafts(rows, s.layers), "errors": errors, **summary(rows, s)}


MEASURED_DRAFT = "measured: a layer and the LM head of the decode row at this batch, mode and ratio, per draft pass"


def measured_drafts(rows: list[dict], layers: int) -> list[dict]:
    """Verify rows' MTP draft passes measured where the same run (or an --append-ed one) measured the whole layer of
    a decode row at the same context, ratio, batch, mode and locality: each draft pass is one such layer (the MTP
    module is one decoder layer) and the LM head; tokens_per_s follows. Rows without one keep the simulator's. In
    place; returns rows."""
    decode = {(r["context"], r["ratio"], r["batch"], r["mode"], r.get("locality")): r for r in rows
              if r["query_rows"] == 1 and "rest_ms" in r}
    for r in rows:
        d = decode.get((r["context"], r["ratio"], r["batch"], r["mode"], r.get("locality")))
        if r["query_rows"] > 1 and "rest_ms" in r and d is not None:
            head = d["rest_ms"]["lm_head"]
            r["draft_ms"] = round((r["query_rows"] - 1) * ((d["step_ms"] - head) / layers + head), 4)
            r["draft"] = MEASURED_DRAFT
            r["tokens_per_s"] = round(r["batch"] * r["tokens_per_step"] / (r["model_step_ms"] + r["draft_ms"]) * 1e3, 2)
    return rows


def modelled_parts(rows: list[dict], whole_layer: bool) -> list[str]:
    """What decode.json's figures still take from the simulator."""
    parts = (["the EP all-to-all (network): a one-SM spin of the simulator's length"] if whole_layer
             else ["w_vc, o_proj, the MoE, the dense FFN and the EP all-to-all: the simulator's"])
    modelled = [r for r in rows if r["query_rows"] > 1 and r.get("draft") != MEASURED_DRAFT]
    if modelled:
        parts.append(f"the MTP draft passes of {len(modelled)} verify rows (no decode row of theirs): the simulator's")
    return parts


def main(argv: list[str] | None = None) -> int:
    p, args = cli.parse(argv, __doc__.split("\n\n")[0])
    indexer.SELECT = args.select  # every indexer_topk_fp8 call of the stack reads it
    try:  # a bad file fails here, before any stack is built
        measured = load_measured(args.measured) if args.measured else None
    except MeasuredError as e:
        p.error(str(e))
    s = smoke_setup() if args.smoke else gpu_setup(args)
    if args.smoke and args.dtype:
        s.dtype = cli.DTYPES[args.dtype]
    s.attn1 = args.attn1
    s.residency = args.residency == "on"
    s.whole_layer, s.ep, s.tbo, s.experts = args.rest == "measured", args.ep, args.tbo, args.experts
    if s.tbo and not s.whole_layer:
        p.error("--tbo: two-batch overlap hides the all-to-all under the other micro-batch's compute: it needs the "
                "rest of each layer measured (--rest measured)")
    if args.fit:
        if args.topk_source != "synth":
            p.error("--fit: the fitted locality replays a synthetic trace (--topk-source synth)")
        try:
            s.fitted = load_fitted(args.fit)
            scaled(s.fitted, s.cfg.index_topk, min(s.contexts)).validate()
        except ValueError as e:
            p.error(f"--fit: {e}")
    if args.smoke and args.batches != p.get_default("batches"):
        s.small_batches = args.batches
    if args.hardware is None:
        args.hardware = "H200" if s.device.type == "cuda" and "H200" in torch.cuda.get_device_name() else "H100"
    get_hardware(args.hardware)  # an unknown name fails here, before any stack is built
    path = os.path.join(args.out, "decode.json")
    earlier, earlier_errors, commands = [], [], []
    if args.append and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        earlier, earlier_errors = old["rows"], old.get("errors", [])
        commands = old.get("commands", [old.get("command")])
    command = " ".join(["python", "benchmark/decode_gpu.py", *(argv if argv is not None else sys.argv[1:])])
    contexts = sorted({r["context"] for r in earlier} | set(s.contexts))
    os.makedirs(args.out, exist_ok=True)

    def write(rows: list[dict], errors: list[dict], done: bool) -> dict:
        """decode.json with the earlier runs' rows (--append) and these; done False: a run still going (or cut)."""
        every = measured_drafts(earlier + rows, s.layers)
        doc = {"command": command, "commands": [*commands, command],
               "machine": torch.cuda.get_device_name() if s.device.type == "cuda" else f"CPU ({platform.machine()}), smoke",
               "date": time.strftime("%Y-%m-%d"), "layers": s.layers, "topk_source": args.topk_source,
               "topk_label": "SYNTHETIC (ess trace synth)" if args.topk_source == "synth" else "computed (random weights)",
               "localities": {"paper": "the ESS paper's locality (the generator's defaults)"}
               | ({"fit": f"fitted to real traces ({args.fit}), scaled to top-k and context"} if s.fitted else {}),
               "attention": s.attention, "dtype": str(s.dtype).removeprefix("torch."), "attn1": s.attn1,
               "residency": s.residency, "whole_layer": s.whole_layer, "ep": s.ep, "tbo": s.tbo,
               "indexer_select": args.select,
               "experts": s.experts if s.whole_layer else None,
               "modelled_parts": modelled_parts(every, s.whole_layer),
               "spin_cycles_per_us": spin_cycles_per_us(s.device) if s.whole_layer else None,
               "hardware_profile": args.hardware,
               "plan_costs": measured.describe() if measured else "modelled",
               "complete": done, "rows": every,
               "errors": earlier_errors + errors, **summary(every, dataclasses.replace(s, contexts=contexts))}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return doc

    doc = run(s, args.modes, args.topk_source, args.hardware, lambda x: print(x, flush=True), args.accept,
              lambda rows, errors: write(rows, errors, False), measured)
    doc = write(doc["rows"], doc["errors"], True)
    plot(doc, os.path.join(args.out, "decode.png"))
    print(f"wrote {args.out}/decode.json and decode.png; gain {doc.get('gain_32k_max_batch')}, "
          f"small-batch ratio {doc.get('ratio_small_batch')}, with MTP {doc.get('gain_32k_max_batch_mtp')}"
          + (f"; {len(doc['errors'])} configurations FAILED (decode.json's errors)" if doc["errors"] else ""))
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
