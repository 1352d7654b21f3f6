"""Per-layer cost of ESS's decode bookkeeping: the LRU step through torch ops (ess.core.policy) against the fused Triton
kernel (ess.core.kernels.lru_step) and the CUDA kernel (ess.core.kernels.lru_step_cuda, sgl-kernel/; where it builds), alone and with the
misses' H2D (FlashTrans over the compacted miss lists), and FlashTrans' bandwidth over those lists against a contiguous
pinned copy of the same bytes. Each case carries <kernel>_us, <kernel>_h2d_us, <kernel>_launches and, for the kernels,
<kernel>_equals_torch (results and tables byte for byte).

    python benchmark/bookkeeping.py                 # on a GPU: JSON and a plot under benchmark/results/gpu/<device>/
    python benchmark/bookkeeping.py --smoke OUT     # tiny CPU run (the Triton kernel in Triton's interpreter, the CUDA
                                                    # kernel in its CPU emulation)
    python benchmark/bookkeeping.py --phases        # each kernel's time per phase (GPU)

Each case is a batch of requests whose C slots per layer are full (LRU state as a long decode leaves it), and a
step whose set of S x top-k entries (S query rows: 1 in decode, 3 in MTP verify, duplicates across rows) misses a
given fraction of its positions. Times are medians of CUDA graph replays, the tables restored before each replay
(untimed); the launch count is the number of GPU kernels one eager call runs (torch's profiler).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from ess.core import layout
from ess.core.kernels import flashtrans, lru_step_cuda, lru_step
from ess.core.pinned import pinned_zeros
from ess.core.serving import ServingLatentCache
from ess.analysis.timing import graph_us

GOAL_US_AT_160 = 30.0  # the LRU step's goal per layer at batch 160 (3% of a layer)
KERNELS = ["torch", "fused", "cuda"]  # "cuda" leaves where it does not build (main: cuda_kernel names why)


def log(msg: str) -> None:
    print(f"[bookkeeping {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Case:
    """B requests, C slots each (full), a step of S rows of top-k entries with `miss_fraction` of its positions
    missing; one ServingLatentCache per kernel, both in the same state."""

    def __init__(self, dev, B, K, S, C, context, miss_fraction, host, seed=0):
        """host: a pinned host pool [1, rows + 1, 656] (its bytes do not matter here)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.dev, self.B, self.K, self.S, self.C = dev, B, K, S, C
        host_rows = host.shape[1] - 1
        self.table = torch.randint(0, host_rows, (B, context + S), dtype=torch.int32, generator=g).to(dev)
        self.req = torch.arange(B, device=dev)
        # Resident: C positions from the older half, stamps over the last 64 steps; the step's set: hits from those,
        # misses from the newer half.
        half = context // 2
        resident = torch.stack([torch.randperm(half, generator=g)[:C] for _ in range(B)])
        stamps = 1000 - torch.randint(1, 65, (B, C), generator=g)
        n_miss = round(K * miss_fraction)
        rows = []
        for _ in range(S):
            hits = torch.stack([resident[b, torch.randperm(C, generator=g)[: K - n_miss]] for b in range(B)])
            misses = half + torch.stack([torch.randperm(half - S, generator=g)[:n_miss] for _ in range(B)])
            rows.append(torch.cat([hits, misses], 1))
        self.sets = torch.cat(rows, 1).int().to(dev)  # [B, S * K]
        own = context + torch.arange(S)
        self.own = (own.expand(B, S) if S > 1 else own.expand(B)).contiguous().to(dev)
        self.caches = {}
        for kernel in KERNELS:
            sc = ServingLatentCache(1, B, C, context + S, host, dev, kernel=kernel)
            for b in range(B):
                sc.sparse.load(b, resident[b : b + 1].to(dev), stamps[b : b + 1].to(dev))
            sc.stamp.fill_(1000)
            self.caches[kernel] = (sc, [t.clone() for t in sc.sparse.layer_state(0)])

    def restore(self, kernel: str) -> None:
        sc, saved = self.caches[kernel]
        for t, s in zip(sc.sparse.layer_state(0), saved):
            t.copy_(s)

    def step(self, kernel: str, fetch: bool):
        sc = self.caches[kernel][0]
        r = sc.update(0, self.req, self.sets, self.own, self.table)
        if fetch:
            sc.fetch(0, self.req, self.table, r)
        return r


