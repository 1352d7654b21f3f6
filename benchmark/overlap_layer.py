"""Per-layer decode time of each ESS overlap mode against the number of misses (the ESS paper's overlap study).

One DeepSeek-V3.2 attention layer at the full dimensions (128 heads, top-k 2048; random weights), a batch of
requests at a given context, the latent cache in the pinned host pool and a GPU buffer of `--buffer` slots. For each
miss count m the GPU buffer is preloaded so that exactly m of each request's selected positions (not counting its
own token) are missing; the layer step (indexer, top-k, cache update, FlashTrans H2D, own-row write and D2H,
PreAttn, attention) is then captured in a CUDA graph per mode and its replays timed with CUDA events, restoring the
cache tables before every replay (`--eager`: eager runs instead).

    python benchmark/overlap_layer.py --attention flashmla --json --plot out.png   # on a GPU
    python benchmark/overlap_layer.py --smoke                      # tiny CPU run: checks the script, times nothing

The attention is FlashMLA's sparse FP8 decode (`--attention flashmla`, the sgl-flash-mla wheel) or the plain-PyTorch
reference; the indexer is the reference, not DeepGEMM. `exposed_ms` is each mode's layer time at m misses minus
its time at 0 misses: the transfer the mode leaves exposed.

DA and DBA run once per Attn1 kind of `--attn1` (ess.core.settings.DA_ATTN1_KINDS, docs/design.md "Overlap"): "miss"
the compact kernel over the compacted miss lists (ess.core.kernels.miss_attention), "fused" the misses' H2D and Attn1 in one
kernel beside Attn0, "calls" a second full-width call. Each row names its `attn1` (none for mode none);
`exposed_ms` is the default kind's (DA_ATTN1), `exposed_ms_by_attn1` every kind's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from ess.core.kernels import flashtrans
from ess.reference.layer_setup import build_layer, preload, restore
from ess.core.settings import DA_ATTN1, DA_ATTN1_KINDS
from ess.reference.overlap import MODES, ess_layer_attention
from ess.reference.config import get_config
from ess.analysis.timing import graph_us, median_us


# A split mode's output against mode none's: FlashMLA's bf16 output and the log-sum-exp merge differ by about 3e-3
# (the kit's da_split, docs/gpu.md); a slot read before its row landed differs by the size of the output itself.
MAX_REL_ERR = 0.05


def run(args) -> dict:
    if args.overlap_grid:
        flashtrans.OVERLAP_ROWS, flashtrans.OVERLAP_PROGRAMS = args.overlap_grid
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

        def start():
            restore(L, snap)
            cache.set_step(0)

        reference = None  # mode none's output at this miss count
        for mode, attn1 in [(m, k) for m in MODES for k in (["-"] if m == "none" else args.attn1)]:
            cache.misses[0].clear()
            timer = median_us if args.eager else graph_us
            kind = DA_ATTN1 if attn1 == "-" else attn1

            def layer():
                o, _ = ess_layer_attention(mode, w, cfg, h, q_lora, pos, index_k, cache, 0, args.attention, attn1=kind)
                return o

            times_ms = timer(layer, iters, start) / 1e3
            got = cache.misses[0][-1].float()  # the last run's (a graph's captured output is updated by its replays)
            start()
            out = layer().float()  # once more, untimed: every mode (and grid) must attend the same rows as none
            reference = out if reference is None else reference
            rel_err = float((out - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
            if rel_err > MAX_REL_ERR:  # e.g. a copy that did not land: the attention read stale slots
                raise SystemExit(f"overlap_layer.py: mode {mode} (Attn1 {attn1}, overlap grid "
                                 f"{flashtrans.OVERLAP_ROWS}x{flashtrans.OVERLAP_PROGRAMS}) at {m} misses differs from "
                                 f"mode none by {rel_err:.3g} (relative), more than {MAX_REL_ERR}")
            # dba runs the indexer per batch half; on a GPU a half-batch matmul can order near-ties of the top-k
            # differently from the whole batch's, so a request may select a row the preload did not make resident
            if (got - m).abs().max() > max(2, m // 100):
                raise SystemExit(f"overlap_layer.py: preload gave {got.tolist()} misses per request, wanted {m}")
            rows.append({"misses_per_request": m, "mode": mode, "attn1": None if mode == "none" else attn1,
                         "median_ms": round(times_ms, 4), "measured_misses_mean": round(float(got.mean()), 2),
                         "max_rel_err_vs_none": round(rel_err, 6)})
            print(f"misses {m:5d}  {mode:4s} {attn1:5s}  median {rows[-1]['median_ms']:.3f} ms", file=sys.stderr)

    def exposed(kind):
        mine = [r for r in rows if r["attn1"] in (None, kind)]
        at0 = {r["mode"]: r["median_ms"] for r in mine if r["misses_per_request"] == miss_counts[0]}
        return {mode: {str(r["misses_per_request"]): round(r["median_ms"] - at0[mode], 4) for r in mine
                       if r["mode"] == mode} for mode in MODES}

    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: not a measurement)",
        "attention": args.attention if device.type == "cuda" else "reference",
        "exposed_ms": exposed(args.attn1[0]),
        "exposed_ms_by_attn1": {kind: exposed(kind) for kind in args.attn1},
        "attn1": args.attn1[0],
        "config": dataclasses.asdict(cfg),
        "batch": batch,
        "context": context,
        "buffer_tokens": buffer,
        "iters": iters,
        "overlap_grid": {"rows": flashtrans.OVERLAP_ROWS, "programs": flashtrans.OVERLAP_PROGRAMS},
        "timing": "eager" if args.eager or device.type != "cuda" else "CUDA graph replays",
        "rows": rows,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in MODES:
        for kind in ([None] if mode == "none" else result.get("exposed_ms_by_attn1", {None: 0})):
            pts = [r for r in result["rows"] if r["mode"] == mode and r.get("attn1") == kind]
            ax.plot([r["misses_per_request"] for r in pts], [r["median_ms"] for r in pts], marker="o",
                    label=mode.upper() + (f", Attn1 {kind}" if kind else ""))
    ax.set_xlabel("misses per request")
    ax.set_ylabel("layer time (ms, median)")
    ax.set_title(f"{result['device']}, {result['attention']}: batch {result['batch']}, context {result['context']}, top-k "
                 f"{result['config']['index_topk']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attn1_kinds(text: str) -> list[str]:
    kinds = text.split(",")
    bad = [k for k in kinds if k not in DA_ATTN1_KINDS]
    if bad or not kinds or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"--attn1: distinct kinds among {','.join(DA_ATTN1_KINDS)}, got {text!r}")
    return kinds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--buffer", type=int, default=6554, help="GPU slots per request (0.2 of 32K)")
    p.add_argument("--misses", type=lambda s: [int(x) for x in s.split(",")], default=[0, 16, 64, 256, 1024, 2047])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="time eager runs instead of CUDA graph replays")
    p.add_argument("--overlap-grid", type=lambda v: tuple(int(x) for x in v.split(",")), metavar="ROWS,PROGRAMS",
                   help="FlashTrans' grid for copies beside compute (ess.core.kernels.flashtrans.OVERLAP_ROWS, OVERLAP_PROGRAMS; "
                        "programs 0: one per ROWS pairs)")
    p.add_argument("--attn1", type=attn1_kinds, default=list(DA_ATTN1_KINDS),
                   help=f"DA / DBA's Attn1 kinds to time, comma-separated, the first the one `exposed_ms` reports "
                        f"(default: {','.join(DA_ATTN1_KINDS)})")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot")
    p.add_argument("--attention", choices=("reference", "flashmla"), default="reference",
                   help="sparse MLA backend (ess.reference.flashmla); flashmla needs a GPU and the sgl-flash-mla wheel")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    result = run(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
