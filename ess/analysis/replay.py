"""Replay a trace through the real ESS policy code (the LRU step the decode path runs: torch ops or the fused kernel)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ess.analysis import belady
from ess.core.settings import REPLAY_POLICIES, WARMUP_WINDOWS
from ess.core.sparse_pool import SparseMemoryPool
from ess.core.trace import Trace


# Requests x layers of one trace replay together, one table row each (rows are independent in lru_update), in groups
# of layers whose position -> slot tables fit this many bytes.
TABLE_BYTES = 1 << 29


def _belady_group(trace: Trace, ls: slice, buffer_tokens: int, warmup: bool, windows: int, max_pos: int, device) -> np.ndarray:
    """MIN's misses [R, steps, G] for the layers ls: warm-up windows (no own position) then the decode steps, one row
    per (request, layer); only the decode steps' misses are reported, as for LRU."""
    R, steps, _, K = trace.topk.shape
    G = ls.stop - ls.start
    topk = torch.as_tensor(trace.topk[:, :, ls], device=device).permute(1, 0, 2, 3).reshape(steps, R * G, K)
    own = (torch.as_tensor(trace.context_len, device=device).repeat_interleave(G).unsqueeze(0)
           + torch.arange(steps, device=device).unsqueeze(1))
    W = 0
    if warmup:
        sets = torch.as_tensor(trace.prefill_topk[:, :, ls], device=device)  # [R, W, G, K]
        W = min(windows, sets.shape[1])
        warm = sets[:, sets.shape[1] - W :].permute(1, 0, 2, 3).reshape(W, R * G, K)
        topk = torch.cat([warm.to(topk.dtype), topk])
        own = torch.cat([torch.full((W, R * G), -1, dtype=own.dtype, device=device), own])
    misses = belady.min_misses(topk, own, buffer_tokens, max_pos)[W:]  # [steps, R * G]
    return misses.reshape(steps, R, G).permute(1, 0, 2).cpu().numpy()


def replay_misses(
    trace: Trace,
    buffer_tokens: int,
    warmup: bool,
    warmup_windows: int = WARMUP_WINDOWS,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    table_bytes: int = TABLE_BYTES,
    kernel: str = "torch",
    policy: str = "lru",
) -> np.ndarray:
    """Misses [R, steps, layers] int32 of every request, decode step and layer at `buffer_tokens` slots.
    progress(done, total) counts decode steps over all groups of layers. kernel: the LRU step's (ess.core.sparse_pool).
    policy: "lru" (ESS's), or "belady", the offline optimum (ess.analysis.belady), with the same steps."""
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"--policy must be one of {REPLAY_POLICIES}, got {policy!r}")
    R, steps, layers, K = trace.topk.shape
    if buffer_tokens < K + 1:
        raise ValueError(f"--buffer: {buffer_tokens} slots is below top-k + 1 = {K + 1}")
    if warmup and trace.prefill_topk is None:
        raise ValueError("--warmup: this trace has no 'prefill_topk' sets")
    max_pos = int(trace.context_len.max()) + steps
    group = max(1, min(layers, table_bytes // (R * (max_pos + 1) * 4)))
    total = steps * -(-layers // group)
    out = np.zeros((R, steps, layers), dtype=np.int32)
    for first in range(0, layers, group):
        ls = slice(first, min(layers, first + group))
        G = ls.stop - ls.start
        rows = torch.arange(R * G, device=device)  # row r * G + g: request r, layer first + g
        if policy == "belady":
            out[:, :, ls] = _belady_group(trace, ls, buffer_tokens, warmup, warmup_windows, max_pos, device)
            if progress:
                progress(min(total, (first // group + 1) * steps), total)
            continue
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
            out[:, :, ls] = torch.stack(misses, dim=1).reshape(R, G, steps).permute(0, 2, 1).cpu().numpy()
    return out