def kernel_launches(fn) -> int | None:
    """GPU kernels one eager call of fn runs (None on a CPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def time_case(c: Case, iters: int) -> dict:
    out = {"batch": c.B, "topk": c.K, "rows_per_step": c.S, "buffer_tokens": c.C}
    for kernel in KERNELS:
        for fetch in (False, True):
            name = f"{kernel}{'_h2d' if fetch else ''}_us"
            out[name] = round(graph_us(lambda: c.step(kernel, fetch), iters, lambda: c.restore(kernel)), 1)
        out[f"{kernel}_launches"] = kernel_launches(lambda: c.step(kernel, True))
    for kernel in KERNELS:
        c.restore(kernel)
    results = {kernel: c.step(kernel, False) for kernel in KERNELS}
    a = results["torch"]
    fields = ("attn_slot", "hit", "miss_pos", "miss_slot", "own_slot", "n_miss", "n_set")
    for kernel in KERNELS[1:]:
        b = results[kernel]
        out[f"{kernel}_equals_torch"] = all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields) and all(
            torch.equal(x[:, :-1], y[:, :-1])
            for x, y in zip(c.caches["torch"][0].sparse.layer_state(0), c.caches[kernel][0].sparse.layer_state(0))
        )
    out["misses_per_request"] = round(float(a.n_miss.float().mean()), 1)
    out["speedup"] = round(out["torch_us"] / out["fused_us"], 2)  # the Triton kernel's, as before the CUDA kernel
    exact = [k for k in KERNELS[1:] if out[f"{k}_equals_torch"]]
    out["fastest_exact"] = min(exact, key=lambda k: out[f"{k}_us"]) if exact else None
    return out


def list_bandwidth(dev, B: int, K: int, host: torch.Tensor, iters: int) -> dict:
    """FlashTrans over full compacted lists (every entry a miss) against one contiguous pinned copy of the bytes."""
    g = torch.Generator(device="cpu").manual_seed(1)
    host = host[0]
    host_rows = host.shape[0] - 1
    host[:host_rows].copy_(torch.randint(0, 256, (host_rows, layout.LATENT_ROW_BYTES), dtype=torch.uint8, generator=g))
    gpu = torch.zeros(B * K + 1, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=dev)
    rows = torch.randint(0, host_rows, (B, K), dtype=torch.int32, generator=g).to(dev)
    slots = torch.randperm(B * K, generator=g).int().view(B, K).to(dev)
    counts = torch.full((B,), K, dtype=torch.int32, device=dev)
    flashtrans.gather_lists(host, rows, gpu, slots, counts)
    want = host[rows.cpu().long().flatten()]
    exact = bool(torch.equal(gpu[slots.long().flatten()].cpu(), want))
    contiguous = pinned_zeros((B * K, layout.LATENT_ROW_BYTES), pin=dev.type == "cuda")
    dst = torch.empty(B * K, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=dev)
    nbytes = B * K * layout.LATENT_ROW_BYTES
    t_list = graph_us(lambda: flashtrans.gather_lists(host, rows, gpu, slots, counts), iters)
    t_copy = graph_us(lambda: dst.copy_(contiguous, non_blocking=True), iters)
    gbps = lambda us: round(nbytes / us / 1e3, 2)
    grids = {}
    default = (flashtrans.LIST_ROWS, flashtrans.LIST_PROGRAMS)
    for grid in [(1, 1024), (4, 264), (4, 1024), (8, 528), (16, 132), (16, 264)]:
        flashtrans.LIST_ROWS, flashtrans.LIST_PROGRAMS = grid
        grids[f"{grid[0]}x{grid[1]}"] = gbps(graph_us(lambda: flashtrans.gather_lists(host, rows, gpu, slots, counts), iters))
    flashtrans.LIST_ROWS, flashtrans.LIST_PROGRAMS = default
    return {"rows": B * K, "exact": exact, "list_gbps": gbps(t_list), "contiguous_gbps": gbps(t_copy),
            "share_of_contiguous": round(t_copy / t_list, 3),
            "grid": {"rows": default[0], "programs": default[1]}, "gbps_by_grid_rows_x_programs": grids}


def warps_sweep(c: Case, iters: int) -> dict:
    """The fused step's time by warps per program."""
    out = {}
    default = lru_step.NUM_WARPS
    for w in (4, 8, 16):
        lru_step.NUM_WARPS = w
        out[str(w)] = round(graph_us(lambda: c.step("fused", False), iters, lambda: c.restore("fused")), 1)
    lru_step.NUM_WARPS = default
    return out


