"""Replay a trace through the real ESS policy code (the LRU step the decode path runs: torch ops or the fused kernel),
or through the offline optimum and the candidate policies (docs/policies.md)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from ess.analysis import belady, candidate_policies
from ess.core.settings import DEFAULT_DECAY_SHIFT, REPLAY_POLICIES, WARMUP_WINDOWS
from ess.core.sparse_pool import SparseMemoryPool
from ess.core.trace import Trace


# Requests x layers of one trace replay together, one table row each (rows are independent in lru_update), in groups
# of layers whose position -> slot tables fit this many bytes.
TABLE_BYTES = 1 << 29


@dataclasses.dataclass
class ReplayCounts:
    """misses, prefetched, prefetch_hits [R, steps, layers] int32 (decode steps only); wasted [R, layers]: prefetched
    rows never used (ess.analysis.candidate_policies.PolicyCounts)."""

    misses: np.ndarray
    prefetched: np.ndarray
    prefetch_hits: np.ndarray
    wasted: np.ndarray


def table_row_bytes(max_pos: int, policy: str) -> int:
    """Bytes of one row's position -> slot table: a column per position up to max_pos, and a sink."""
    return (max_pos + 1) * (4 if policy == "lru" else 8)


def position_table_bytes(trace: Trace, policy: str) -> int:
    """The position -> slot tables of one layer (a row per request): the least a replay allocates at once."""
    R, steps = trace.topk.shape[:2]
    return R * table_row_bytes(int(trace.context_len.max()) + steps, policy)


def _offline_group(trace: Trace, ls: slice, buffer_tokens: int, warmup: bool, windows: int, max_pos: int, device,
                   policy: str, lookahead: int, decay_shift: int) -> tuple[np.ndarray, ...]:
    """The layers ls through MIN or an ess.analysis.candidate_policies policy: warm-up windows (no own position, no
    prefetch) then the decode steps, one row per (request, layer); counts of the decode steps only, as for LRU."""
    R, steps, _, K = trace.topk.shape
    G = ls.stop - ls.start
    topk = torch.as_tensor(trace.topk[:, :, ls], device=device).permute(1, 0, 2, 3).reshape(steps, R * G, K)
    own = (torch.as_tensor(trace.context_len, device=device).repeat_interleave(G).unsqueeze(0)
           + torch.arange(steps, device=device).unsqueeze(1))
    ext = None
    if policy == "prefetch":  # replay_counts checked that the trace holds `lookahead` ranks past the top-k
        ext = torch.as_tensor(trace.topk_ext[:, :, ls, K : K + lookahead], device=device).permute(1, 0, 2, 3)
        ext = ext.reshape(steps, R * G, -1)
    W = 0
    if warmup:
        sets = torch.as_tensor(trace.prefill_topk[:, :, ls], device=device)  # [R, W, G, K]
        W = min(windows, sets.shape[1])
        warm = sets[:, sets.shape[1] - W :].permute(1, 0, 2, 3).reshape(W, R * G, K)
        topk = torch.cat([warm.to(topk.dtype), topk])
        own = torch.cat([torch.full((W, R * G), -1, dtype=own.dtype, device=device), own])
        if ext is not None:
            ext = torch.cat([torch.full((W, R * G, ext.shape[2]), -1, dtype=ext.dtype, device=device), ext])

    def per_request(x: torch.Tensor) -> np.ndarray:  # [steps, R * G] -> [R, steps, G]
        return x[W:].reshape(steps, R, G).permute(1, 0, 2).cpu().numpy()

    if policy == "belady":
        zero = np.zeros((R, steps, G), dtype=np.int32)
        return per_request(belady.min_misses(topk, own, buffer_tokens, max_pos)), zero, zero, np.zeros((R, G), np.int32)
    c = candidate_policies.replay_policy(topk, own, buffer_tokens, max_pos, policy, ext, decay_shift)
    # prefetches of the warm-up windows: none (no ranks there); so every count below is the decode steps'
    return (per_request(c.misses), per_request(c.prefetched), per_request(c.prefetch_hits),
            c.wasted.reshape(R, G).cpu().numpy())


