"""The disk tier under the reference's host pool: ess.core.disk_tier's PagedHostTier for a fixed batch, request b's
position i being virtual row b x J x 64 + i (J pages per request and layer). The reference cache's token table is
that virtual-row table (`token_table`); ess.core.serving translates it into frame rows through the tier.
"""

from __future__ import annotations

import numpy as np
import torch

from ess.core.disk_tier import FLAGS, PagedHostTier
from ess.core.page_file import DISK_PAGE
from ess.core.settings import PAGE_TOKENS, TIER_PLACEMENTS


def page_file_bytes(num_layers: int, batch: int, max_len: int) -> int:
    """The page file a TieredHostPool of these sizes preallocates: every page of every request and layer."""
    return num_layers * batch * -(-max_len // PAGE_TOKENS) * DISK_PAGE


class TieredHostPool(PagedHostTier):
    """The latent rows of `batch` requests of up to `max_len` positions on `num_layers` layers, in host frames of
    `host_budget_bytes` and a disk file for the rest."""

    def __init__(self, num_layers: int, batch: int, max_len: int, host_budget_bytes: int, disk_dir: str,
                 disk_bytes: int | None = None, device: torch.device | str = "cpu", flags: dict = FLAGS,
                 placement: str = TIER_PLACEMENTS[0]):
        self.B = batch
        self.J = -(-max_len // PAGE_TOKENS)  # pages per request and layer
        super().__init__(num_layers, batch * self.J * PAGE_TOKENS, host_budget_bytes, disk_dir, disk_bytes, device, flags,
                         placement=placement)

    def page(self, layer: int, b, j):
        return (layer * self.B + b) * self.J + j

    def token_table(self) -> torch.Tensor:
        """[B, J x 64] virtual row of each (request, position), the same on every layer."""
        return torch.arange(self.V, device=self.device).reshape(self.B, -1)

    def rows_table(self, layer: int) -> torch.Tensor:
        """[B, J x 64] frame row of each (request, position) on `layer` now (the sink row while on disk)."""
        return self.rows(layer, self.token_table())

    def pages_of(self, layer: int, b: torch.Tensor, pos: torch.Tensor) -> np.ndarray:
        """The pages of positions pos [N, ...] (-1 ignored) of requests b [N] on `layer`."""
        pos = pos.reshape(pos.shape[0], -1).long()
        v = torch.where(pos >= 0, b.reshape(-1, 1).long() * self.J * PAGE_TOKENS + pos, -1)
        return self.pages(layer, v)

    def write(self, layer: int, b: int, pos: torch.Tensor, rows: torch.Tensor) -> None:
        """Bulk write (prefill): rows [N, 656] at positions pos [N] of request b, a page at a time (so a prompt larger
        than the frames passes through them to disk)."""
        for j in range(int(pos.min()) // PAGE_TOKENS, int(pos.max()) // PAGE_TOKENS + 1):
            sel = (pos // PAGE_TOKENS) == j
            self.ensure([self.page(layer, b, j)], dirty=True)
            v = b * self.J * PAGE_TOKENS + pos[sel]
            self.frame_rows[self.rows(layer, v).cpu()] = rows[sel].cpu()
