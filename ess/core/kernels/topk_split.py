"""The indexer's top-k as a radix select split across programs, whose first histogram the indexer kernel can write
as it scores (ess.core.kernels.indexer, select="fused"): select_topk's sets with the whole GPU at work.

    split_topk(scores, pos, k)             int32 [N, k]: equal to ess.core.dsa_math.select_topk(scores, pos, k)
    split_keys(scores, pos, k, work=None)  int64 [N, k]: the chosen positions' keys, PAD_KEY in unfilled slots
    new_work(N, device)                    the zeroed histograms and slot counters the passes share

scores fp32 [N, T] (-inf: no row), pos [N]: positions t <= pos[n] only. Ties go to the lower position, -inf never
chosen, -1 padded, best first (-0.0 ties with +0.0; inputs finite).

Why. ess.core.kernels.topk_select runs one program a request: at 128K context and batch 51, 51 programs on a 132-SM part,
each walking its 128K scores five times, 1024 at a time. Here every pass is a grid of (chunks of CHUNK positions,
requests), and each program adds its counts to its request's histogram with atomics: a pass reads the scores with
every SM.

The key. Each candidate (t <= pos[n], score > -inf) has a unique 64-bit key, read as unsigned: high word the score's
order (its float bits made monotone, -0.0 as +0.0, plus 2^31), low word 2^32 - 1 - t. A larger key is a larger
score, or an equal one at a lower position: select_topk's order with no ties, so the answer is the k largest keys.

Passes. Pass p (0..7) histograms digit p of the keys (8 bits, most significant first) among the candidates whose
digits 0..p-1 equal the threshold's (the k-th largest key's). Each program first finds those digits again from the
histograms of the passes before its own (256 counts a pass, in registers: no program waits on another, no host sync)
and exits at once when its request needs no finer digit: when it has at most k candidates (all are taken), or when
the candidates sharing the threshold's digits so far are exactly those still to take. Distinct scores settle within
the high word; the position passes (4..7) count only ties at the k-th score. The write pass takes every key at or
above the threshold (exactly min(k, candidates) of them) into slots an atomic counter a request hands out, and a sort
of the k keys gives the best-first order (ess.core.kernels.topk_select.positions_from_keys, as the one-program select).
Every pass that runs reads 4 bytes a position; fused with the indexer kernel, pass 0 reads nothing more.

Backends: "triton" (CUDA tensors), "interpret" (Triton's CPU interpreter, from Triton 3.8: how CI checks it),
"torch" (select_topk itself). "auto": "triton" for CUDA tensors, else "torch". Untimed on a GPU so far
(benchmark/indexer_kernels.py).
"""

from __future__ import annotations

import torch

from ess.core import dsa_math
from ess.core.kernels.flashtrans import compiled, kernel_backend, triton
from ess.core.kernels.topk_select import PAD_KEY, check_inputs, positions_from_keys

CHUNK = 4096  # positions a program covers in a pass
BLOCK = 1024  # positions a program reads a loop step
NUM_WARPS = 4
PASSES = 8  # 8-bit digits of the 64-bit key
WORK = PASSES * 256 + 1  # int32 a request: each pass's 256-bin histogram, then the write pass's slot counter

