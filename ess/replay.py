"""Replay a trace through the real ESS policy code (the same lru_update the decode path runs)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ess.policy import lru_update
from ess.sparse_pool import SparseMemoryPool
from ess.trace import Trace


def replay_misses(
    trace: Trace,
    buffer_tokens: int,
    warmup: bool,
    warmup_windows: int = 32,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Misses [R, steps, layers] int32 of every request, decode step and layer at `buffer_tokens` slots."""
    R, steps, layers, K = trace.topk.shape
    if buffer_tokens < K + 1:
        raise ValueError(f"--buffer: {buffer_tokens} slots is below top-k + 1 = {K + 1}")
    if warmup and trace.prefill_topk is None:
        raise ValueError("--warmup: this trace has no 'prefill_topk' sets")
    ctx = torch.as_tensor(trace.context_len, device=device)
    max_pos = int(trace.context_len.max()) + steps
    req = torch.arange(R, device=device)
    out = np.zeros((R, steps, layers), dtype=np.int32)
    for layer in range(layers):
        pool = SparseMemoryPool(1, R, buffer_tokens, max_pos, device)
        sp, st, ps = pool.layer_state(0)
        if warmup:
            sets = torch.as_tensor(trace.prefill_topk[:, :, layer], device=device)
            W = min(warmup_windows, sets.shape[1])
            pool.warm(0, req, sets[:, sets.shape[1] - W :], -W)
        topk = torch.as_tensor(trace.topk[:, :, layer], device=device)
        misses = [lru_update(sp, st, ps, req, topk[:, t], ctx + t, t).n_miss for t in range(steps)]
        if steps:
            out[:, :, layer] = torch.stack(misses, dim=1).cpu().numpy()
        if progress:
            progress(layer + 1, layers)
    return out
