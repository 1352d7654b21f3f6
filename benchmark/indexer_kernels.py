"""Where the decode indexer's time goes: ESS's indexer kernel (ess.core.kernels.indexer) and its top-k, part by part,
at the decode stack's shapes, against the byte floor of reading every token's index-K row once.

On the H200 (docs/gpu.md) the indexer and its top-k took 1.91 of about 3.2 ms per layer of ESS's step at 32K, batch
204: about 10x the floor. This splits that time: the scores kernel (fp32 out), the same kernel writing the int64 keys
the exact top-k ranks, torch.topk over those keys (what indexer_topk_fp8 runs), the radix select over the fp32 scores
(ess.core.kernels.topk_select, one program a request: its kernel, then the sort of the k it picked; select="radix"), the
radix select split across programs (ess.core.kernels.topk_split) over the same scores, the fused path whole (select="fused":
the scores kernel counting the split select's first histogram, the other passes, the sort), the scores kernel over
the same rows in SGLang's own pages (the GPU rig's logits), and, for comparison only,
torch.topk over the fp32 scores (not select_topk's tie rule), sorted and unsorted; then the keys kernel under other
launch configurations (positions per block, warps, how rows are loaded: bytes, or 4-byte words unpacked in
registers, since a 132-byte row is not 16-byte aligned; and blocks per program, the queries loaded once for them) at
the largest case. Each figure: the median of CUDA graph
replays; each path's top-k is checked against select_topk over the kernel's scores (`*_exact`).

    python benchmark/indexer_kernels.py OUT_DIR            # on a GPU: OUT_DIR/indexer.json
    python benchmark/indexer_kernels.py --smoke OUT_DIR    # tiny shapes on the CPU (the kernel in Triton's interpreter where
                                                   # it runs, else the torch reference): checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ess.analysis.sim.specs import get_hardware
from ess.analysis.timing import graph_us
from ess.core import dsa_math, layout
from ess.core.kernels import flashtrans
from ess.core.kernels import indexer
from ess.core.kernels.indexer import (BLOCK_T, LOADS, NUM_WARPS, SPAN, indexer_keys_fp8, indexer_scores_fp8,
                                     indexer_scores_pages, indexer_topk_fp8, topk_from_keys)
from ess.core.kernels.topk_select import positions_from_keys, radix_keys
from ess.core.kernels.topk_split import CHUNK, split_keys

HEADS, TOPK = 64, 2048  # DeepSeek-V3.2's indexer: 64 heads of 128, top-2048
# (context, batch): batch 1, the baseline's memory wall and ESS's largest batch at ratio 0.1 (decode_gpu.py's)
GPU_CASES = [(32768, 1), (32768, 52), (32768, 204), (131072, 1), (131072, 13), (131072, 51)]
ESS_SHAPES = [(32768, 204), (131072, 51)]  # issue 48's two shapes: ESS's largest batches, for worst_over_floor
# (positions per block, warps, row loads, blocks per program) at the largest case; "words": 4-byte loads unpacked in
# registers; blocks per program > 1: the queries loaded once for them
SWEEP = [(64, 4, "bytes", 1), (128, 4, "bytes", 1), (128, 8, "bytes", 1), (256, 8, "bytes", 1), (64, 2, "bytes", 1),
         (64, 4, "words", 1), (128, 4, "words", 1), (128, 8, "words", 1), (256, 8, "words", 1),
         (128, 4, "bytes", 4), (128, 4, "words", 4), (64, 4, "words", 8)]
# each of indexer.SELECTS: the row field of its whole time (scores and top-k), and of that over the byte floor
SERVED = {"keys": "indexer_topk_us", "radix": "indexer_radix_us", "fused": "indexer_fused_us"}
OVER_FLOOR = {"keys": "over_floor", "radix": "over_floor_radix", "fused": "over_floor_fused"}
SMOKE_CASES, SMOKE_HEADS, SMOKE_TOPK = [(300, 1), (300, 3)], 8, 64


def log(msg: str) -> None:
    print(f"[indexer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def case_inputs(context: int, batch: int, heads: int, device: torch.device, seed: int = 0):
    """Queries [N, H, 128] bf16 (FP8-exact values, as the model's), head weights [N, H], index-K rows [N, T, 132] of
    random keys, every request at its last position."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, layout.INDEX_DIM, generator=g, device=device).to(layout.FP8).to(torch.bfloat16)
    w = torch.randn(batch, heads, generator=g, device=device)
    rows = layout.quantize_index_k(torch.randn(batch, context, layout.INDEX_DIM, generator=g, device=device))
    pos = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    return q, w, rows, pos


def floor_us(rows: torch.Tensor, hbm_tbps: float | None) -> float | None:
    """Reading every index-K row once at the part's HBM bandwidth (its datasheet's, ess/analysis/sim/data)."""
    return round(rows.numel() / (hbm_tbps * 1e12) * 1e6, 1) if hbm_tbps else None


def as_pages(rows: torch.Tensor):
    """Index-K rows [N, T, 132] as SGLang's pages [N * P, 64 * 132] (zero rows past T) and the page table [N, P]."""
    N, T, _ = rows.shape
    P = -(-T // layout.INDEX_PAGE_TOKENS)
    padded = torch.zeros(N, P * layout.INDEX_PAGE_TOKENS, layout.INDEX_ROW_BYTES, dtype=torch.uint8, device=rows.device)
    padded[:, :T] = rows
    table = torch.arange(N * P, dtype=torch.int32, device=rows.device).view(N, P)
    return layout.index_k_rows_to_pages(padded.view(-1, layout.INDEX_ROW_BYTES)), table


def time_case(inputs, k, backend, iters, hbm_tbps) -> dict:
    """One case's parts; inputs from case_inputs, k already at most the context."""
    q, w, rows, pos = inputs
    (batch, heads, _), context = q.shape, rows.shape[1]
    keys = indexer_keys_fp8(q, w, rows, pos, backend=backend)
    scores = indexer_scores_fp8(q, w, rows, pos, backend=backend)

    def us(fn) -> float:
        return round(graph_us(fn, iters), 1)

    row = {"context": context, "batch": batch, "heads": heads, "topk": k,
           "index_k_mb": round(rows.numel() / 1e6, 1), "byte_floor_us": floor_us(rows, hbm_tbps),
           "scores_kernel_us": us(lambda: indexer_scores_fp8(q, w, rows, pos, backend=backend)),
           "keys_kernel_us": us(lambda: indexer_keys_fp8(q, w, rows, pos, backend=backend)),
           "topk_keys_us": us(lambda: topk_from_keys(keys, k)),
           "topk_float_sorted_us": us(lambda: torch.topk(scores, k, dim=1)),
           "topk_float_unsorted_us": us(lambda: torch.topk(scores, k, dim=1, sorted=False))}
    interpret = backend == "interpret"
    if backend != "torch":  # the radix select over the fp32 scores (ess.core.kernels.topk_select): kernel, then sort of k
        picked = radix_keys(scores, pos, k, interpret=interpret)
        row["radix_select_us"] = us(lambda: radix_keys(scores, pos, k, interpret=interpret))
        row["radix_sort_us"] = us(lambda: positions_from_keys(picked))
        row["indexer_radix_us"] = round(row["scores_kernel_us"] + row["radix_select_us"] + row["radix_sort_us"], 1)
        # the split select (ess.core.kernels.topk_split) over the same scores, its own pass 0 included; then the fused path
        # whole (select="fused": zeroed state, scores kernel counting pass 0, passes 1-7, write, sort), as it runs
        row["split_select_us"] = us(lambda: split_keys(scores, pos, k, interpret=interpret))
        row["indexer_fused_us"] = us(lambda: indexer_topk_fp8(q, w, rows, pos, k, backend=backend, select="fused"))
        # the scores kernel over the same rows in SGLang's pages (what the GPU rig's logits read: 128-byte rows, their
        # scales apart), against the 132-byte rows above
        pages, table = as_pages(rows)
        row["pages_scores_kernel_us"] = us(lambda: indexer_scores_pages(q, w, pages, pos, table, width=context,
                                                                        backend=backend))
        row["pages_exact"] = bool(torch.equal(indexer_scores_pages(q, w, pages, pos, table, width=context,
                                                                   backend=backend), scores))
    row["indexer_topk_us"] = round(row["keys_kernel_us"] + row["topk_keys_us"], 1)
    if row["byte_floor_us"]:
        for path, key in SERVED.items():
            if key in row:
                row[OVER_FLOOR[path]] = round(row[key] / row["byte_floor_us"], 2)
    # exactness, untimed: each top-k is select_topk's over the kernel's own scores
    want = dsa_math.select_topk(scores, pos, k)
    row["topk_exact"] = bool(torch.equal(topk_from_keys(keys, k), want))
    if backend != "torch":
        row["radix_exact"] = bool(torch.equal(positions_from_keys(picked), want))
        split = positions_from_keys(split_keys(scores, pos, k, interpret=interpret))
        row["split_exact"] = bool(torch.equal(split, want))
        fused = indexer_topk_fp8(q, w, rows, pos, k, backend=backend, select="fused")
        row["fused_exact"] = bool(torch.equal(fused, want))  # its scores are the same kernel's: bit-equal
    return row


def worst_over_floor(cases: list[dict], select: str, shapes=ESS_SHAPES) -> dict:
    """The larger of the served path's time over its byte floor at `shapes` (`select`: indexer.SELECT, the
    path the stack and a GPU server run), and the same for the faster path at each shape; {} without them."""
    served = OVER_FLOOR[select]
    at = [c for c in cases if (c["context"], c["batch"]) in shapes and served in c]
    if not at:
        return {}
    best = [min(c[k] for k in OVER_FLOOR.values() if k in c) for c in at]
    return {"worst_over_floor": max(c[served] for c in at), "worst_over_floor_select": select,
            "worst_over_floor_faster_path": max(best), "worst_over_floor_shapes": [[c["context"], c["batch"]] for c in at]}


def sweep(inputs, k, backend, iters) -> list[dict]:
    """The keys kernel under each of SWEEP's launch configurations, on one case's inputs."""
    q, w, rows, pos = inputs
    want = topk_from_keys(indexer_keys_fp8(q, w, rows, pos, backend=backend), k)
    out = []
    for block_t, warps, loads, span in SWEEP:
        def run():
            return indexer_keys_fp8(q, w, rows, pos, backend=backend, block_t=block_t, num_warps=warps, loads=loads,
                                    span=span)
        row = {"block_t": block_t, "num_warps": warps, "loads": loads, "span": span}
        try:  # a configuration that fails to compile or run is recorded, and the others still run
            row |= {"keys_kernel_us": round(graph_us(run, iters), 1),
                    "same_topk": bool(torch.equal(topk_from_keys(run(), k), want))}  # fp32 sums may differ
        except Exception as e:  # noqa: BLE001 (Triton's compile errors have no common base)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out.append(row)
        log(f"sweep {row}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for indexer.json (created)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; checks the script, times nothing")
    p.add_argument("--iters", type=int, default=20, help="timed replays per figure")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be at least 1, got {args.iters}")
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        p.error("needs a CUDA GPU (or --smoke)")
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.init()
        name = torch.cuda.get_device_name()
        part = next((h for h in ("H200", "H100") if h in name), None)
        hbm = get_hardware(part).hbm_tbps if part else None
        backend, cases, heads, k = "triton", GPU_CASES, HEADS, TOPK
    else:
        name, hbm = "CPU (smoke, not a measurement)", None
        backend = "interpret" if flashtrans.INTERPRETER_OK else "torch"
        cases, heads, k = SMOKE_CASES, SMOKE_HEADS, SMOKE_TOPK
    os.makedirs(args.out, exist_ok=True)
    doc = {"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "backend": backend,
           "command": " ".join(["python", "benchmark/indexer_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
           "timing": "median of CUDA graph replays" if cuda else "wall clock (smoke)", "hbm_tbps": hbm,
           "default_launch": {"block_t": BLOCK_T, "num_warps": NUM_WARPS, "loads": LOADS, "span": SPAN,
                              "split_chunk": CHUNK},
           "cases": [], "sweep": []}
    path = os.path.join(args.out, "indexer.json")
    iters = 1 if args.smoke else args.iters
    largest = max(cases, key=lambda c: c[0] * c[1])  # where the launch configurations are swept
    for context, batch in cases:
        inputs = case_inputs(context, batch, heads, device)
        doc["cases"].append(time_case(inputs, min(k, context), backend, iters, hbm))
        log(json.dumps(doc["cases"][-1]))
        if (context, batch) == largest and backend != "torch":  # launch configurations belong to the kernel
            doc["sweep"] = sweep(inputs, min(k, context), backend, iters)
        doc |= worst_over_floor(doc["cases"], indexer.SELECT)
        with open(path, "w") as f:  # after every case: a cut run keeps what it measured
            json.dump(doc, f, indent=1)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