def select_sweep(c: Case, iters: int) -> dict:
    """The fused step's time by victim search: the bisection (its default) against the histogram select."""
    out = {}
    default = lru_step.SELECT
    for select in ("bisect", "histogram"):
        lru_step.SELECT = select
        out[select] = round(graph_us(lambda: c.step("fused", False), iters, lambda: c.restore("fused")), 1)
    lru_step.SELECT = default
    return out


def cuda_staging(c: Case, iters: int) -> dict:
    """The CUDA kernel with the slots in shared memory (its default where they fit) against out of it (a global
    scratch: how it runs past the device's shared memory)."""
    from ess.core.kernels.lru_step_cuda import lru_update_cuda

    sc = c.caches["cuda"][0]
    out = {}
    for staged in (True, False):
        step = lambda: lru_update_cuda(*sc.sparse.layer_state(0), c.req, c.sets, c.own, sc.stamp, c.table, staged=staged)
        out["staged" if staged else "unstaged"] = round(graph_us(step, iters, lambda: c.restore("cuda")), 1)
    return out


PHASES = {  # each kernel's phases, between its global-timer ticks (the CUDA kernel: thread 0 of each block)
    "fused": ("entries", "misses", "victim_search", "victim_assign", "writes", "outputs"),
    "cuda": ("stage", "claims", "misses", "select", "victims", "outputs"),
}


def phases(dev, host, K: int, context: int, miss_fraction: float) -> list[dict]:
    """Each kernel's time per phase (its programs' or blocks' global timer at each barrier; medians over them) and the
    fused kernel's registers and spills per thread, at a few sizes."""
    from ess.core.kernels.lru_step_cuda import lru_update_cuda
    from ess.core.kernels.lru_step import lru_update_fused

    step = {"fused": lru_update_fused, "cuda": lru_update_cuda}
    rows = []
    for B, S, C in ((1, 1, 6554), (160, 1, 6554), (1, 3, 6147), (160, 3, 6147)):
        c = Case(dev, B, K, S, C, context, miss_fraction, host)
        for kernel in KERNELS[1:]:
            sc = c.caches[kernel][0]
            prof = torch.zeros(B, 8, dtype=torch.int64, device=dev)
            for _ in range(2):  # the first call compiles
                c.restore(kernel)
                step[kernel](*sc.sparse.layer_state(0), c.req, c.sets, c.own, sc.stamp, c.table, profile=prof)
            torch.cuda.synchronize()
            d = (prof[:, 1:7] - prof[:, 0:6]).double().median(0).values.tolist()
            k = lru_step.LAST_LAUNCH if kernel == "fused" else None
            rows.append({"kernel": kernel, "batch": B, "rows_per_step": S, "buffer_tokens": C,
                         "program_ns": dict(zip(PHASES[kernel], d)),
                         "program_total_ns": float((prof[:, 6] - prof[:, 0]).double().median()),
                         "span_ns": int(prof[:, 6].max() - prof[:, 0].min()),
                         "registers": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)})
            log(f"phases: {rows[-1]}")
    return rows


