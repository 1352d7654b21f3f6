"""The GPU kit: what ESS does on one H100 / H200 with the real FlashMLA kernel, in one run (docs/gpu.md).

    bash benchmark/gpu/run.sh OUT_DIR            # on a GPU: the CUDA tests, then this script
    bash benchmark/gpu/run.sh --smoke OUT_DIR    # on the CPU, tiny sizes, FlashMLA replaced by its torch reference

Parts (keys of OUT_DIR/kit.json):
  tests                      the suite's tests that run without SGLang (run.sh runs them; parsed from JUnit XML)
  flashtrans                 H2D / D2H bandwidth of random 656-byte rows per backend, against a contiguous copy
  flashmla                   FlashMLA over ESS's GPU slots with ESS's indices = FlashMLA over the whole cache with
                             token indices; attention time per layer
  da_split                   Attn0 (hits) + Attn1 (misses) merged by log-sum-exp against one call; -1 entries;
                             FlashMLA's extra cache, on the GPU and on the pinned host pool through UVA;
                             miss_kernel: Attn0 (FlashMLA, misses -1) + ess.core.kernels.miss_attention's kernel over the
                             compacted miss lists + merge, by misses per request; fused_copy_attend: the misses'
                             H2D fused with Attn1 on the copy stream beside Attn0, its exposed time against the
                             copy's own; miss_kernel_variants: the kernel's block sizes at 256 misses
  cuda_graph                 one ESS layer step (indexer, LRU step, H2D on the copy stream, FlashMLA) captured,
                             replayed with new inputs = eager
  bookkeeping_us_per_layer   the LRU step and the misses' H2D per layer, against FlashMLA's time
  overlap                    benchmark/overlap_layer.py with FlashMLA: layer time and exposed transfer per mode
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys
import time
import xml.etree.ElementTree as ET

import torch

from ess.reference import flashmla
from ess.core import layout
from ess.core.kernels import flashtrans
from ess.core.kernels import miss_attention as MA
from ess.core.streams import Streams
from ess.reference import attention as A
from ess.analysis.timing import capture, graph_us, median_us
from ess.reference.layer_setup import build_layer, graph_replay_check, preload
from ess.reference.overlap import MODES
from ess.reference.config import get_config
from ess.core.serving import ServingLatentCache

ROOT = pathlib.Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[kit {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def random_rows(n: int, device, chunk: int = 1 << 18) -> torch.Tensor:
    """n valid latent rows (random values quantised as SGLang does), made in chunks to bound the float temporaries."""
    out = torch.empty(n, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=device)
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        out[i : i + m] = layout.quantize_latent(torch.randn(m, 512, device=device), torch.randn(m, 64, device=device))
    return out


def pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


# -- FlashTrans -----------------------------------------------------------------------------------------------------
def part_flashtrans(dev, smoke: bool) -> dict:
    sizes = [64, 256] if smoke else [1024, 4096, 16384, 65536, 327680]
    n_host, n_gpu = 4 * sizes[-1], 2 * sizes[-1]
    gen = torch.Generator().manual_seed(1)
    host = pinned(torch.randint(0, 256, (n_host, layout.LATENT_ROW_BYTES), dtype=torch.uint8, generator=gen))
    host_out = pinned(torch.zeros_like(host))
    gpu = torch.zeros(n_gpu, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=dev)
    cuda = dev.type == "cuda"
    if cuda:
        uva_in, uva_out = flashtrans.uva_view(host), flashtrans.uva_view(host_out)

    def h2d(backend, rows, slots):
        if backend == "torch_uva":  # torch's own gather kernel reading the host pool through UVA
            return lambda: gpu.index_copy_(0, slots, uva_in[rows])
        return lambda: flashtrans.gather(host, rows, gpu, slots, backend)

    def d2h(backend, rows, slots):
        if backend == "torch_uva":
            return lambda: uva_out.index_copy_(0, rows, gpu[slots])
        return lambda: flashtrans.scatter(gpu, slots, host_out, rows, backend)

    backends = ["triton", "torch_uva", "torch"] if cuda else ["interpret", "torch"][not flashtrans.INTERPRETER_OK :]
    table = []
    for n in sizes:
        rows = torch.randperm(n_host, generator=gen)[:n].to(dev)
        slots = torch.randperm(n_gpu, generator=gen)[:n].to(dev)
        mb = n * layout.LATENT_ROW_BYTES / 1e3  # bytes / 1e3 / us = MB/s ... / 1e3 -> GB/s below
        row = {"rows": n}
        for b in backends:
            # torch's fallback syncs (host-side gather), so it cannot be captured: eager; the rest as graph replays
            timer, iters = (median_us, 3) if b == "torch" else (graph_us, 2 if smoke else 20)
            gpu.zero_()
            row[f"{b}_h2d_gbps"] = round(mb / timer(h2d(b, rows, slots), iters), 2)
            exact = torch.equal(gpu[slots].cpu(), host[rows.cpu()])
            host_out.zero_()
            row[f"{b}_d2h_gbps"] = round(mb / timer(d2h(b, rows, slots), iters), 2)
            if cuda:
                torch.cuda.synchronize()
            row[f"{b}_exact"] = exact and torch.equal(host_out[rows.cpu()], gpu[slots].cpu())
        row["contiguous_h2d_gbps"] = round(mb / graph_us(lambda: gpu[:n].copy_(host[:n], non_blocking=True), 20), 2)
        row["contiguous_d2h_gbps"] = round(mb / graph_us(lambda: host_out[:n].copy_(gpu[:n], non_blocking=True), 20), 2)
        table.append(row)
        log(f"flashtrans {n} rows: " + ", ".join(f"{k}={v}" for k, v in row.items() if k.endswith("gbps")))
    grids = []  # the Triton kernel's grid: (rows per iteration, programs; 0 = one program per `rows` pairs)
    for n in sizes[-3:]:
        rows = torch.randperm(n_host, generator=gen)[:n].to(dev)
        slots = torch.randperm(n_gpu, generator=gen)[:n].to(dev)
        mb = n * layout.LATENT_ROW_BYTES / 1e3
        for grid in [(1, 0), (8, 0), (16, 16), (16, 32), (16, 64), (8, 132)]:
            b = backends[0]
            h = graph_us(lambda: flashtrans.copy_rows(host, rows, gpu, slots, b, *grid), 2 if smoke else 20)
            d = graph_us(lambda: flashtrans.copy_rows(gpu, slots, host_out, rows, b, *grid), 2 if smoke else 20)
            grids.append({"rows": n, "grid": list(grid), "h2d_gbps": round(mb / h, 2), "d2h_gbps": round(mb / d, 2)})
    log(f"flashtrans grids: {grids}")
    best, last = backends[0], table[-1]
    return {
        "backend": best,
        "h2d_gbps": last[f"{best}_h2d_gbps"],
        "d2h_gbps": last[f"{best}_d2h_gbps"],
        "contiguous_h2d_gbps": last["contiguous_h2d_gbps"],
        "contiguous_d2h_gbps": last["contiguous_d2h_gbps"],
        "at_rows": last["rows"],
        "exact": all(r[f"{b}_exact"] for r in table for b in backends),
        "rows": table,
        "grid": {"rows": flashtrans.ROWS, "programs": flashtrans.PROGRAMS},
        "overlap_grid": {"rows": flashtrans.OVERLAP_ROWS, "programs": flashtrans.OVERLAP_PROGRAMS},
        "grid_variants": grids,
    }


# -- one batch of requests with an ESS cache beside the whole cache ---------------------------------------------
class Case:
    """B requests of `context` tokens: every latent row in a whole-cache GPU buffer (the baseline) and in ESS's
    pinned host pool, ESS's GPU slots warmed up with two random top-k sets, then one decode step's top-k translated
    by ESS (LRU step, misses fetched, own row stored). `topk` holds a few -1 entries, as SGLang's does."""

    def __init__(self, dev, batch: int, context: int, topk: int, capacity: int, heads: int, seed: int = 0):
        torch.manual_seed(seed)
        B, T = batch, batch * context
        self.scale = 576**-0.5
        self.whole = random_rows(T, dev)
        self.host = pinned(torch.empty(1, T + 1, layout.LATENT_ROW_BYTES, dtype=torch.uint8))
        self.host[0, :T].copy_(self.whole)
        self.table = torch.arange(T, device=dev, dtype=torch.int32).view(B, context)  # int32: SGLang's req_to_token
        self.sc = ServingLatentCache(1, B, capacity, context, self.host, dev)
        self.req = torch.arange(B, device=dev)

        def draw():
            return torch.rand(B, context - 1, device=dev).topk(topk, dim=1).indices

        self.sc.warmup(0, self.req, self.table, torch.stack([draw(), draw()], 1))
        self.topk = draw()
        self.topk[0, -5:] = -1
        self.own = torch.full((B,), context - 1, device=dev)
        self.sc.next_step()
        self.state = [t.clone() for t in (*self.sc.sparse.layer_state(0), self.sc.gpu)]
        self.r = self.step()
        self.q_nope = torch.randn(B, heads, 512, device=dev)
        self.q_pe = torch.randn(B, heads, 64, device=dev)
        self.token_idx = torch.where(self.topk >= 0, self.table.gather(1, self.topk.clamp(min=0)), -1)

    def restore(self) -> None:
        for t, s in zip((*self.sc.sparse.layer_state(0), self.sc.gpu), self.state):
            t.copy_(s)

    def step(self):
        return self.sc.translate(0, self.req, self.table, self.topk, self.own, self.whole[self.table[:, -1]])

    def attend(self, pool, idx, backend="auto"):
        return flashmla.sparse_decode(self.q_nope, self.q_pe, pool, idx, self.scale, backend)


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(context=256, topk=64, capacity=80, heads=4, batches=[1, 2], split_batch=2, iters=2, smoke=True)
    return dict(context=32768, topk=2048, capacity=6554, heads=128, batches=[1, 32, 128], split_batch=32, iters=20)


