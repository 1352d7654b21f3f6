"""Progressive PD transfer on a prefill node: the order a request's latent pages are sent in (docs/pd.md,
"Progressive PD transfer"). Phase 1 (index-K of every token and the warm-up state) goes first and is not ordered here.

Phase 2: the pages holding a row of the warm-up set in any layer, hottest first. SGLang's transfer engines move whole
pages with all their layers, so a page is sent once for every layer. A page's heat is the newest warm-up window that
names one of its rows (the LRU's own order: the rows the first decode steps keep are the newest), then how many
(layer, row) entries name it, then the page index (ties, so the order is a function of the state alone).
Phase 3: every other page of the prompt, in ascending order.
"""

from __future__ import annotations

import torch


def send_order(positions: torch.Tensor, windows: torch.Tensor, prompt_len: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [layers, N] of the warm-up state (-1 padded), windows [layers, N] (larger: newer) -> (phase 2 pages,
    phase 3 pages), int64, together each page of the prompt once. Positions at or past prompt_len are ignored."""
    pages = -(-prompt_len // page)
    pos = positions.long().flatten()
    keep = (pos >= 0) & (pos < prompt_len)
    pg = pos[keep] // page
    win = windows.long().flatten()[keep]
    newest = torch.full((pages,), -1, dtype=torch.long).scatter_reduce(0, pg, win, reduce="amax", include_self=True)
    count = torch.zeros(pages, dtype=torch.long).scatter_add(0, pg, torch.ones_like(pg))
    warm = count > 0
    idx = torch.arange(pages)
    # one key per page: newest window, then entries, both descending, then the page ascending
    key = (newest + 1) * (count.max() + 1 if pages else 1) + count
    hot = idx[warm]
    _, by_heat = torch.sort(key[hot], descending=True, stable=True)  # stable: ties keep the ascending page order
    return hot[by_heat], idx[~warm]
