"""LRU-Warmup from prefill (docs/design.md, "LRU-Warmup"): a prefill forward's last W query rows per request give its
warm-up sets, so decode starts with the rows prefill attended to last. On a PD decode node the prefill node sends the
state those sets leave instead (sglang_ess.kv_arrivals, sglang_ess.pd.warmup)."""

from __future__ import annotations

import torch

from ess.core.serving import ServingLatentCache
from ess.core.warmup_plan import WarmupPlan


class PrefillWarmup:
    def __init__(self, cache: ServingLatentCache, token_table: torch.Tensor, windows: int):
        """windows: --ess-warmup-windows (W; 0: no warm-up)."""
        self.cache = cache
        self.token_table = token_table
        self.windows = windows
        self._warm: WarmupPlan | None = None  # the prefill forward's warm-up windows

    def plan(self, req: torch.Tensor, extend_lens: list[int]) -> None:
        """Before layer 0 of a prefill forward whose requests req [R] extend by extend_lens tokens (host ints, in
        batch order). Their LRU rows are forgotten: a new request has none, and a chunked one warms up again from its
        newest chunk (see WarmupPlan for the windows); with residency their regions stay (a resident one is filled
        as the prefill writes its rows, EssRuntime.fill_resident)."""
        self.cache.forget(req)
        W = self.windows
        self._warm = WarmupPlan(req, extend_lens, W) if W and req.shape[0] else None

    def warm(self, layer: int, top_k: torch.Tensor, to_positions=None, token_range=None) -> None:
        """After layer `layer`'s prefill attention (the runtime's layer index): LRU-Warmup of the planned requests
        from top_k [rows, K] (the forward's query rows). to_positions maps SGLang's fused top-k (token locations) to
        positions; None when top_k holds positions. token_range (start, end): this forward is a TBO micro-batch
        holding those query rows of the planned forward; windows outside it are left to the other micro-batch (an
        empty window changes nothing, and the earlier micro-batch holds the older windows, so the order of insertion
        is kept)."""
        got = None if self._warm is None else self._warm.sets(top_k, token_range, to_positions)
        if got is not None:
            self.cache.warmup(layer, got[0], self.token_table, got[1])
