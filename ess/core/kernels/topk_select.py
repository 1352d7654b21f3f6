"""The indexer's top-k as a radix select over 32-bit score keys, in one Triton kernel: select_topk's sets without
torch.topk over int64 keys.

    radix_topk(scores, pos, k)      int32 [N, k]: equal to ess.core.dsa_math.select_topk(scores, pos, k)

scores fp32 [N, T] (the indexer's, ess.core.kernels.indexer; -inf: no row), pos [N]: positions t <= pos[n] only.
Ties go to the lower position, -inf never chosen, -1 padded, best first (-0.0 ties with +0.0; inputs finite).

How. One program per request. Each score becomes a 32-bit unsigned key whose order is the float's. Four passes of
an 8-bit digit, most significant first, each a 256-bin histogram of the candidates that still match the digits
found so far, find the k-th largest key exactly (the threshold) and how many keys equal to it are taken (the lowest
positions among them: the tie rule). A fifth pass writes the chosen positions as select_topk's int64 keys
(ess.core.kernels.indexer.score_keys: high word the score's order, low word 2^32 - 1 - t); a sort of those k keys
(torch.sort over [N, k], not [N, T]) gives the best-first order. Each pass reads the request's scores once (4 bytes a
position), so the select reads 20 bytes a position, against the 132 of its index-K row, where torch.topk over int64
keys [N, T] wrote and read 8 bytes a position and ran a radix select over 64 bits.

Backends: "triton" (CUDA tensors), "interpret" (Triton's CPU interpreter, from Triton 3.8: how CI checks it),
"torch" (select_topk itself). "auto": "triton" for CUDA tensors, else "torch". Untimed on a GPU so far
(benchmark/indexer_kernels.py, `--select`).
"""

from __future__ import annotations

import torch

from ess.core import dsa_math
from ess.core.kernels.flashtrans import compiled, kernel_backend, triton

BLOCK = 1024  # positions per loop step of a program
NUM_WARPS = 4
PAD_KEY = -(2**63)  # an unfilled slot: below every score's key, read back as -1
LOW_WORD = 0xFFFFFFFF
NEG_INF_KEY = -2139095041  # the high word of -inf's key (ess.core.kernels.indexer)