def part_flashmla_and_bookkeeping(dev, smoke: bool) -> tuple[dict, dict]:
    s = sizes(smoke)
    attn, book, equal, max_err, ref_err = {}, {}, True, 0.0, {}
    for B in s["batches"]:
        c = Case(dev, B, s["context"], s["topk"], s["capacity"], s["heads"])
        o_ess, lse_ess = c.attend(c.sc.gpu[0], c.r.attn_slot)
        o_whole, lse_whole = c.attend(c.whole, c.token_idx)
        equal &= bool(torch.equal(o_ess, o_whole) and torch.equal(lse_ess, lse_whole))
        max_err = max(max_err, float((o_ess - o_whole).abs().max()))
        if B <= 32:  # the float32 reference gathers [B, K, 512] floats
            ref_err[str(B)] = round(rel_err(o_ess, c.attend(c.whole, c.token_idx, "reference")[0]), 6)
        attn[str(B)] = round(graph_us(lambda: c.attend(c.sc.gpu[0], c.r.attn_slot), s["iters"]), 1)
        lru = graph_us(lambda: c.sc.update(0, c.req, c.topk, c.own), s["iters"], c.restore)
        full = graph_us(c.step, s["iters"], c.restore)
        book[str(B)] = {"lru_step_us": round(lru, 1), "lru_step_and_h2d_us": round(full, 1),
                        "eager_lru_step_and_h2d_us": round(median_us(c.step, s["iters"], c.restore), 1),
                        "misses_per_request": round(float(c.r.n_miss.float().mean()), 1),
                        "lru_step_share_of_flashmla": round(lru / attn[str(B)], 3)}
        log(f"flashmla batch {B}: equal={equal} attn {attn[str(B)]} us; bookkeeping {book[str(B)]}")
        del c
    backend = "flashmla" if dev.type == "cuda" and flashmla.available() else "reference"
    fm = {"equal": equal, "max_abs_err": max_err, "attn_us": attn, "timing": "CUDA graph replays", "rel_err_vs_float32_reference": ref_err,
          "backend": backend, "context": s["context"], "topk": s["topk"], "heads": s["heads"],
          "buffer_tokens": s["capacity"]}
    return fm, {"batches": book, "context": s["context"], "topk": s["topk"], "buffer_tokens": s["capacity"],
                "path": "the serving default: the fused LRU step (ess.core.kernels.lru_step) on a GPU, ess.core.policy's torch ops on a CPU; "
                        "FlashTrans over the compacted miss lists",
                "note": "lru_step_us is the bookkeeping; lru_step_and_h2d_us adds the misses' H2D (random top-k sets "
                        "after a random warm-up: most entries miss, a worst case for the transfer)",
                "timing": "CUDA graph replays (eager_*: one eager call, Python launch overhead included)"}


