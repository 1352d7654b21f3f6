"""What arrives for a request without a prefill forward, noted by the scheduler and applied at the start of the next
forward (EssRuntime.apply_admissions): its KV landed in the host pool (a PD transfer's commit, or SGLang restoring a
retracted request's backup), and on a PD decode node the warm-up state the prefill node sent (sglang_ess.pd.warmup's
wire format; docs/pd.md, "Residency first on a PD decode node")."""

from __future__ import annotations

import torch

from ess.core.serving import ServingLatentCache
from sglang_ess.pd import warmup as pd_warmup


class WarmupRefused(ValueError):
    """PD warm-up entries that cannot be loaded for their request; `reason` says why."""

    def __init__(self, req_slot: int, reason: str):
        super().__init__(f"PD warm-up entries of request slot {req_slot}: {reason}")
        self.reason = reason


class KvArrivals:
    def __init__(self, cache: ServingLatentCache, token_table: torch.Tensor, num_layers: int):
        self.cache = cache
        self.token_table = token_table
        self.num_layers = num_layers
        self._landed: dict[int, int] = {}  # request slot -> positions whose KV landed in the host pool (residency)
        self._loads: dict[int, torch.Tensor] = {}  # request slot -> its PD warm-up entries [layers, N]
        self.warm_loaded = self.filled_from_host = 0  # warm-up states loaded, resident regions filled (host counts)

    def kv_landed(self, req_slot: int, length: int) -> None:
        """With residency, a request's KV (its first `length` positions) landed in the host pool. At the next forward,
        whatever happened to the request since its row was given (demoted, promoted, both), the rows it holds become
        true: a resident one's region is filled from the host pool; an offloaded one loads its warm-up entries if they
        came, else the rows its LRU tables hold are fetched (a demotion before the KV landed held rows never
        written)."""
        if self.cache.regions is not None:
            self._landed[req_slot] = length

    def admit_transferred(self, req_slot: int, entries: torch.Tensor, positions: int | None = None) -> None:
        """PD decode: a request whose KV arrived from a prefill node, with the warm-up state that node sent (entries
        [layers, N]): at the next forward its GPU slots start as a co-located warm-up would leave them, the most
        recently used rows first when the union exceeds the slots. The entries are input from another node: ones
        that cannot be loaded for a request of `positions` tokens (default: the request table's width) are refused
        with the reason, before anything reads them."""
        if entries.dim() != 2 or entries.shape[0] != self.num_layers:
            raise WarmupRefused(req_slot, f"shape {tuple(entries.shape)}, expected [{self.num_layers}, N]")
        reason = pd_warmup.check_entries(entries, positions or self.token_table.shape[1])
        if reason is not None:
            raise WarmupRefused(req_slot, reason)
        self._loads[req_slot] = entries

    def forget(self, req_slot: int) -> None:
        """The row went to a new request, or its transfer was refused: nothing noted for it carries over."""
        self._loads.pop(req_slot, None)
        self._landed.pop(req_slot, None)

    def take(self) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        """What arrived so far, taken whole (the scheduler may add more meanwhile): (landed, loads)."""
        taken = self._landed, self._loads
        self._landed, self._loads = {}, {}
        return taken

    def apply(self, landed: dict[int, int], loads: dict[int, torch.Tensor]) -> None:
        """At the start of a forward, after the rows were reset and given regions: the landed KV, then the warm-up
        states."""
        cache = self.cache
        resident = set(cache.resident_requests()) if cache.regions is not None else set()
        for slot, length in landed.items():
            if slot in resident:  # its whole KV, from the host pool where the transfer wrote it
                cache.fill_from_host(slot, length, self.token_table)
                self.filled_from_host += 1
            elif slot in cache.offloaded and slot not in loads:  # the rows its tables hold
                cache.fill_held(slot, self.token_table)
        for slot, entries in loads.items():
            if slot in resident:
                continue  # every row of it is on the GPU already: no warm-up to load
            pos, window = pd_warmup.unpack(entries.to(cache.gpu.device), cache.capacity)
            cache.load_warm(slot, self.token_table, pos, cache.stamp - pd_warmup.WINDOWS + window)
            self.warm_loaded += 1
