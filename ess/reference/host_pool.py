"""Total Memory Pool: the complete latent cache of every live token, in (pinned) host memory.

Rows live in 64-token pages, as SGLang pages its KV cache; a per-request page table on the device turns
(request, position) into a host row without a host round trip. Allocation and release happen between steps (the
scheduler's side); the decode step only reads the page table.
"""

from __future__ import annotations

import math

import torch

from ess.core import layout
from ess.core.pinned import pinned_zeros
from ess.core.settings import PAGE_TOKENS


class HostPoolExhausted(RuntimeError):
    """The Total Memory Pool has no room; nothing was allocated or overwritten."""


class TotalMemoryPool:
    def __init__(
        self,
        num_layers: int,
        capacity_tokens: int,
        max_requests: int,
        max_tokens_per_request: int,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ):
        if capacity_tokens < 1 or max_requests < 1 or max_tokens_per_request < 1:
            raise ValueError("host pool: capacity_tokens, max_requests and max_tokens_per_request must be positive")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.num_pages = math.ceil(capacity_tokens / PAGE_TOKENS)
        self.sink_row = self.num_pages * PAGE_TOKENS  # receives padded (-1) entries of fixed-shape copies
        # [layers, rows + 1 sink, 656]; pinned (at exactly its size) so that FlashTrans reads and writes it over UVA.
        self.data = pinned_zeros((num_layers, self.sink_row + 1, layout.LATENT_ROW_BYTES), pin=pin_memory)
        self.max_pages_per_request = math.ceil(max_tokens_per_request / PAGE_TOKENS)
        self.page_table = torch.full((max_requests, self.max_pages_per_request), -1, dtype=torch.int64, device=device)
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._free_requests = list(range(max_requests - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def alloc_request(self) -> int:
        if not self._free_requests:
            raise HostPoolExhausted(f"host pool: all {self.page_table.shape[0]} request slots are in use")
        req = self._free_requests.pop()
        self._pages[req] = []
        return req

    def reserve(self, req: int, num_tokens: int) -> None:
        """Make positions [0, num_tokens) of request `req` addressable. All or nothing."""
        pages = self._pages.get(req)
        if pages is None:
            raise KeyError(f"host pool: request {req} is not allocated")
        need = math.ceil(num_tokens / PAGE_TOKENS) - len(pages)
        if need <= 0:
            return
        if len(pages) + need > self.max_pages_per_request:
            raise HostPoolExhausted(
                f"host pool: request {req} needs {num_tokens} tokens, above max_tokens_per_request "
                f"{self.max_pages_per_request * PAGE_TOKENS}"
            )
        if need > len(self._free_pages):
            raise HostPoolExhausted(
                f"host pool exhausted: request {req} needs {need} more pages of {PAGE_TOKENS} tokens, "
                f"{len(self._free_pages)} of {self.num_pages} free (raise --ess-host-pool-gib)"
            )
        new = [self._free_pages.pop() for _ in range(need)]
        self.page_table[req, len(pages) : len(pages) + need] = torch.tensor(new, dtype=torch.int64)
        pages.extend(new)

    def release(self, req: int) -> None:
        pages = self._pages.pop(req, None)
        if pages is None:  # released twice, or never allocated: nothing of another request may be freed
            raise ValueError(f"host pool: request {req} is not allocated (released twice?)")
        self._free_pages.extend(reversed(pages))
        self.page_table[req] = -1
        self._free_requests.append(req)

    def rows(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Host row index of each (request, position): req [B], pos [B, ...] -> int64 [B, ...], -1 where pos < 0."""
        pos = pos.long()
        shape = pos.shape
        flat = pos.reshape(shape[0], -1)
        page = self.page_table[req.long().unsqueeze(1), flat.clamp(min=0) // PAGE_TOKENS]
        row = page * PAGE_TOKENS + flat.clamp(min=0) % PAGE_TOKENS
        return torch.where((flat >= 0) & (page >= 0), row, torch.full_like(row, -1)).reshape(shape)

    def write(self, layer: int, req: int, pos: torch.Tensor, rows: torch.Tensor) -> None:
        """Bulk write (prefill or PD transfer): rows [N, 656] at positions pos [N] of request req."""
        idx = self.rows(torch.tensor([req], device=self.page_table.device), pos.unsqueeze(0))[0]
        if bool((idx < 0).any()):
            raise IndexError(f"host pool: request {req} has positions beyond its reserved pages")
        self.data[layer].index_copy_(0, idx.to(self.data.device), rows.to(self.data.device))

    def read(self, layer: int, req: int, pos: torch.Tensor) -> torch.Tensor:
        idx = self.rows(torch.tensor([req], device=self.page_table.device), pos.unsqueeze(0))[0]
        return self.data[layer][idx.to(self.data.device)]
