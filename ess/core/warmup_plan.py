"""Which query rows of a prefill forward give each request's LRU-Warmup sets (docs/design.md, LRU-Warmup): its last W
query rows, oldest first. Used where prefill runs: the co-located runtime warms its GPU slots from them, a PD prefill
node sends the state they leave (sglang_ess.pd.warmup)."""

from __future__ import annotations

import numpy as np
import torch


class WarmupPlan:
    def __init__(self, req: torch.Tensor, extend_lens: list[int], windows: int):
        """req [R] request slots of a prefill forward that extends them by extend_lens tokens (host ints, in batch
        order: their query rows are consecutive in that order). A chunk shorter than W leaves its oldest windows
        empty (-1)."""
        lens = np.asarray(extend_lens, dtype=np.int64)
        ends = np.cumsum(lens)
        rows = ends[:, None] - windows + np.arange(windows)[None, :]
        self.rows = np.where(rows >= (ends - lens)[:, None], rows, -1)  # [R, W] query rows of the forward
        self.req = req
        self.windows = windows
        self._parts: dict = {}

    def part(self, token_range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(requests [R'], their query rows [R', W] in the calling forward (-1: none), their indices [R'] in the
        plan) for the whole planned forward (token_range None) or a TBO micro-batch holding the planned forward's
        rows [start, end); None if it holds none. Made once per range (one small H2D per forward)."""
        if token_range in self._parts:
            return self._parts[token_range]
        rows, keep = self.rows, np.arange(self.rows.shape[0])
        if token_range is not None:
            start, end = token_range
            inside = (rows >= start) & (rows < end)
            keep = np.flatnonzero(inside.any(axis=1))
            rows = np.where(inside, rows - start, -1)[keep]
        dev = self.req.device
        keep_t = torch.from_numpy(keep).to(dev)
        part = (self.req[keep_t], torch.from_numpy(rows).to(dev), keep_t) if rows.shape[0] else None
        self._parts[token_range] = part
        return part

    def sets(self, top_k: torch.Tensor, token_range=None, to_positions=None):
        """(requests [R'], warm-up sets [R', W, K] as positions (-1: none), plan indices [R']) from the calling
        forward's top-k [rows, K]; to_positions maps SGLang's fused top-k (token locations) to positions (None: top_k
        holds positions). None when the forward holds no planned row."""
        part = self.part(token_range)
        if part is None:
            return None
        req, idx, keep = part
        sets = torch.where(idx.unsqueeze(-1) >= 0, top_k[idx.clamp(min=0)].long(), -1)
        if to_positions is not None:
            sets = to_positions(sets)
        return req, sets, keep
