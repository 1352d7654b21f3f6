"""Decode throughput on one GPU: ESS against the whole-cache baseline, each at its largest batch under the memory wall.

An L-layer DeepSeek-V3.2 decode stack at the full dimensions (128 heads, top-k 2048, 656-byte FP8 latent rows, 132-byte
index-K rows; random weights, shared by the layers: time does not depend on their values). Per layer, measured:
q_a and kv_a projections, the indexer (index-K of the whole context, logits, top-k 2048), PreAttn (q_b, w_kc, RoPE),
the cache step and FlashMLA's sparse FP8 decode; for ESS the LRU step (fused kernel on a GPU), FlashTrans H2D of the
misses and D2H of the own rows, in the mode's order (ess.reference.overlap). The rest of each layer (w_vc, o_proj,
MoE and its EP all-to-all at the paper's deployment) is modelled: its time per batch comes from the calibrated
simulator and is added to the measured attention path (the hybrid figures). Adding it is exact here: this stack
overlaps no transfer with the rest of a layer.

Memory: the per-layer cache budget of the paper's deployment (the simulator's per-GPU cache budget / 61 x L). The
baseline holds latent and index-K of every token on the GPU; ESS holds index-K and C = ratio x context slots per
request, the latent in pinned host memory. Each runs at its largest batch (ESS per ratio), and at batch 1 and 2.

Top-k: replayed from a SYNTHETIC trace (ess trace synth at the context; `--topk-source synth`, the default: the
locality the ESS paper reports, not a measurement) or the computed indexer's (`indexer`: random weights, no locality,
the worst case). With a trace, the cache starts from LRU-Warmup and `--warm-steps` eager steps of the trace; the
timed step is the next one, replayed as a CUDA graph from the same state each time. `exposed_transfer_ms` is the
step's time minus its time with every selected row resident.

    python benchmark/decode_gpu.py --out benchmark/results/gpu/<device>     # on a GPU (the sgl-flash-mla wheel)
    python benchmark/decode_gpu.py --smoke --out /tmp/decode                 # a CPU run of tiny shapes: checks the script

Not built yet: MTP verify with 3 query rows per request (the reference stack decodes one query row per request).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import torch

from ess.analysis.sim import cost
from ess.analysis.sim.engine import load_calibration, plan_modes
from ess.analysis.sim.paper import EP, HARDWARE as PAPER_HARDWARE
from ess.analysis.sim.specs import get_hardware, get_model
from ess.analysis.synth import SynthOptions, synth_trace
from ess.analysis.timing import graph_us, median_us
from ess.core import layout
from ess.core.memory import cache_bytes
from ess.core.settings import WARMUP_WINDOWS, EssConfig
from ess.reference import attention as A
from ess.reference.config import get_config
from ess.reference.dense_cache import DenseLatentCache
from ess.reference.ess_cache import EssLatentCache
from ess.reference.flashmla import sparse_decode
from ess.reference.overlap import ess_layer_attention

MODES = ("baseline", "none", "da", "dba", "plan")
MODEL_LAYERS = 61  # DeepSeek-V3.2's decoder layers, for the per-model figures


@dataclasses.dataclass
class Setup:
    cfg: object
    layers: int
    contexts: list[int]
    ratios: list[float]
    small_batches: list[int]
    warm_steps: int
    iters: int
    device: torch.device
    attention: str
    max_batch: int | None  # a cap on the largest batches (the smoke run's)


def smoke_setup() -> Setup:
    cfg = get_config("mini", num_layers=2)
    return Setup(cfg, 2, [256], [0.3], [1, 2], 2, 1, torch.device("cpu"), "reference", 3)


def gpu_setup(args) -> Setup:
    if not torch.cuda.is_available():
        raise SystemExit("decode_gpu.py: needs a CUDA device (or --smoke)")
    return Setup(get_config("full", num_layers=args.layers), args.layers, args.contexts, args.ratios, [1, 2],
                 args.warm_steps, args.iters, torch.device("cuda"), "flashmla", args.max_batch)


class Stack:
    """L decode layers over one batch: the baseline's dense cache (buffer None) or ESS's cache with `buffer` slots."""

    def __init__(self, s: Setup, batch: int, context: int, buffer: int | None, topk_steps: torch.Tensor | None,
                 warm_sets: torch.Tensor | None, seed: int = 0):
        cfg, dev, L = s.cfg, s.device, s.layers
        g = torch.Generator().manual_seed(seed)
        self.s, self.B, self.context, self.buffer = s, batch, context, buffer
        steps = s.warm_steps + 1
        self.max_len = -(-(context + steps) // 64) * 64  # whole FlashMLA pages
        self.w = A.AttentionWeights.random(cfg, g, dev)
        self.h = torch.randn(steps, batch, cfg.hidden, generator=g).to(dev)  # each step's hidden states
        keys = torch.randn(batch, self.max_len, cfg.index_head_dim, generator=g).to(dev)
        self.index_k = layout.quantize_index_k(keys)  # [B, max_len, 132], shared by the layers
        block = layout.quantize_latent(torch.randn(4096, 512, generator=g), torch.randn(4096, 64, generator=g)).to(dev)
        rows = block.repeat(-(-context // 4096), 1)[:context]
        self.topk_steps = topk_steps  # [steps, L, B, K] replayed top-k, or None: the indexer's
        if buffer is None:
            self.cache = DenseLatentCache(L, batch, self.max_len, dev)
        else:
            self.cache = EssLatentCache(EssConfig(topk=cfg.index_topk, buffer_tokens=buffer), L, [context] * batch,
                                        self.max_len, dev)
        for li in range(L):
            for b in range(batch):
                self.cache.prefill(li, b, rows, None)
            if buffer is not None and warm_sets is not None:
                self.cache.warmup_layer(li, warm_sets[li])

    def step(self, t: int, mode: str) -> None:
        """Decode step t of every layer (attention path only)."""
        s, cfg = self.s, self.s.cfg
        pos = torch.full((self.B,), self.context + t, dtype=torch.int64, device=s.device)
        h = self.h[t]
        if self.buffer is not None:
            self.cache.set_step(t)
        for li in range(s.layers):
            q_lora = A.q_lora_of(self.w, h)
            sel = None if self.topk_steps is None else self.topk_steps[t, li]
            if self.buffer is None:
                topk = A.indexer_topk(self.w, cfg, h, q_lora, pos, self.index_k)
                topk = topk if sel is None else sel
                own = A.kv_latent_rows(self.w, cfg, h, pos)
                batch = torch.arange(self.B, device=s.device)
                self.cache.rows[li, batch, pos] = own
                q_nope, q_pe = A.pre_attn(self.w, cfg, q_lora, pos)
                idx = torch.where(topk >= 0, batch.unsqueeze(1) * self.max_len + topk, -1)
                sparse_decode(q_nope, q_pe, self.cache.rows[li].view(-1, layout.LATENT_ROW_BYTES), idx,
                              cfg.softmax_scale, s.attention)
            else:
                layer_mode = self.modes[li] if mode == "plan" else mode
                ess_layer_attention(layer_mode, self.w, cfg, h, q_lora, pos, self.index_k, self.cache, li,
                                    s.attention, selected=sel)

    modes: list[str] = []  # per layer, for mode "plan"

    def selected(self, t: int) -> list[torch.Tensor]:
        """Each layer's top-k at step t: the replayed trace's, or the indexer's (the same in every layer: the layers
        share weights and index-K)."""
        if self.topk_steps is not None:
            return [self.topk_steps[t, li] for li in range(self.s.layers)]
        h, cfg = self.h[t], self.s.cfg
        pos = torch.full((self.B,), self.context + t, dtype=torch.int64, device=self.s.device)
        return [A.indexer_topk(self.w, cfg, h, A.q_lora_of(self.w, h), pos, self.index_k)] * self.s.layers

    # ESS: the LRU tables decide the misses; they are snapshotted and restored around every timed replay
    def tables(self) -> list[torch.Tensor]:
        sp = self.cache.sparse
        return [sp.slot_pos, sp.slot_stamp, sp.pos_slot]

    def all_resident(self, t: int) -> None:
        """The LRU tables as if every position step t selects were resident (the step's time without transfer)."""
        sp = self.cache.sparse
        sp.slot_pos.fill_(-1), sp.slot_stamp.zero_(), sp.pos_slot.fill_(-1)
        for li, sel in enumerate(self.selected(t)):
            self.cache.warmup_layer(li, sel.unsqueeze(1))


def trace_topk(s: Setup, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SYNTHETIC top-k (ess trace synth at this context): decode sets [steps, L, B, K] and warm-up sets
    [L, B, W, K]; batch row b replays trace request b mod 4."""
    K = s.cfg.index_topk
    opt = SynthOptions(requests=min(batch, 4), steps=s.warm_steps + 1, layers=s.layers, topk=K, context=context,
                       warmup_windows=WARMUP_WINDOWS, sinks=4, window=min(128, K // 8), churn_min=min(8, K // 16),
                       churn_max=min(600, K // 4), pool=min(8192, context // 2), seed=context)
    tr = synth_trace(opt)
    rows = [b % tr.topk.shape[0] for b in range(batch)]
    decode = torch.as_tensor(tr.topk[rows]).permute(1, 2, 0, 3).contiguous()  # [steps, L, B, K]
    warm = torch.as_tensor(tr.prefill_topk[rows]).permute(2, 0, 1, 3).contiguous()  # [L, B, W, K]
    return decode.to(s.device), warm.to(s.device)


def measure(s: Setup, modes: list[str], batch: int, context: int, ratio: float | None, source: str, plan) -> dict:
    """The attention path of one decode step of the L layers, per mode, on one stack (the baseline's, or ESS's at
    `ratio`): {mode: {"attention_ms", "exposed_ms", "misses" (ESS: per request and layer), "modes" (plan)}}.
    plan(per_layer_misses, batch, context) -> modes, for mode "plan"."""
    buffer = None if ratio is None else max(s.cfg.index_topk + 1, math.ceil(ratio * context))
    decode, warm = trace_topk(s, batch, context) if source == "synth" else (None, None)
    stack = Stack(s, batch, context, buffer, decode, warm)
    t = s.warm_steps
    for i in range(t):  # the cache's state before the timed step: the same requests' earlier steps
        stack.step(i, "baseline" if buffer is None else "none")  # every ESS mode leaves the same LRU state
    timer = graph_us if s.device.type == "cuda" else median_us
    if buffer is None:
        return {"baseline": {"attention_ms": timer(lambda: stack.step(t, "baseline"), s.iters) / 1e3,
                             "exposed_ms": 0.0, "misses": None}}
    snap = [x.clone() for x in stack.tables()]

    def restore(state=snap):
        for x, y in zip(stack.tables(), state):
            x.copy_(y)

    for m in stack.cache.misses:
        m.clear()
    stack.step(t, "none")  # eager, from the snapshot: the timed step's misses, per layer
    per_layer = [float(m[-1].float().mean()) for m in stack.cache.misses]
    stack.all_resident(t)
    resident = [x.clone() for x in stack.tables()]
    out = {}
    for mode in modes:
        stack.modes = plan(per_layer, batch, context) if mode == "plan" else []
        attn_us = timer(lambda: stack.step(t, mode), s.iters, restore)
        free_us = timer(lambda: stack.step(t, mode), s.iters, lambda: restore(resident))
        out[mode] = {"attention_ms": attn_us / 1e3, "exposed_ms": max(0.0, attn_us - free_us) / 1e3,
                     "misses": sum(per_layer) / len(per_layer), "modes": list(stack.modes) or None}
    return out


def largest_batch(budget: float, layers: int, context: int, buffer: int | None, cap: int | None) -> int:
    """The most requests whose device caches (latent and index-K, or index-K and C slots) fit the budget."""
    per_request = cache_bytes(layers, context, layout.LATENT_ROW_BYTES, layout.INDEX_ROW_BYTES, buffer)
    b = int(budget // per_request)
    return min(b, cap) if cap else b


def run(s: Setup, modes: list[str], source: str, hardware: str, progress=print) -> dict:
    spec, cal = get_model("dsv32"), load_calibration()
    paper_hw = get_hardware(PAPER_HARDWARE)
    dep = cost.Deployment(ep=EP, tbo=True)
    hw = get_hardware(hardware)
    # the paper's deployment's cache budget per GPU, the share of L layers
    budget = cost.cache_budget_bytes(spec, paper_hw, cal, dep) / spec.layers * s.layers
    if s.device.type == "cpu":  # the smoke run: a tiny model, a budget that holds a few of its requests
        budget = 3 * cache_bytes(s.layers, s.contexts[0], layout.LATENT_ROW_BYTES, layout.INDEX_ROW_BYTES, None)

    def sim_layer(batch: int, context: int):
        return cost.layer_cost(spec, hw, cal, dep, batch, batch, context, moe=True)

    def plan(per_layer, batch, context):
        return plan_modes(spec, hw, cal, dep, batch, context, 0, per_layer)

    rows = []
    for context in s.contexts:
        wall = largest_batch(budget, s.layers, context, None, s.max_batch)
        stacks = [(None, b) for b in sorted({*s.small_batches, wall}) if b >= 1] if "baseline" in modes else []
        ess_modes = [m for m in modes if m != "baseline"]
        for ratio in s.ratios if ess_modes else []:
            C = max(s.cfg.index_topk + 1, math.ceil(ratio * context))
            stacks += [(ratio, b) for b in sorted({*s.small_batches, largest_batch(budget, s.layers, context, C,
                                                                                    s.max_batch)}) if b >= 1]
        for ratio, batch in stacks:
            t0 = time.perf_counter()
            results = measure(s, ["baseline"] if ratio is None else ess_modes, batch, context, ratio, source, plan)
            lc = sim_layer(batch, context)
            rest_ms = (lc.post + lc.comm) * 1e3  # the modelled rest of a layer (w_vc, o_proj, MoE, all-to-all)
            for mode, m in results.items():
                sim_attn = lc.pre_indexer + lc.indexer + lc.pre_attn + lc.attention  # seconds per layer
                if ratio is not None:
                    h2d = cost.h2d_seconds(batch, m["misses"], spec, cal)
                    sim_attn += sum(sum(cost.exposed_transfer(lc, h2d, md, cal))
                                    for md in (m["modes"] or [mode] * s.layers)) / s.layers
                step_ms = m["attention_ms"] + s.layers * rest_ms
                row = {"context": context, "mode": mode, "ratio": ratio, "batch": batch,
                       "attention_step_ms": round(m["attention_ms"], 4), "step_ms": round(step_ms, 4),
                       "tokens_per_s": round(batch / (step_ms / s.layers * MODEL_LAYERS) * 1e3, 2),
                       "exposed_transfer_ms": round(m["exposed_ms"], 4),
                       "misses_per_request_layer": None if m["misses"] is None else round(m["misses"], 2),
                       "simulator_step_ms": round(sim_attn * s.layers * 1e3, 4), "memory_wall_batch": wall}
                if m.get("modes"):
                    row["plan"] = {x: m["modes"].count(x) for x in ("none", "da", "dba")}
                rows.append(row)
                progress(f"{context} {mode} ratio {ratio} batch {batch}: {row['attention_step_ms']} ms attention, "
                         f"{row['tokens_per_s']} tok/s")
            progress(f"  ({time.perf_counter() - t0:.1f} s)")
    return {"rows": rows, **summary(rows, s)}


def summary(rows: list[dict], s: Setup) -> dict:
    """gain_32k_max_batch: the best ESS mode at its largest batch over the baseline at its largest batch (hybrid
    tokens/s, the first context); ratio_small_batch: ESS's best over the baseline at batch 1 and 2, the smaller."""
    ctx = s.contexts[0]
    at = [r for r in rows if r["context"] == ctx]
    base = [r for r in at if r["mode"] == "baseline"]
    ess = [r for r in at if r["mode"] != "baseline"]
    if not base or not ess:
        return {}
    base_top = max(base, key=lambda r: r["batch"])
    best_top = max((r for r in ess if r["batch"] not in s.small_batches or r["batch"] == max(x["batch"] for x in ess)),
                   key=lambda r: r["tokens_per_s"])
    small = []
    for b in s.small_batches:
        bb = [r["tokens_per_s"] for r in base if r["batch"] == b]
        eb = [r["tokens_per_s"] for r in ess if r["batch"] == b]
        if bb and eb:
            small.append(max(eb) / bb[0])
    return {"gain_32k_max_batch": round(best_top["tokens_per_s"] / base_top["tokens_per_s"], 4),
            "gain_context": ctx, "best_ess": {k: best_top[k] for k in ("mode", "ratio", "batch")},
            "ratio_small_batch": round(min(small), 4) if small else None}


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in doc["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        rows = [r for r in doc["rows"] if r["context"] == ctx]
        keys = sorted({(r["mode"], r["ratio"]) for r in rows}, key=lambda k: (k[0] != "baseline", str(k)))
        for i, (mode, ratio) in enumerate(keys):
            pts = sorted((r for r in rows if (r["mode"], r["ratio"]) == (mode, ratio)), key=lambda r: r["batch"])
            label = "baseline" if ratio is None else f"ESS {mode}, ratio {ratio}"
            ax.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o", color=f"C{i % 10}",
                    label=label)
        ax.axvline(rows[0]["memory_wall_batch"], color="k", ls="--", lw=1, label="memory wall (baseline)")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("tokens/s (hybrid: measured attention + modelled rest)")
        ax.set_title(f"context {ctx}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for decode.json and decode.png (created)")
    p.add_argument("--layers", type=int, default=4, help="decode layers in the stack")
    p.add_argument("--contexts", type=lambda x: [int(v) for v in x.split(",")], default=[32768, 131072])
    p.add_argument("--ratios", type=lambda x: [float(v) for v in x.split(",")], default=[0.1, 0.2, 0.3])
    p.add_argument("--modes", type=lambda x: x.split(","), default=list(MODES), help=f"of {','.join(MODES)}")
    p.add_argument("--topk-source", choices=["synth", "indexer"], default="synth")
    p.add_argument("--warm-steps", type=int, default=4, help="eager steps before the timed one")
    p.add_argument("--iters", type=int, default=10, help="timed replays per configuration")
    p.add_argument("--max-batch", type=int, help="cap the largest batches (memory or time)")
    p.add_argument("--hardware", default="H100", help="simulator profile of this GPU, for the modelled rest of a layer")
    p.add_argument("--append", action="store_true",
                   help="add the rows to OUT/decode.json (one context per run keeps each run short)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    s = smoke_setup() if args.smoke else gpu_setup(args)
    path = os.path.join(args.out, "decode.json")
    earlier, commands = [], []
    if args.append and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        earlier, commands = old["rows"], old.get("commands", [old.get("command")])
    doc = run(s, args.modes, args.topk_source, args.hardware, progress=lambda x: print(x, flush=True))
    if earlier:
        s.contexts = sorted({r["context"] for r in earlier} | set(s.contexts))
        doc = {"rows": earlier + doc["rows"], **summary(earlier + doc["rows"], s)}
    command = " ".join(["python", "benchmark/decode_gpu.py", *(argv if argv is not None else sys.argv[1:])])
    doc = {"command": command, "commands": [*commands, command],
           "machine": torch.cuda.get_device_name() if s.device.type == "cuda" else f"CPU ({platform.machine()}), smoke",
           "date": time.strftime("%Y-%m-%d"), "layers": s.layers, "topk_source": args.topk_source,
           "topk_label": "SYNTHETIC (ess trace synth)" if args.topk_source == "synth" else "computed (random weights)",
           "attention": s.attention, "hardware_profile": args.hardware, **doc}
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(args.out, "decode.png"))
    print(f"wrote {args.out}/decode.json and decode.png; gain {doc.get('gain_32k_max_batch')}, "
          f"small-batch ratio {doc.get('ratio_small_batch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