if triton is not None:
    import triton.language as tl

    # Reductions and scans through builtins with the standard library's combine functions (see topk_select).
    _ADD = tl.standard._sum_combine
    _MAX = tl.standard._elementwise_max

    def _pass_kernel(scores, pos_ptr, work, out, T, K, PASS: tl.constexpr, WRITE: tl.constexpr,
                     WORK: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(1).to(tl.int64)
        c0 = tl.program_id(0).to(tl.int64) * CHUNK
        last = tl.minimum(tl.load(pos_ptr + n).to(tl.int64), T - 1)
        hist = work + n * WORK
        bins = tl.arange(0, 256)
        lanes = tl.arange(0, BLOCK)
        # The threshold's digits from passes 0..PASS-1: high and low words, and how many keys equal to them to take
        high = tl.full([], 0, tl.int64)
        low = tl.full([], 0, tl.int64)
        remaining = tl.full([], 0, tl.int64) + K
        done = tl.full([], 0, tl.int32)  # 1: no finer digit needed
        for q in tl.static_range(PASS):
            h = tl.load(hist + q * 256 + bins).to(tl.int64)
            if q == 0:  # at most k candidates: all are taken, the threshold stays 0
                done = (tl.reduce(h, 0, _ADD) <= K).to(tl.int32)
            above = tl.associative_scan(h, 0, _ADD, reverse=True)  # above[b]: keys with digit >= b
            b = tl.reduce(tl.where(above >= remaining, bins, 0), 0, _MAX).to(tl.int64)  # the threshold's digit
            at_b = tl.reduce(tl.where(bins == b, h, 0), 0, _ADD)
            left = remaining - (tl.reduce(tl.where(bins == b, above, 0), 0, _ADD) - at_b)
            if q < 4:
                high = tl.where(done == 0, high | (b << (24 - 8 * q)), high)
            else:
                low = tl.where(done == 0, low | (b << (56 - 8 * q)), low)
            remaining = tl.where(done == 0, left, remaining)
            done = done | (at_b == remaining).to(tl.int32)
        if WRITE:
            run = c0 <= last
        else:
            run = (c0 <= last) & (done == 0)
        if run:
            acc = tl.full([256], 0, tl.int32)
            for t0 in range(0, CHUNK, BLOCK):
                t = c0 + t0 + lanes
                s = tl.load(scores + n * T + t, mask=t <= last, other=float("-inf"))
                bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0
                mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order = float order
                uh = mono.to(tl.int64) + 2147483648  # the key's high word, unsigned
                lw = tl.full([BLOCK], 4294967295, tl.int64) - t  # its low word (a bare 2^32 - 1 is uint32)
                cand = (t <= last) & (s > float("-inf"))
                if WRITE:
                    take = cand & ((uh > high) | ((uh == high) & (lw >= low)))
                    taken = tl.reduce(take.to(tl.int32), 0, _ADD)
                    first = tl.atomic_add(hist + WORK - 1, taken).to(tl.int64)
                    slot = first + tl.associative_scan(take.to(tl.int64), 0, _ADD) - take.to(tl.int64)
                    tl.store(out + n * K + slot, (mono.to(tl.int64) << 32) | lw, mask=take & (slot < K))
                else:
                    if PASS < 4:
                        if PASS > 0:
                            cand = cand & ((uh >> (32 - 8 * PASS)) == (high >> (32 - 8 * PASS)))
                        digit = (uh >> (24 - 8 * PASS)) & 255
                    else:
                        cand = cand & (uh == high)
                        if PASS > 4:
                            cand = cand & ((lw >> (64 - 8 * PASS)) == (low >> (64 - 8 * PASS)))
                        digit = (lw >> (56 - 8 * PASS)) & 255
                    digit = tl.where(cand, digit, 0).to(tl.int32)
                    # the lanes that are not candidates were counted in bin 0: take them out again
                    outside = BLOCK - tl.reduce(cand.to(tl.int32), 0, _ADD)
                    acc += tl.histogram(digit, 256) - tl.where(bins == 0, outside, 0)
            if not WRITE:
                tl.atomic_add(hist + PASS * 256 + bins, acc, mask=acc > 0)
else:  # compiled() refuses these without triton, naming the caller
    _pass_kernel = None


def new_work(N: int, device) -> torch.Tensor:
    """The passes' shared state for N requests, zeroed: int32 [N, WORK] (histograms, then the slot counter)."""
    return torch.zeros(N, WORK, dtype=torch.int32, device=device)


def split_keys(scores: torch.Tensor, pos: torch.Tensor, k: int, interpret: bool = False,
               work: torch.Tensor | None = None, pass0_counted: bool = False, chunk: int = CHUNK, block: int = BLOCK,
               num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The kernels alone: int64 [N, k], the chosen positions' keys in no set order, PAD_KEY in unfilled slots. work:
    new_work's zeroed state (None: a fresh one), left holding the passes' histograms; pass0_counted: its pass-0
    histograms are already counted (by the indexer kernel, select="fused")."""
    N, T = scores.shape
    out = torch.full((N, k), PAD_KEY, dtype=torch.int64, device=scores.device)
    if N * T == 0:
        return out
    first = 1 if pass0_counted else 0
    work = new_work(N, scores.device) if work is None else work
    kernel = compiled(_pass_kernel, interpret, "split_topk")
    launch = {} if interpret else {"num_warps": num_warps}
    grid = (triton.cdiv(T, chunk), N)
    scores, pos = scores.contiguous(), pos.contiguous()
    for p in range(first, PASSES + 1):  # the passes, then the write (PASS = PASSES)
        kernel[grid](scores, pos, work, out, T, k, PASS=p, WRITE=p == PASSES, WORK=WORK, CHUNK=chunk, BLOCK=block,
                     **launch)
    return out


def split_topk(scores: torch.Tensor, pos: torch.Tensor, k: int, backend: str = "auto") -> torch.Tensor:
    """select_topk(scores, pos, k) by the split radix select: int32 [N, k] positions, best first, ties to the lower
    position, -1 padded. scores fp32 [N, T], pos integer [N]."""
    check_inputs(scores, pos, k, "split_topk")
    backend = kernel_backend(backend, scores.device, "split_topk")
    if backend == "torch":
        return dsa_math.select_topk(scores, pos, k)
    return positions_from_keys(split_keys(scores, pos, k, interpret=backend == "interpret"))
