"""Cache policies side by side (docs/policies.md): LRU (ESS's), lookahead prefetch, score-aware eviction and Belady's
MIN (the optimum), replayed over the same traces at several Sparse Memory Ratios. Per policy and ratio: mean misses
per request-layer-step, rows prefetched, prefetched rows never used, and the H2D bytes moved per request-layer-step.

    python benchmark/policies.py --out benchmark/results/policies            # the defaults below (a few minutes)
    python benchmark/policies.py --trace mine.npz --label "my model" --out DIR   # a trace of yours (ess trace record)
    python benchmark/policies.py --smoke --out /tmp/policies                 # seconds: checks the script
    python benchmark/policies.py --trace real.npz --label "REAL: ..." --ratios 0.05,0.1,0.2,0.3,0.5 --warmup-off \
        --fit real_fit.json --name real --out benchmark/results/policies     # a real trace (docs/policies.md)

Defaults: a reference-model trace (the mini model, random weights: its indexer has no locality, the worst case),
recorded here with ranks past the top-k so that prefetch can run, and the default SYNTHETIC trace (ess trace synth;
not a measurement), which carries no ranks past the top-k: prefetch does not apply to it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

from ess.analysis.profiling import buffer_for_ratio
from ess.analysis.replay import replay_counts
from ess.analysis.synth import SynthOptions, synth_trace
from ess.core.layout import LATENT_ROW_BYTES
from ess.core.settings import DEFAULT_DECAY_SHIFT
from ess.core.trace import load_trace
from ess.reference.demo import DemoOptions, record_trace

RATIOS = [0.1, 0.2, 0.3]
LOOKAHEADS_OF_K = [0.25, 1.0]  # prefetch's lookahead d as a share of top-k
DECAY_SHIFTS = [1, 2, 4]
H2D_BATCH = 32  # requests whose moved rows one layer's FlashTrans launch carries, for the link time per row count  # score-aware eviction's decay: lambda = 1 - 2^-s = 0.5, 0.75, 0.9375


def default_traces(smoke: bool) -> list[tuple[str, object]]:
    if smoke:
        ref = DemoOptions(layers=2, topk=16, batch=2, context=128, steps=4)
        syn = SynthOptions(requests=1, steps=4, layers=2, topk=64, context=512, warmup_windows=4, sinks=2, window=8,
                           churn_min=2, churn_max=20, pool=120)
        lookahead = 16
    else:
        ref = DemoOptions(batch=4, context=2048, steps=32)  # the demo's model and shape
        syn = SynthOptions(requests=2, steps=32, layers=61, context=32768)
        lookahead = 64  # the mini model's top-k
    return [("reference mini model, random weights", record_trace(ref, lookahead=lookahead)),
            ("SYNTHETIC (ess trace synth; not a measurement)", synth_trace(syn))]


@functools.cache
def _modelled_costs():
    """The simulator's modelled terms for DeepSeek-V3.2 (its calibration read once per run)."""
    from ess.analysis.sim.cost import modelled
    from ess.analysis.sim.engine import load_calibration
    from ess.analysis.sim.specs import get_model

    return modelled(load_calibration(), get_model("dsv32"))


def _h2d_us(rows: float) -> float:
    """The modelled FlashTrans time (ess.analysis.sim.cost) of one layer's moved rows for H2D_BATCH requests: the
    link time the rows cost in a DeepSeek-V3.2 step on the simulator's default hardware (656-byte rows)."""
    return _modelled_costs().h2d(H2D_BATCH * rows) * 1e6