def config_sweep(dev, host, K: int, context: int, miss_fraction: float, iters: int) -> list[dict]:
    """The fused step at batch 160 (S = 1, C = 6554) by warps per program, by how many slots stay in registers
    (fewer: fewer registers, more programs per SM, the keys re-read per search step) and by victim search."""
    c = Case(dev, 160, K, 1, 6554, context, miss_fraction, host)
    rows = []
    saved = lru_step.NUM_WARPS, lru_step.REGISTER_SLOTS, lru_step.MAX_REGISTERS
    saved_select = lru_step.SELECT
    configs = [(w, s, None) for s in (8192, 4096, 2048) for w in (4, 8, 16)]
    configs += [(8, 8192, 128), (8, 8192, 96), (16, 8192, 64), (4, 8192, 128)]  # capped: more programs per SM
    configs = [(*cfg, "bisect") for cfg in configs] + [(w, s, None, "histogram") for s in (8192, 4096) for w in (8, 16)]
    for warps, slots, cap, select in configs:
        lru_step.NUM_WARPS, lru_step.REGISTER_SLOTS, lru_step.MAX_REGISTERS = warps, slots, cap
        lru_step.SELECT = select
        us = graph_us(lambda: c.step("fused", False), iters, lambda: c.restore("fused"))
        k = lru_step.LAST_LAUNCH
        rows.append({"warps": warps, "register_slots": slots, "max_registers": cap, "select": select,
                     "fused_us": round(us, 1),
                     "registers": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)})
        log(f"sweep: {rows[-1]}")
    lru_step.NUM_WARPS, lru_step.REGISTER_SLOTS, lru_step.MAX_REGISTERS = saved
    lru_step.SELECT = saved_select
    return rows


def warmup_compare(dev, iters: int, smoke: bool) -> list[dict]:
    """LRU-Warmup of one layer for a prefill batch: W window-by-window LRU steps (the fused kernel on a GPU, the torch
    ops on a CPU) against the one compaction of SparseMemoryPool.warm; tables only, no row fetch."""
    from ess.core.sparse_pool import SparseMemoryPool

    K, C, P, W = (16, 40, 256, 4) if smoke else (2048, 6554, 32768, 32)
    rows = []
    for B in ((1, 2) if smoke else (1, 4, 32)):
        g = torch.Generator(device="cpu").manual_seed(B)
        sets = torch.stack([torch.stack([torch.randperm(P - 1, generator=g)[:K] for _ in range(W)]) for _ in range(B)])
        sets = sets.int().to(dev)
        req = torch.arange(B, device=dev)
        none = torch.full((B,), -1, dtype=torch.int64, device=dev)
        pool = SparseMemoryPool(1, B, C, P, dev)
        stamps = torch.arange(W, device=dev)  # device scalars: a graph captures no host-to-device copy

        def sequential():
            for w in range(W):
                pool.step(0, req, sets[:, w], none, stamps[w])

        seq = graph_us(sequential, iters, lambda: pool.reset(req))
        one = graph_us(lambda: pool.warm(0, req, sets, stamps[0]), iters, lambda: pool.reset(req))
        rows.append({"batch": B, "windows": W, "topk": K, "buffer_tokens": C, "window_by_window_us": round(seq, 1),
                     "one_compaction_us": round(one, 1), "speedup": round(seq / one, 2), "kernel": pool.kernel})
        log(f"warm-up: {rows[-1]}")
    return rows