def replay_counts(
    trace: Trace,
    buffer_tokens: int,
    warmup: bool,
    warmup_windows: int = WARMUP_WINDOWS,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    table_bytes: int = TABLE_BYTES,
    kernel: str = "torch",
    policy: str = "lru",
    lookahead: int | None = None,
    decay_shift: int = DEFAULT_DECAY_SHIFT,
) -> ReplayCounts:
    """Counts of every request, decode step and layer at `buffer_tokens` slots. progress(done, total) counts decode
    steps over all groups of layers. policy: "lru" (ESS's, through ess.core's pool and the LRU step `kernel`),
    "belady" (the offline optimum, ess.analysis.belady), or "prefetch" / "score" (ess.analysis.candidate_policies;
    lookahead: ranks past the top-k that prefetch fetches, default all the trace holds)."""
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"--policy must be one of {REPLAY_POLICIES}, got {policy!r}")
    R, steps, layers, K = trace.topk.shape
    if buffer_tokens < K + 1:
        raise ValueError(f"--buffer: {buffer_tokens} slots is below top-k + 1 = {K + 1}")
    if warmup and trace.prefill_topk is None:
        raise ValueError("--warmup: this trace has no 'prefill_topk' sets")
    if lookahead is None:
        lookahead = trace.lookahead
    if policy == "prefetch" and trace.topk_ext is None:
        raise ValueError("--policy prefetch needs a trace with 'topk_ext' (ranks past the top-k: ess trace record --lookahead)")
    if policy == "prefetch" and not 1 <= lookahead <= trace.lookahead:
        raise ValueError(f"--lookahead: {lookahead} ranks past the top-k; the trace holds {trace.lookahead} (topk_ext)")
    max_pos = int(trace.context_len.max()) + steps
    if buffer_tokens > max_pos + 1:  # more slots than positions: the rest stay empty, and cost memory
        raise ValueError(f"--buffer-tokens {buffer_tokens}: more slots than the trace's {max_pos + 1} positions")
    offline = policy != "lru"
    row_bytes = table_row_bytes(max_pos, policy)
    group = max(1, min(layers, table_bytes // (R * row_bytes)))
    total = steps * -(-layers // group)
    out = ReplayCounts(*(np.zeros((R, steps, layers), dtype=np.int32) for _ in range(3)),
                       wasted=np.zeros((R, layers), dtype=np.int32))
    for first in range(0, layers, group):
        ls = slice(first, min(layers, first + group))
        G = ls.stop - ls.start
        if offline:
            m, p, h, w = _offline_group(trace, ls, buffer_tokens, warmup, warmup_windows, max_pos, device, policy,
                                        lookahead, decay_shift)
            out.misses[:, :, ls], out.prefetched[:, :, ls], out.prefetch_hits[:, :, ls], out.wasted[:, ls] = m, p, h, w
            if progress:
                progress(min(total, (first // group + 1) * steps), total)
            continue
        rows = torch.arange(R * G, device=device)  # row r * G + g: request r, layer first + g
        pool = SparseMemoryPool(1, R * G, buffer_tokens, max_pos, device, kernel)
        if warmup:
            sets = torch.as_tensor(trace.prefill_topk[:, :, ls], device=device).permute(0, 2, 1, 3)  # [R, G, W, K]
            W = min(warmup_windows, sets.shape[2])
            pool.warm(0, rows, sets[:, :, sets.shape[2] - W :].reshape(R * G, W, K), -W)
        topk = torch.as_tensor(trace.topk[:, :, ls], device=device)  # [R, steps, G, K]
        own = torch.as_tensor(trace.context_len, device=device).repeat_interleave(G)
        misses = []
        for t in range(steps):
            misses.append(pool.step(0, rows, topk[:, t].reshape(R * G, K), own + t, t).n_miss)
            if progress:
                progress(first // group * steps + t + 1, total)
        if steps:  # one copy to the host per group
            out.misses[:, :, ls] = torch.stack(misses, dim=1).reshape(R, G, steps).permute(0, 2, 1).cpu().numpy()
    return out


def replay_misses(trace: Trace, buffer_tokens: int, warmup: bool, warmup_windows: int = WARMUP_WINDOWS, **kw) -> np.ndarray:
    """Misses [R, steps, layers] int32 (replay_counts' misses; same keywords)."""
    return replay_counts(trace, buffer_tokens, warmup, warmup_windows, **kw).misses
