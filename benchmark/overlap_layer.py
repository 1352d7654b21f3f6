"""Per-layer decode time of each ESS overlap mode against the number of misses (the ESS paper's overlap study).

One DeepSeek-V3.2 attention layer at the full dimensions (128 heads, top-k 2048; random weights), a batch of
requests at a given context, the latent cache in the pinned host pool and a GPU buffer of `--buffer` slots. For each
miss count m the GPU buffer is preloaded so that exactly m of each request's selected positions (not counting its
own token) are missing; the layer step (indexer, top-k, cache update, FlashTrans H2D, own-row write and D2H,
PreAttn, attention) is then timed with CUDA events in each mode, restoring the cache tables before every run.

    python benchmark/overlap_layer.py --json --plot out.png        # on a GPU
    python benchmark/overlap_layer.py --smoke                      # tiny CPU run: checks the script, times nothing

The attention and indexer here are the plain-PyTorch reference, not FlashMLA / DeepGEMM: the study compares the
modes with each other, at the dimensions where the overlap matters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from ess.layer_setup import build_layer, preload, restore
from ess.overlap import MODES, ess_layer_attention
from ess.reference.config import get_config


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        cfg = get_config("mini", num_layers=1)
        batch, context, buffer, miss_counts, iters = 2, 512, 128, [0, 8, 32], 1
    else:
        if device.type != "cuda":
            raise SystemExit("overlap_layer.py: needs a CUDA device (or --smoke)")
        cfg = get_config("full", num_layers=1)
        batch, context, buffer, miss_counts, iters = args.batch, args.context, args.buffer, args.misses, args.iters
    L = build_layer(cfg, batch, context, buffer, device)
    w, h, q_lora, pos, index_k, cache = L.w, L.h, L.q_lora, L.pos, L.index_k, L.cache
    rows = []
    for m in miss_counts:
        snap = preload(L, m)
        for mode in MODES:
            times = []
            for it in range(iters + 1):  # the first run warms up
                restore(L, snap)
                cache.set_step(0)
                cache.misses[0].clear()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    ess_layer_attention(mode, w, cfg, h, q_lora, pos, index_k, cache, 0)
                    end.record()
                    torch.cuda.synchronize()
                    ms = start.elapsed_time(end)
                else:
                    t0 = time.perf_counter()
                    ess_layer_attention(mode, w, cfg, h, q_lora, pos, index_k, cache, 0)
                    ms = (time.perf_counter() - t0) * 1e3
                if it:
                    times.append(ms)
            got = int(cache.misses[0][-1].max())
            if got != m:
                raise SystemExit(f"overlap_layer.py: preload gave {got} misses per request, wanted {m}")
            times.sort()
            rows.append({"misses_per_request": m, "mode": mode, "median_ms": round(times[len(times) // 2], 4),
                         "min_ms": round(times[0], 4)})
            print(f"misses {m:5d}  {mode:4s}  median {rows[-1]['median_ms']:.3f} ms", file=sys.stderr)
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: not a measurement)",
        "config": dataclasses.asdict(cfg),
        "batch": batch,
        "context": context,
        "buffer_tokens": buffer,
        "iters": iters,
        "rows": rows,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in MODES:
        pts = [r for r in result["rows"] if r["mode"] == mode]
        ax.plot([r["misses_per_request"] for r in pts], [r["median_ms"] for r in pts], marker="o", label=mode.upper())
    ax.set_xlabel("misses per request")
    ax.set_ylabel("layer time (ms, median)")
    ax.set_title(f"{result['device']}: batch {result['batch']}, context {result['context']}, top-k "
                 f"{result['config']['index_topk']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--buffer", type=int, default=6554, help="GPU slots per request (0.2 of 32K)")
    p.add_argument("--misses", type=lambda s: [int(x) for x in s.split(",")], default=[0, 16, 64, 256, 1024, 2047])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    result = run(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