if triton is not None:
    import triton.language as tl

    # Reductions and scans through builtins with the standard library's combine functions: tl.sum and tl.cumsum are
    # jit functions, which Triton's interpreter cannot call unless TRITON_INTERPRET was set at import.
    _ADD = tl.standard._sum_combine
    _MAX = tl.standard._elementwise_max

    def _select_kernel(scores, pos_ptr, out, T, K, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        last = tl.minimum(tl.load(pos_ptr + n).to(tl.int64), T - 1)
        bins = tl.arange(0, 256)
        lanes = tl.arange(0, BLOCK)
        prefix = tl.full([], 0, tl.int64)  # the threshold's digits found so far
        remaining = tl.full([], 0, tl.int64) + K  # how many keys at or below the prefix are still to take
        total = tl.full([], 0, tl.int64)  # candidates: finite scores at positions <= last
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.full([256], 0, tl.int32)
            for t0 in range(0, T, BLOCK):
                t = t0 + lanes
                s = tl.load(scores + n * T + t, mask=t <= last, other=float("-inf"))
                bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0
                u = (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648)  # order-keeping, >= 0
                cand = (t <= last) & (s > float("-inf")) & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
                digit = tl.where(cand, (u >> shift) & 255, 0).to(tl.int32)
                # the lanes that are not candidates were counted in bin 0: take them out again
                hist += tl.histogram(digit, 256) - tl.where(bins == 0, BLOCK - tl.reduce(cand.to(tl.int32), 0, _ADD), 0)
            if p == 0:
                total = tl.reduce(hist, 0, _ADD).to(tl.int64)
            above = tl.associative_scan(hist, 0, _ADD, reverse=True).to(tl.int64)  # above[b]: keys with digit >= b
            b = tl.reduce(tl.where(above >= remaining, bins, 0), 0, _MAX)  # the k-th largest key's digit
            remaining -= tl.reduce(tl.where(bins == b, above - hist, 0), 0, _ADD)  # less those with a larger digit
            prefix |= b.to(tl.int64) << shift
        take_all = total <= K  # fewer candidates than k: every one is taken
        taken = tl.full([], 0, tl.int64)
        equal_seen = tl.full([], 0, tl.int64)
        for t0 in range(0, T, BLOCK):
            t = t0 + lanes
            s = tl.load(scores + n * T + t, mask=t <= last, other=float("-inf"))
            bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
            mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            u = mono.to(tl.int64) + 2147483648
            cand = (t <= last) & (s > float("-inf"))
            equal = cand & (u == prefix)
            equal_rank = equal_seen + tl.associative_scan(equal.to(tl.int64), 0, _ADD) - equal.to(tl.int64)
            take = cand & (take_all | (u > prefix) | (equal & (equal_rank < remaining)))
            slot = taken + tl.associative_scan(take.to(tl.int64), 0, _ADD) - take.to(tl.int64)
            low = tl.full([BLOCK], 4294967295, tl.int64) - t
            tl.store(out + n * K + slot, (mono.to(tl.int64) << 32) | low, mask=take)
            taken += tl.reduce(take.to(tl.int64), 0, _ADD)
            equal_seen += tl.reduce(equal.to(tl.int64), 0, _ADD)
else:  # compiled() refuses these without triton, naming the caller
    _select_kernel = None


def radix_keys(scores: torch.Tensor, pos: torch.Tensor, k: int, interpret: bool = False,
               block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The kernel alone: int64 [N, k], the chosen positions' keys in position order, PAD_KEY in unfilled slots."""
    N, T = scores.shape
    out = torch.full((N, k), PAD_KEY, dtype=torch.int64, device=scores.device)
    if N * T == 0:
        return out
    launch = {} if interpret else {"num_warps": num_warps}
    compiled(_select_kernel, interpret, "radix_topk")[(N,)](scores.contiguous(), pos.contiguous(), out, T, k,
                                                            BLOCK=block, **launch)
    return out


def positions_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """int32 positions [N, k] of chosen keys, best first; PAD_KEY and -inf give -1."""
    top = torch.sort(keys, dim=1, descending=True).values  # the keys are unique: no ties to break
    return torch.where((top >> 32) > NEG_INF_KEY, LOW_WORD - (top & LOW_WORD), -1).to(torch.int32)


def check_inputs(scores, pos, k, what: str) -> None:
    """A select's inputs (scores fp32 [N, T], pos integer [N] on the same device, k a positive int), refused naming
    the argument and the caller `what`."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"{what}: scores must be float32 [N, T], got {getattr(scores, 'dtype', type(scores))} "
                         f"{tuple(getattr(scores, 'shape', ()))}")
    if (not isinstance(pos, torch.Tensor) or pos.is_floating_point() or tuple(pos.shape) != (scores.shape[0],)
            or pos.device != scores.device):
        raise ValueError(f"{what}: pos must be an integer [N] = [{scores.shape[0]}] tensor on {scores.device}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{what}: k must be a positive int, got {k!r}")


def radix_topk(scores: torch.Tensor, pos: torch.Tensor, k: int, backend: str = "auto") -> torch.Tensor:
    """select_topk(scores, pos, k) by a radix select: int32 [N, k] positions, best first, ties to the lower position,
    -1 padded. scores fp32 [N, T], pos integer [N]."""
    check_inputs(scores, pos, k, "radix_topk")
    backend = kernel_backend(backend, scores.device, "radix_topk")
    if backend == "torch":
        return dsa_math.select_topk(scores, pos, k)
    return positions_from_keys(radix_keys(scores, pos, k, interpret=backend == "interpret"))
