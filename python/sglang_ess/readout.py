"""What the runtime reports to the scheduler's state readout (/get_server_info): the step counters of the decode and
verify steps, kept on the device (no sync in a step), and the runtime's state (bytes, overlap modes, residency, PD
loads, the disk tier), read on the host."""

from __future__ import annotations

import torch

from ess.core.disk_tier import DISK_PAGE
from ess.core.policy import PolicyResult

# LRU steps (a layer of a batch), rows selected and rows missed in them, forwards with such steps, and those of them
# without a single miss.
COUNTERS = ("layer_steps", "selected_rows", "missed_rows", "forwards", "forwards_without_misses")


class StepCounters:
    """COUNTERS on the device. A step adds to this forward's tally (two device ops: a CUDA graph captures them); the
    forward's end sums the tally into the counters, outside any graph."""

    def __init__(self, rows: int, device):
        """rows: request-table rows, the most step rows a batch holds."""
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        # per step row: [0, 0] += 1 a step, [1] += its sets, [2] += its misses
        self._tally = torch.zeros(3, max(1, rows), dtype=torch.int32, device=device)
        self._first = {}  # B -> [B] int32 (1, 0, 0, ...): a step's count in the tally

    def count(self, r: PolicyResult) -> None:
        """One LRU step into this forward's tally."""
        B = r.n_set.shape[0]
        if B > self._tally.shape[1]:  # more rows than request slots (never in SGLang): summed first
            self._tally[:, 0] += torch.stack([torch.ones_like(r.n_set[0]), r.n_set.sum(), r.n_miss.sum()]).int()
            return
        if B not in self._first:
            self._first[B] = (torch.arange(B, device=r.n_set.device) == 0).to(torch.int32)
        self._tally[:, :B] += torch.stack([self._first[B], r.n_set, r.n_miss])

    def start_forward(self) -> None:
        """A forward begins with an empty tally (a CUDA graph's capture runs count nothing)."""
        self._tally.zero_()

    def end_forward(self) -> None:
        """After a forward, outside any graph: its tally into the counters (device ops)."""
        steps, sets, misses = self._tally.sum(dim=1, dtype=torch.int64)
        stepped = steps > 0
        self.counters += torch.stack([steps, sets, misses, stepped, stepped & (misses == 0)]).long()
        self._tally.zero_()

    def read(self) -> dict[str, int]:
        """The counters of the forwards that ended, as host ints: a device sync, for readouts only."""
        return dict(zip(COUNTERS, self.counters.tolist()))


def state(rt) -> dict:
    """The runtime's state (an EssRuntime): device, host and disk bytes, layer modes, PD loads, residency, the tier."""
    cache, tier = rt.cache, rt.cache.tier
    out = {"device_bytes": cache.device_bytes(), "modes": rt.modes,
           "pd": {"warm_states_loaded": rt.arrivals.warm_loaded,
                  "resident_regions_filled": rt.arrivals.filled_from_host}}
    if cache.regions is not None:
        out |= {"residency": {"device_rows": cache.regions.rows, "resident_requests": len(cache.resident_requests()),
                              "offloaded_requests": len(cache.offloaded), "demoted": rt.residency.demoted,
                              "promoted": rt.residency.promoted, "fixed_path": cache.fixed_path,
                              "graphs_captured": dict(rt.graphs_captured)}}
    if tier is None:
        return out | {"host_bytes": cache.host.numel()}
    return out | {"host_bytes": tier.frame_rows.numel(), "disk_bytes": tier.L * tier.P * DISK_PAGE,
                  "tier": tier.report()}