def compare(label: str, trace, ratios: list[float], decay_shifts: list[int], warmup_off: bool = False) -> dict:
    K = trace.topk.shape[3]
    warm = trace.prefill_topk is not None
    runs = [("lru", None, None, warm), ("belady", None, None, warm)] + [("score", None, s, warm) for s in decay_shifts]
    runs += [("prefetch", max(1, round(f * K)), None, warm) for f in LOOKAHEADS_OF_K
             if max(1, round(f * K)) <= trace.lookahead]
    if warmup_off and warm:  # LRU-Warmup off: decode starts with an empty buffer
        runs.insert(1, ("lru", None, None, False))
    rows = []
    for ratio in ratios:
        C = buffer_for_ratio(trace, ratio)
        for policy, d, s, w in runs:
            t0 = time.perf_counter()
            c = replay_counts(trace, C, w, policy=policy, lookahead=d, decay_shift=s or DEFAULT_DECAY_SHIFT)
            misses, pre = float(c.misses.mean()), float(c.prefetched.mean())
            rows.append({"ratio": ratio, "buffer_tokens": C, "policy": policy, "lookahead": d, "decay_shift": s,
                         "warmup": w, "mean_misses": round(misses, 3), "mean_prefetched": round(pre, 3),
                         "prefetch_hits": round(float(c.prefetch_hits.mean()), 3),
                         "wasted_share": round(float(c.wasted.sum() / max(1, c.prefetched.sum())), 4),
                         "rows_moved": round(misses + pre, 3),
                         "bytes_per_step": round((misses + pre) * LATENT_ROW_BYTES, 1),
                         f"h2d_us_batch{H2D_BATCH}": round(_h2d_us(misses + pre), 2),
                         "replay_s": round(time.perf_counter() - t0, 2)})
    R, steps, layers, _ = trace.topk.shape
    return {"trace": label, "requests": R, "steps": steps, "layers": layers, "topk": K,
            "context": float(trace.context_len.mean()), "warmup": warm, "lookahead_in_trace": trace.lookahead,
            "rows": rows}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.8), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = sorted({(r["policy"], r["lookahead"], r["decay_shift"], r.get("warmup", True)) for r in res["rows"]},
                       key=str)
        for i, (policy, d, s, w) in enumerate(names):
            pts = [r for r in res["rows"] if (r["policy"], r["lookahead"], r["decay_shift"], r.get("warmup", True))
                   == (policy, d, s, w)]
            label = {"lru": "LRU (ESS)", "belady": "MIN (the optimum)", "score": f"score-aware, decay shift {s}"}.get(
                policy, f"prefetch d={d}") + ("" if w or not res["warmup"] else ", no warm-up")
            ax.plot([r["ratio"] for r in pts], [r["mean_misses"] for r in pts], marker="o", color=f"C{i}", label=label)
            if policy == "prefetch":
                ax.plot([r["ratio"] for r in pts], [r["bytes_per_step"] / LATENT_ROW_BYTES for r in pts], ls=":",
                        color=f"C{i}", label=f"{label}: rows moved")
        ax.set_xlabel("Sparse Memory Ratio")
        ax.set_ylabel("mean misses per request-layer-step")
        ax.set_title(f"{res['trace']}\nK {res['topk']}, context {res['context']:.0f}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for policies.json and policies.png (created)")
    p.add_argument("--trace", action="append", help="trace .npz instead of the defaults (repeatable)")
    p.add_argument("--label", action="append", help="a label per --trace (say whether it is synthetic)")
    p.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=RATIOS)
    p.add_argument("--decay-shifts", type=lambda s: [int(x) for x in s.split(",")], default=DECAY_SHIFTS,
                   help="score-aware eviction's decays to compare, comma-separated")
    p.add_argument("--smoke", action="store_true", help="tiny traces: checks the script in seconds")
    p.add_argument("--warmup-off", action="store_true", help="also LRU without LRU-Warmup (decode from an empty buffer)")
    p.add_argument("--fit", action="append", help="a `ess trace synth --like` fit report (--fit-out) per --trace: "
                                                  "its error goes beside the trace's results")
    p.add_argument("--name", default="policies", help="the output files' name: NAME.json and NAME.png")
    args = p.parse_args(argv)
    # many small replays: on a machine whose cores are shared, torch's thread pool only waits on itself
    import torch

    torch.set_num_threads(1)
    if args.trace:
        labels = args.label or []
        if len(labels) not in (0, len(args.trace)):
            p.error("--label: one per --trace, or none")
        traces = [(labels[i] if labels else path, load_trace(path)) for i, path in enumerate(args.trace)]
    else:
        traces = default_traces(args.smoke)
    results = [compare(label, tr, args.ratios, args.decay_shifts, args.warmup_off) for label, tr in traces]
    for res, fit in zip(results, args.fit or []):
        with open(fit) as f:
            doc = json.load(f)
        res["synthetic_fit"] = {k: doc[k] for k in ("ratios", "real_curve", "synthetic_curve", "relative_error",
                                                    "max_relative_error", "within_15_percent", "options",
                                                    "real_stats", "synthetic_stats")}
    os.makedirs(args.out, exist_ok=True)
    doc = {"command": " ".join(["python", "benchmark/policies.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
           "date": time.strftime("%Y-%m-%d"), "results": results}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(results, os.path.join(args.out, f"{args.name}.png"))
    for res in results:
        print(res["trace"])
        for r in res["rows"]:
            knob = f"d={r['lookahead']}" if r["lookahead"] else f"s={r['decay_shift']}" if r["decay_shift"] else \
                "" if r["warmup"] or not res["warmup"] else "cold"
            print(f"  ratio {r['ratio']:.2f} {r['policy']:>8} {knob:<5} misses {r['mean_misses']:9.2f}"
                  f"  prefetched {r['mean_prefetched']:7.2f}  wasted {r['wasted_share']:.2f}  bytes/step {r['bytes_per_step']:.0f}")
    print(f"wrote {args.out}/{args.name}.json and {args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
