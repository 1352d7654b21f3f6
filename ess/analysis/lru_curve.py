"""ESS's LRU miss counts at every buffer size from one pass over a trace (docs/profiling.md, "Fitting the
synthetic generator"): LRU under ESS's step semantics is a stack policy.

Why: every position of a step's set U_t (its top-k and own position) takes the step's stamp; the victims are the
resident positions outside U_t with the smallest (stamp, position). By induction the resident set after each step is
the C largest keys (stamp, position) of all positions seen so far (C >= |U_t|): U_t holds the largest keys, and the
victims leave the next largest. So a position of step t is a hit at C slots exactly when fewer than C positions held
a larger key before the step: its rank. One pass computes every access's rank; misses at C = accesses of rank >= C
(a first touch has no rank: a miss at every C). The tests check this against ESS's own pool (ess.analysis.replay).

Ranks come from a Fenwick tree per row over the keys stamp x (K + 1) + index in the step's sorted set.
"""

from __future__ import annotations

import numpy as np
import torch

from ess.analysis.belady import first_of_each, step_uses
from ess.core.settings import WARMUP_WINDOWS
from ess.core.trace import Trace

FIRST_TOUCH = np.iinfo(np.int32).max  # the rank of a position no earlier step used: a miss at every size


def lru_ranks(trace: Trace, warmup: bool = True, windows: int = WARMUP_WINDOWS) -> np.ndarray:
    """int32 [R, steps, layers, K + 1]: per decode access (the own position and duplicates excluded: -1), its rank,
    the number of positions with a larger key before the step; FIRST_TOUCH for a position never used before.
    Misses at C slots = count of ranks >= C (for C >= K + 1), as `replay_counts(trace, C, warmup)` counts them."""
    R, steps, L, K = trace.topk.shape
    N, E = R * L, K + 1
    sets = torch.as_tensor(trace.topk).permute(1, 0, 2, 3).reshape(steps, N, K)
    own = (torch.as_tensor(trace.context_len).repeat_interleave(L)[None, :] + torch.arange(steps)[:, None])
    W = 0
    if warmup and trace.prefill_topk is not None:
        W = min(windows, trace.prefill_topk.shape[1])
        warm = torch.as_tensor(trace.prefill_topk[:, trace.prefill_topk.shape[1] - W:]).permute(1, 0, 2, 3)
        sets = torch.cat([warm.reshape(W, N, K), sets])
        own = torch.cat([torch.full((W, N), -1, dtype=own.dtype), own])
    T = W + steps
    P = int(trace.context_len.max()) + steps + 1
    M = T * E  # keys 1..M
    tree = torch.zeros(N * (M + 1), dtype=torch.int32)
    key_of = torch.zeros(N, P + 1, dtype=torch.int64)  # 0: never used; column P is a sink
    live = torch.zeros(N, 1, dtype=torch.int64)
    base = (torch.arange(N) * (M + 1)).unsqueeze(1)
    rows = torch.arange(N).unsqueeze(1)
    levels = int(M).bit_length() + 1
    out = np.full((R, steps, L, E), -1, dtype=np.int32)

    def prefix(i: torch.Tensor) -> torch.Tensor:  # live keys <= i per entry, i in 0..M
        s = torch.zeros_like(i)
        for _ in range(levels):
            s += torch.where(i > 0, tree[base + i], 0)
            i = i - (i & -i)
        return s

    def add(i: torch.Tensor, delta: int, mask: torch.Tensor) -> None:
        i = torch.where(mask, i, 0)
        for _ in range(levels):
            ok = (i > 0) & (i <= M)
            tree.index_add_(0, (base + torch.where(ok, i, 0)).flatten(), ok.flatten().to(torch.int32) * delta)
            i = torch.where(ok, i + (i & -i), 0)

    for t in range(T):
        u = step_uses(sets[t], own[t])  # [N, E], own last
        valid = first_of_each(u, P)
        srt, order = torch.sort(torch.where(valid, u, P), dim=1)  # ascending positions; invalid last
        key_new = t * E + torch.argsort(order, dim=1) + 1  # an entry's index in the sorted set
        old = key_of[rows, torch.where(valid, u, P)]
        seen = valid & (old > 0)
        rank = live - prefix(torch.where(seen, old, 0))  # keys larger than the old one
        if t >= W:
            r = torch.where(seen, rank, FIRST_TOUCH)
            r = torch.where(valid, r, -1)
            r[:, -1] = -1  # the own position: written on the GPU, never a miss
            out[:, t - W] = r.reshape(R, L, E).numpy()
        add(old, -1, seen)
        add(key_new, 1, valid)
        live += (valid & ~seen).sum(1, keepdim=True)
        key_of[rows, torch.where(valid, u, P)] = torch.where(valid, key_new, key_of[rows, torch.where(valid, u, P)])
        key_of[:, P] = 0
    return out


def misses_at(ranks: np.ndarray, capacity: int) -> np.ndarray:
    """Misses [R, steps, layers] at `capacity` slots from lru_ranks' ranks."""
    return (ranks >= capacity).sum(-1, dtype=np.int64)