def plot(doc: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({(r["rows_per_step"], r["buffer_tokens"]) for r in doc["cases"]})
    for S, C in groups:
        rows = [r for r in doc["cases"] if (r["rows_per_step"], r["buffer_tokens"]) == (S, C)]
        x = [r["batch"] for r in rows]
        ax.plot(x, [r["torch_us"] for r in rows], "o--", label=f"torch, S={S}, C={C}")
        ax.plot(x, [r["fused_us"] for r in rows], "s-", label=f"fused, S={S}, C={C}")
        if "cuda_us" in rows[0]:
            ax.plot(x, [r["cuda_us"] for r in rows], "^-", label=f"cuda, S={S}, C={C}")
    ax.axhline(GOAL_US_AT_160, color="gray", lw=0.8, ls=":", label=f"goal {GOAL_US_AT_160:g} us at batch 160")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("LRU step per layer (us, graph replay)")
    ax.set_title(f"ESS bookkeeping, {doc['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="output folder (default: benchmark/results/gpu/<device>/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU; checks the script, times nothing useful")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--miss-fraction", type=float, default=0.05, help="share of each step's positions that miss")
    p.add_argument("--phases", action="store_true", help="only each kernel's time per phase (GPU), printed")
    p.add_argument("--warmup", action="store_true", help="only LRU-Warmup, window by window against one compaction, printed")
    p.add_argument("--sweep", action="store_true", help="only the fused kernel's launch configurations at batch 160 (GPU), printed")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev.type != "cuda" and not args.smoke:
        raise SystemExit("bookkeeping.py: needs a CUDA device (or --smoke)")
    if args.smoke:
        K, context, host_rows, batches, iters, sizes = 16, 256, 4096, [1, 2], 1, [(1, 17), (1, 40), (3, 51)]
    else:
        K, context, host_rows, batches, iters = 2048, 32768, 1 << 20, [1, 2, 32, 64, 160], args.iters
        sizes = [(1, 2049), (1, 6554), (3, 6147), (3, 6554)]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    host = pinned_zeros((1, host_rows + 1, layout.LATENT_ROW_BYTES), pin=dev.type == "cuda")
    cuda_kernel = "built"
    try:
        lru_step_cuda.library(lru_step_cuda.target_of(dev))
    except RuntimeError as e:  # no nvcc (or g++ for --smoke), or a build error: the other kernels still run
        cuda_kernel = f"not built: {str(e).splitlines()[0]}"
        KERNELS.remove("cuda")
        log(f"CUDA kernel {cuda_kernel}")
    if args.phases:
        print(json.dumps(phases(dev, host, K, context, args.miss_fraction), indent=1))
        return 0
    if args.warmup:
        print(json.dumps(warmup_compare(dev, iters, args.smoke), indent=1))
        return 0
    if args.sweep:
        print(json.dumps(config_sweep(dev, host, K, context, args.miss_fraction, iters), indent=1))
        return 0
    doc = {"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "command": "python benchmark/bookkeeping.py" + (" --smoke" if args.smoke else ""),
           "miss_fraction": args.miss_fraction, "context": context, "timing": "median of CUDA graph replays",
           "kernels": KERNELS, "cuda_kernel": cuda_kernel, "cases": []}
    for S, C in sizes:
        for B in batches:
            c = Case(dev, B, K, S, C, context, args.miss_fraction, host)
            row = time_case(c, iters)
            log(json.dumps(row))
            doc["cases"].append(row)
            del c
    worst = Case(dev, batches[-1], K, 1, sizes[1][1], context, 1.0, host, seed=2)
    doc["all_miss_at_largest_batch"] = time_case(worst, iters)
    log(f"all miss: {doc['all_miss_at_largest_batch']}")
    doc["fused_us_by_warps_all_miss"] = warps_sweep(worst, iters)
    log(f"warps: {doc['fused_us_by_warps_all_miss']}")
    doc["fused_us_by_select_all_miss"] = select_sweep(worst, iters)
    log(f"select: {doc['fused_us_by_select_all_miss']}")
    if "cuda" in KERNELS:
        doc["cuda_us_by_staging_all_miss"] = cuda_staging(worst, iters)
        log(f"cuda staging: {doc['cuda_us_by_staging_all_miss']}")
    del worst
    doc["flashtrans_lists"] = list_bandwidth(dev, batches[-1], K, host, iters)
    log(f"flashtrans lists: {doc['flashtrans_lists']}")
    for kernel in KERNELS[1:]:
        at160 = [r[f"{kernel}_us"] for r in doc["cases"] if r["batch"] == 160]
        doc[f"{kernel}_us_at_160_max"] = max(at160) if at160 else None
    if not args.out and dev.type != "cuda":
        raise SystemExit("bookkeeping.py: --smoke needs an output folder")
    out = pathlib.Path(args.out) if args.out else pathlib.Path("benchmark/results/gpu") / name.split()[1].lower()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bookkeeping.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out / "bookkeeping.png")
    log(f"wrote {out / 'bookkeeping.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