# -- DA split ---------------------------------------------------------------------------------------------------------
def _raw_call(c: Case, pool, idx, **extra):
    """FlashMLA's legacy sparse decode called directly (raw output and lse, extra arguments as given)."""
    fm = flashmla._flash_mla()
    q = torch.cat([c.q_nope, c.q_pe], -1).to(torch.bfloat16).unsqueeze(1)
    meta, _ = fm.get_mla_metadata()
    page = (-1, flashmla.PAGE, 1, layout.LATENT_ROW_BYTES)
    return fm.flash_mla_with_kvcache(q, pool.view(page), None, None, 512, meta, softmax_scale=c.scale,
                                     indices=idx.int().unsqueeze(1), is_fp8_kvcache=True, use_legacy=True, **extra)


def part_da_split(dev, smoke: bool) -> dict:
    s = sizes(smoke)
    B, K = s["split_batch"], s["topk"]
    c = Case(dev, B, s["context"], K, s["capacity"], s["heads"], seed=3)
    pool, idx = c.whole, c.token_idx
    unsplit, _ = c.attend(pool, idx)
    t_unsplit = graph_us(lambda: c.attend(pool, idx), s["iters"])
    none = torch.full_like(idx, -1)
    rows = []
    for f in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0):
        hit = torch.rand(idx.shape, device=dev) < f
        i0, i1 = torch.where(hit, idx, none), torch.where(hit, none, idx)
        merged, _ = flashmla.split_decode(c.q_nope, c.q_pe, pool, idx, hit, c.scale)
        row = {"hit_fraction": f, "attn0_us": round(graph_us(lambda: c.attend(pool, i0), s["iters"]), 1),
               "attn1_us": round(graph_us(lambda: c.attend(pool, i1), s["iters"]), 1),
               "rel_err_vs_unsplit": rel_err(merged, unsplit)}
        row["split_total_us"] = round(row["attn0_us"] + row["attn1_us"], 1)
        rows.append(row)
    valid = []
    for m in sorted({0, K // 8, K // 2, K}):
        i_m = torch.where(torch.arange(K, device=dev) < m, idx, none)
        valid.append({"valid_entries": m, "us": round(graph_us(lambda: c.attend(pool, i_m), s["iters"]), 1)})
    out = {"batch": B, "context": s["context"], "topk": K, "unsplit_us": round(t_unsplit, 1), "by_hit_fraction": rows,
           "by_valid_entries": valid, "max_rel_err_vs_unsplit": max(r["rel_err_vs_unsplit"] for r in rows),
           "timing": "CUDA graph replays"}
    if dev.type == "cuda" and flashmla.available():
        hit = torch.rand(idx.shape, device=dev) < 0.75
        i0, i1 = torch.where(hit, idx, none), torch.where(hit, none, idx)
        uva = flashtrans.uva_view(c.host[0, : c.whole.shape[0]])  # the host pool's rows, whole pages, through UVA
        page = (-1, flashmla.PAGE, 1, layout.LATENT_ROW_BYTES)
        for name, kw in (("topk_length", {"topk_length": torch.full((B,), K // 2, dtype=torch.int32, device=dev)}),
                         ("extra_gpu", {"extra_k_cache": pool.view(page), "extra_indices_in_kvcache": i1.int().unsqueeze(1)}),
                         ("extra_host_uva", {"extra_k_cache": uva.view(page), "extra_indices_in_kvcache": i1.int().unsqueeze(1)})):
            try:  # what the kernel refuses is a result too
                _raw_call(c, pool, i0, **kw)
                torch.cuda.synchronize()
                out[name] = {"runs": True, "us": round(graph_us(lambda: _raw_call(c, pool, i0, **kw), s["iters"]), 1)}
            except Exception as e:
                out[name] = {"runs": False, "error": str(e).splitlines()[0][:300]}
        o_raw, lse_raw = _raw_call(c, pool, none)  # every entry -1: what the kernel returns for an empty row
        out["empty_row_raw"] = {"o_all_zero": bool((o_raw == 0).all()), "o_finite": bool(torch.isfinite(o_raw).all()),
                                "lse": float(lse_raw.flatten()[0])}
        try:  # every row read straight from the host pool through UVA (no copy at all)
            out["all_rows_from_host_uva_us"] = round(graph_us(lambda: c.attend(uva, idx), s["iters"]), 1)
            out["all_rows_from_host_uva_gbps"] = round(B * K * layout.LATENT_ROW_BYTES / 1e3 / out["all_rows_from_host_uva_us"], 2)
            out["all_rows_from_host_uva_rel_err"] = rel_err(c.attend(uva, idx)[0], unsplit)
        except Exception as e:
            out["all_rows_from_host_uva_error"] = str(e).splitlines()[0][:300]
    out.update(part_miss_kernel(c, s, dev, unsplit, t_unsplit))
    log(f"da_split: unsplit {out['unsplit_us']} us, rows {rows}, valid {valid}")
    return out


def miss_counts(smoke: bool, K: int) -> list[int]:
    return [0, 8, 32] if smoke else [m for m in (0, 16, 64, 256, 1024, 2047) if m < K]


def part_miss_kernel(c: Case, s: dict, dev, unsplit: torch.Tensor, t_unsplit: float) -> dict:
    """DA with Attn1 over the misses only (ess.core.kernels.miss_attention): for m misses per request (each request's first m
    valid entries), Attn0 = the attention call over the top-k with those set to -1, Attn1 = the miss kernel over each
    request's compacted list of m rows (the width of the top-k, a device count: as the LRU step hands them over), and
    the merge; then the same misses landing from the pinned host pool in the fused copy-attend kernel on the copy
    stream while Attn0 runs. The misses' rows live in the whole-cache buffer at their token index, and the host pool
    holds the same bytes at the same row, so the fused kernel rewrites identical bytes (its landing is checked
    byte for byte in a separate buffer first)."""
    pool, idx, K, iters = c.whole, c.token_idx, c.token_idx.shape[1], s["iters"]
    B = idx.shape[0]
    cuda = dev.type == "cuda"
    backend = "auto" if cuda else ("interpret" if flashtrans.INTERPRETER_OK else "torch")  # smoke: the kernel's code
    host = c.host[0]
    streams = Streams(dev)
    rank = torch.cumsum((idx >= 0).int(), 1) - 1  # each entry's rank among its row's valid entries

    def miss_lists(m: int):
        """The first m valid entries of each row missing: (the miss mask, compacted lists, counts)."""
        miss = (idx >= 0) & (rank < m)
        order = torch.sort((~miss).int(), dim=1, stable=True).indices  # the misses first, in entry order
        return miss, torch.where(torch.gather(miss, 1, order), torch.gather(idx, 1, order), -1).int(), miss.sum(1).int()

    miss_rows, fused_rows, worst_err = [], [], 0.0
    for m in miss_counts(s.get("smoke", False), K):
        miss, lists, counts = miss_lists(m)
        i0 = torch.where(miss, -1, idx)

        def attn1():
            return MA.miss_attention(c.q_nope, c.q_pe, pool, lists, counts, c.scale, backend)

        o0, lse0 = c.attend(pool, i0)
        o1, lse1 = attn1()
        merged, _ = MA.merge(o0, lse0, o1, lse1)

        def split():
            a0 = c.attend(pool, i0)
            return MA.merge(*a0, *attn1())

        row = {"misses_per_request": m, "attn0_us": round(graph_us(lambda: c.attend(pool, i0), iters), 1),
               "miss_us": round(graph_us(attn1, iters), 1),
               "merge_us": round(graph_us(lambda: MA.merge(o0, lse0, o1, lse1), iters), 1),  # the kernel on a GPU
               "merge_torch_us": round(graph_us(lambda: MA.merge(o0, lse0, o1, lse1, backend="torch"), iters), 1),
               "total_us": round(graph_us(split, iters), 1), "rel_err_vs_unsplit": rel_err(merged, unsplit)}
        row["ratio_to_one_call"] = round(row["total_us"] / t_unsplit, 3)
        worst_err = max(worst_err, row["rel_err_vs_unsplit"])
        miss_rows.append(row)

        # the fused copy-attend: first landed in a scratch buffer and checked, then timed in place
        scratch = torch.zeros_like(pool)
        want = torch.zeros_like(pool)
        flashtrans.gather_lists(host, lists, want, lists, counts, "torch" if not cuda else "auto")
        f1 = MA.copy_attend(c.q_nope, c.q_pe, host, lists, scratch, lists, counts, c.scale, backend)
        if cuda:
            torch.cuda.synchronize()
        landed = bool(torch.equal(scratch[:-1], want[:-1]))  # (the torch gather's sink row aside)
        fused_err = rel_err(MA.merge(o0, lse0, *f1)[0], unsplit)
        del scratch, want

        def copy():
            flashtrans.gather_lists(host, lists, pool, lists, counts, overlapped=True)

        def fused_alone():
            return MA.copy_attend(c.q_nope, c.q_pe, host, lists, pool, lists, counts, c.scale, backend)

        def fused_beside_attn0():
            part1 = {}
            done = streams.copy_after(lambda: part1.update(o=fused_alone()), lists, counts)
            a0 = c.attend(pool, i0)
            streams.wait(done)
            return MA.merge(*a0, *part1["o"])

        f = {"misses_per_request": m, "attn0_us": row["attn0_us"], "merge_us": row["merge_us"],
             "copy_us": round(graph_us(copy, iters), 1), "copy_attend_us": round(graph_us(fused_alone, iters), 1),
             "total_us": round(graph_us(fused_beside_attn0, iters), 1), "landed_exact": landed,
             "rel_err_vs_unsplit": fused_err}
        f["exposed_us"] = round(f["total_us"] - f["attn0_us"] - f["merge_us"], 1)
        f["exposed_share_of_copy"] = round(f["exposed_us"] / f["copy_us"], 3) if f["copy_us"] > 0 and m else None
        fused_rows.append(f)
        worst_err = max(worst_err, fused_err)
        log(f"da_split miss kernel, {m} misses: {row}; fused: {f}")
    variants = []  # the kernel's block sizes at 256 misses per request (the goal), GPU only
    if cuda:
        m = min(256, K)
        _, lists, counts = miss_lists(m)
        for bh, bn, w in ((16, 16, 4), (16, 32, 4), (32, 16, 4), (16, 16, 8), (32, 32, 8), (64, 16, 8), (16, 64, 8)):
            try:
                us = graph_us(lambda: MA.miss_attention(c.q_nope, c.q_pe, pool, lists, counts, c.scale, block_h=bh,
                                                        block_n=bn, num_warps=w), iters)
                variants.append({"block_h": bh, "block_n": bn, "num_warps": w, "miss_us": round(us, 1)})
            except Exception as e:  # a configuration the compiler refuses (registers, shared memory) is a result too
                variants.append({"block_h": bh, "block_n": bn, "num_warps": w, "error": str(e).splitlines()[0][:200]})
        log(f"da_split miss kernel variants at {m} misses: {variants}")
    return {"miss_kernel": miss_rows, "fused_copy_attend": fused_rows, "miss_kernel_variants": variants,
            "miss_kernel_backend": backend if not cuda else "triton",
            "miss_kernel_config": {"block_h": MA.BLOCK_H, "block_n": MA.BLOCK_N, "num_warps": MA.NUM_WARPS},
            "miss_kernel_max_rel_err_vs_unsplit": worst_err}


# -- CUDA graph --------------------------------------------------------------------------------------------------------
def part_cuda_graph(dev, smoke: bool) -> dict:
    if dev.type != "cuda":
        return {"ok": None, "skipped": "CUDA graphs need a CUDA device"}
    attention = "flashmla" if flashmla.available() else "reference"
    cfg = get_config("full", num_layers=1)
    L = build_layer(cfg, batch=4, context=2200, buffer=2100, device=dev)
    snap = preload(L, misses=100)
    modes = {m: graph_replay_check(L, snap, m, attention) for m in MODES}
    ok = all(r["topk_equal"] and r["state_equal"] and r["max_abs_err"] < 1e-2 for r in modes.values())
    held = {}  # the step's own latent rows (the reference's matmuls, not ESS's): captured alone, against eager
    graph = capture(lambda: held.update(rows=A.kv_latent_rows(L.w, L.cfg, L.h, L.pos)))
    graph.replay()
    own_equal = bool(torch.equal(held["rows"], A.kv_latent_rows(L.w, L.cfg, L.h, L.pos)))
    log(f"cuda_graph ({attention}): {modes}; own rows graph = eager: {own_equal}")
    return {"ok": ok, "attention": attention, "modes": modes, "own_rows_graph_equal_eager": own_equal, "batch": 4,
            "context": 2200, "buffer_tokens": 2100}


# -- overlap -------------------------------------------------------------------------------------------------------------
def part_overlap(dev, smoke: bool, out_dir: pathlib.Path) -> dict:
    spec = importlib.util.spec_from_file_location("overlap_layer", ROOT / "benchmark" / "overlap_layer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--smoke"] if smoke else ["--attention", "flashmla" if flashmla.available() else "reference"]
    default = (flashtrans.OVERLAP_ROWS, flashtrans.OVERLAP_PROGRAMS)
    result = bench.run(bench.parser().parse_args(argv))
    bench.plot(result, str(out_dir / "overlap.png"))
    log(f"overlap: {result['exposed_ms']}")
    result["grid_variants"] = {}  # the same study with other grids for the copies beside compute; 1x0: the full grid
    for grid in ([(1, 0)] if smoke else [(1, 0), (16, 16), (16, 64)]):  # the default Attn1 only
        other = bench.run(bench.parser().parse_args(argv + ["--overlap-grid", ",".join(map(str, grid)),
                                                            "--attn1", result["attn1"]]))
        result["grid_variants"]["x".join(map(str, grid))] = {"exposed_ms": other["exposed_ms"], "rows": other["rows"]}
        log(f"overlap, grid {grid}: {other['exposed_ms']}")
    flashtrans.OVERLAP_ROWS, flashtrans.OVERLAP_PROGRAMS = default
    return result


# -- tests -----------------------------------------------------------------------------------------------------------------
def tests_summary(path: pathlib.Path | None) -> dict:
    if path is None or not path.exists():
        return {"ran": False}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{tc.get('classname')}::{tc.get('name')}" for tc in suite.iter("testcase")
              if tc.find("failure") is not None or tc.find("error") is not None]
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return {"ran": True, **n, "failed": failed}


def plot(kit: dict, out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finish(ax, xlabel: str, ylabel: str, title: str) -> None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)

    ft = kit["flashtrans"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, d in zip(axes, ("h2d", "d2h")):
        for key in [k for k in ft[0] if k.endswith(f"{d}_gbps")]:
            ax.plot([r["rows"] for r in ft], [r[key] for r in ft], marker="o", label=key.replace(f"_{d}_gbps", ""))
        ax.set_xscale("log")
        finish(ax, "random 656-byte rows per copy", "GB/s", f"{d.upper()}: {kit['device']}")
    save(fig, "flashtrans.png")

    da = kit["da_split"]
    fig, ax = plt.subplots(figsize=(6, 4))
    f = [r["hit_fraction"] for r in da["by_hit_fraction"]]
    for key in ("attn0_us", "attn1_us", "split_total_us"):
        ax.plot(f, [r[key] for r in da["by_hit_fraction"]], marker="o", label=key[:-3])
    ax.axhline(da["unsplit_us"], color="k", ls="--", label="one call")
    finish(ax, "hit fraction", "us", f"DA split on {kit['flashmla']['backend']}: batch {da['batch']}, top-k {da['topk']}")
    save(fig, "da_split.png")
    if da.get("miss_kernel"):
        fig, ax = plt.subplots(figsize=(6, 4))
        m = [r["misses_per_request"] for r in da["miss_kernel"]]
        for key in ("attn0_us", "miss_us", "total_us"):
            ax.plot(m, [r[key] for r in da["miss_kernel"]], marker="o", label=f"miss kernel: {key[:-3]}")
        for key in ("copy_us", "copy_attend_us", "total_us", "exposed_us"):
            ax.plot(m, [r[key] for r in da["fused_copy_attend"]], marker="x", ls=":", label=f"fused: {key[:-3]}")
        ax.axhline(da["unsplit_us"], color="k", ls="--", label="one call")
        finish(ax, "misses per request", "us", f"DA's Attn1 over the misses: batch {da['batch']}, top-k {da['topk']}")
        save(fig, "da_miss_kernel.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run with the torch reference: checks the kit")
    p.add_argument("--tests", help="JUnit XML of the CUDA test run (run.sh writes it)")
    args = p.parse_args(argv)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("kit.py: needs a CUDA device (or --smoke)")
    dev = torch.device("cpu" if args.smoke else "cuda")
    if dev.type == "cuda":  # clocks up before the first timing
        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        for _ in range(200):
            x @ x
        torch.cuda.synchronize()
    kit = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke: not a measurement)",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "bash benchmark/gpu/run.sh" + (" --smoke" if args.smoke else "") + " OUT_DIR",
        "flashmla_available": flashmla.available(),
        "tests": tests_summary(pathlib.Path(args.tests) if args.tests else None),
    }
    parts = {  # each returns the kit.json keys it measures
        "flashtrans": lambda: {"flashtrans": part_flashtrans(dev, args.smoke)},
        "flashmla": lambda: dict(zip(("flashmla", "bookkeeping_us_per_layer"), part_flashmla_and_bookkeeping(dev, args.smoke))),
        "da_split": lambda: {"da_split": part_da_split(dev, args.smoke)},
        "cuda_graph": lambda: {"cuda_graph": part_cuda_graph(dev, args.smoke)},
        "overlap": lambda: {"overlap": part_overlap(dev, args.smoke, out_dir)},
    }
    for name, part in parts.items():
        t0 = time.time()
        kit.update(part())
        kit.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        (out_dir / "kit.json").write_text(json.dumps(kit, indent=1))  # what is done so far survives a later failure
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    plot(kit, out_dir)
    ok = kit["flashmla"]["equal"] and kit["flashtrans"]["exact"] and kit["cuda_graph"]["ok"] is not False
    ok = ok and not kit["tests"].get("failures") and not kit["tests"].get("errors")
    log(f"kit: {'ok' if ok else 'FAILED'}; {out_dir / 'kit.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
