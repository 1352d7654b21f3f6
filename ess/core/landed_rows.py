"""Progressive PD transfer on a decode node: which latent rows of a request have landed (docs/pd.md,
"Progressive PD transfer").

A request may decode before its whole latent cache has arrived. Per tracked request and layer a landed bitmap over its
prompt's pages (the transfer engines move whole pages, all layers of a page at once; page 1 tracks single rows), and
one bit per request: its index-K rows and warm-up state have landed (phase 1). Positions at or past the prompt length
are the decode node's own rows (written by its decode steps), landed by definition. Requests not tracked (their whole
transfer landed, or never progressive) are always ready.

Device tensors and device ops only in `ready` (fixed shapes, no host sync: it can sit inside a captured step); the
host keeps which tracker slot belongs to which request-table row (slots are opened and closed between forwards).
"""

from __future__ import annotations

import torch


class LandingTracker:
    def __init__(self, layers: int, positions: int, requests: int, table_rows: int, device, page: int = 1):
        self.layers, self.page, self.requests = layers, page, requests
        pages = -(-positions // page)
        self.landed = torch.zeros(requests, layers, pages, dtype=torch.bool, device=device)
        self.base = torch.zeros(requests, dtype=torch.bool, device=device)  # phase 1 landed
        self.length = torch.zeros(requests, dtype=torch.int64, device=device)  # prompt positions tracked
        self.slot_of = torch.full((table_rows,), -1, dtype=torch.int64, device=device)  # request row -> tracker slot
        self._free = list(range(requests - 1, -1, -1))
        self._open: dict[int, int] = {}  # request row -> tracker slot (host)

    # -- host side, between forwards ------------------------------------------------------------------------------
    def open(self, row: int, length: int) -> bool:
        """Track request-table row `row` (a prompt of `length` positions) from nothing landed. False when every slot
        is taken: the request then waits for its whole transfer, as without progressive PD."""
        if row in self._open:
            raise ValueError(f"request row {row} is tracked already")
        if not self._free:
            return False
        t = self._free.pop()
        self._open[row] = t
        self.landed[t].zero_()
        self.base[t] = False
        self.length[t] = length
        self.slot_of[row] = t
        return True

    def close(self, row: int) -> None:
        """Stop tracking `row`: its transfer landed whole (it is then always ready), or it finished, failed or was
        aborted. Idempotent."""
        t = self._open.pop(row, None)
        if t is None:
            return
        self.slot_of[row] = -1
        self.landed[t].zero_()
        self.base[t] = False
        self.length[t] = 0
        self._free.append(t)

    def tracked(self, row: int) -> bool:
        return row in self._open

    def open_rows(self) -> list[int]:
        return list(self._open)

    def mark_base(self, row: int) -> None:
        """Phase 1 of `row` landed: its index-K rows and warm-up state."""
        t = self._open.get(row)
        if t is not None:
            self.base[t] = True

    def mark_landed(self, row: int, pages: torch.Tensor, layers: torch.Tensor | None = None) -> None:
        """Pages [n] (page indices of the prompt) of `row` landed, in `layers` [m] (None: every layer)."""
        t = self._open.get(row)
        if t is None:
            return
        pages = pages.to(self.landed.device, torch.long)
        if layers is None:
            self.landed[t][:, pages] = True
        else:
            self.landed[t][layers.to(self.landed.device, torch.long).view(-1, 1), pages.view(1, -1)] = True

    def pages_landed(self, row: int) -> torch.Tensor:
        """[layers, pages] of `row`'s prompt (a copy)."""
        t = self._open[row]
        return self.landed[t, :, : -(-int(self.length[t]) // self.page)].clone()

    def complete_base(self, row: int) -> bool:
        """Phase 1 of `row` landed (host read: between forwards)."""
        t = self._open.get(row)
        return t is None or bool(self.base[t])

    def complete(self, row: int) -> bool:
        """Every page of `row`'s prompt landed in every layer, and phase 1 (host read: between forwards)."""
        t = self._open.get(row)
        return t is None or bool(self.base[t]) and bool(self.pages_landed(row).all())

    def unlanded_pages(self, row: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """The pages of `row`'s prompt among positions [n] (-1 padded) not landed at `layer`, ascending (host side:
        a step waiting on the host asks for them)."""
        t = self._open.get(row)
        if t is None:
            return torch.zeros(0, dtype=torch.long)
        pos = positions.long().to(self.landed.device)
        pos = pos[(pos >= 0) & (pos < self.length[t])]
        pages = torch.unique(pos // self.page)
        return pages[~self.landed[t, layer, pages]].cpu()

    # -- device side, inside a step ---------------------------------------------------------------------------------
    def ready(self, req: torch.Tensor, miss_pos: torch.Tensor, layer: int) -> torch.Tensor:
        """req [B] request-table rows, miss_pos [B, M] positions the step reads from the host pool at `layer` (-1
        padded) -> [B] bool: every such row of the request has landed (an untracked request: True). Device ops only."""
        t = self.slot_of[req.long()]
        tracked = t >= 0
        tc = t.clamp(min=0)
        pos = miss_pos.long()
        local = (pos < 0) | (pos >= self.length[tc].unsqueeze(1))  # padding, or a row this node wrote
        page = (pos.clamp(min=0) // self.page).clamp(max=self.landed.shape[2] - 1)
        got = self.landed[tc.unsqueeze(1), layer, page]
        return ~tracked | (self.base[tc] & (got | local).all(dim=1))
