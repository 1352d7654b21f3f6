"""EssLatentCache: the ESS latent cache behind the reference model's latent-cache interface
(see ess.reference.dense_cache), for a fixed batch: the Total Memory Pool (ess.reference.host_pool, paged, each request's
rows reserved up front) under ess.core.serving.ServingLatentCache (the Sparse Memory Pool, the LRU policy with warm-up,
FlashTrans for misses), addressed through a token table of the requests' host rows. The step's own rows go to their
GPU slots and are backed up to the host pool (D2H) on the copy stream, which ess.reference.overlap overlaps with attention.
"""

from __future__ import annotations

import torch

from ess.core import layout
from ess.core.kernels import flashtrans
from ess.core.settings import PAGE_TOKENS, EssConfig
from ess.reference.tiered_host_pool import TieredHostPool
from ess.reference.host_pool import TotalMemoryPool
from ess.core.policy import PolicyResult
from ess.reference.dense_cache import DecodeRows
from ess.core.residency import split
from ess.core.serving import ServingLatentCache
from ess.core.streams import Streams


class EssLatentCache:
    def __init__(
        self,
        cfg: EssConfig,
        num_layers: int,
        context_lens: list[int],
        max_len: int,
        device: torch.device | str,
        backend: str = "auto",
        tier: TieredHostPool | None = None,
        kernel: str = "auto",
        device_rows: int | None = None,
    ):
        """tier: a disk tier for the host pool (ess.reference.tiered_host_pool), built for this batch; None: the whole Total
        Memory Pool in host memory. kernel: the LRU step's (settings.KERNELS). device_rows: residency first
        (ess.core.residency), a GPU pool of that many rows per layer: as many requests resident (every row of their
        max_len positions on the GPU) as it holds beside the others' C slots, those first in batch order."""
        B = len(context_lens)
        self.cfg = cfg
        self.backend = backend
        self.capacity = cfg.capacity(max_len)
        self.slots = torch.arange(B, device=device)  # batch row b is request slot b of the serving cache
        self.tier = tier
        if tier is None:
            per_request = -(-max_len // PAGE_TOKENS) * PAGE_TOKENS
            host_tokens = cfg.host_pool_tokens(num_layers, layout.LATENT_ROW_BYTES) or B * per_request
            self.host = TotalMemoryPool(num_layers, host_tokens, B, max_len, device)
            reqs = []
            for _ in range(B):
                r = self.host.alloc_request()
                self.host.reserve(r, max_len)  # the whole request up front: no allocation inside decode steps
                reqs.append(r)
            self.req = torch.tensor(reqs, dtype=torch.int64, device=device)  # host-pool request ids
            # request b's token table: the host rows of b's positions (the same on every layer)
            self.token_table = self.host.rows(self.req, torch.arange(max_len, device=device).expand(B, -1))
        else:
            self.host = tier
            self.req = self.slots
            self.token_table = tier.token_table()  # virtual rows, which the serving cache maps to frames
        # int32, as SGLang's req_to_token: the CUDA LRU step reads it so (an int64 table failed every step on an H200)
        if int(self.token_table.max()) >= 2**31:
            raise ValueError(f"ESS cache: {int(self.token_table.max())} host rows exceed an int32 token table")
        self.token_table = self.token_table.to(torch.int32).contiguous()
        self.serving = ServingLatentCache(num_layers, B, self.capacity, max_len, self.host.data, device, backend,
                                          kernel=kernel, tier=tier, device_rows=device_rows)
        self._own_host = None  # (the step's own positions, their host rows): backup_own's lookup, once per step
        self.resident = [False] * B
        if device_rows is not None:
            R = split(device_rows, B, max_len, self.capacity)
            self.resident = [self.serving.admit(b, max_len, resident=b < R) for b in range(B)]
        self.sparse = self.serving.sparse
        self.stamp = self.serving.stamp
        self.num_layers = num_layers
        self.streams = Streams(device)
        self.warm: list[torch.Tensor | None] = [None] * num_layers  # per layer [B, W, K]
        self.misses: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.set_sizes: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    # -- the latent-cache interface -------------------------------------------------------------------------
    def prefill(self, layer: int, b: int, rows: torch.Tensor, warm_sets: torch.Tensor | None) -> None:
        self.host.write(layer, int(self.req[b]), torch.arange(rows.shape[0], device=self.req.device), rows)
        if self.resident[b]:  # its region holds every row (as a server's prefill writes them)
            start = self.serving.region[b][0]
            self.serving.gpu[layer, start:start + rows.shape[0]] = rows.to(self.serving.gpu.device)
        if warm_sets is not None and self.cfg.warmup_windows > 0:
            if self.warm[layer] is None:
                W, K = warm_sets.shape
                self.warm[layer] = torch.full((len(self.req), W, K), -1, dtype=torch.int32, device=self.req.device)
            self.warm[layer][b] = warm_sets

    def start_decode(self) -> None:
        """LRU-Warmup: replay the last W prefill top-k sets, then fetch the resulting resident rows in one gather."""
        for layer in range(self.num_layers):
            if self.warm[layer] is not None:
                self.warmup_layer(layer, self.warm[layer])

    def warmup_layer(self, layer: int, sets: torch.Tensor) -> None:
        """sets [B, W', K], oldest first; the last min(W', warmup_windows) windows are used, stamped w - W."""
        W = min(self.cfg.warmup_windows, sets.shape[1])
        sets = sets[:, sets.shape[1] - W :]
        self.serving.warmup(layer, self.slots, self.token_table, sets, first_stamp=-W)

    def _page_in(self, layer: int, topk: torch.Tensor, pos: torch.Tensor, part: slice) -> None:
        """With a disk tier, before a layer's LRU step: ServingLatentCache.page_in (DBA's second half joins the first
        half's step)."""
        self.serving.page_in(layer, self.slots[part], self.token_table, topk, pos, more=part.start not in (None, 0))

    # -- decode phases (ess.reference.overlap orders them per mode; `decode` is the serial order) ----------------------
    def set_step(self, step: int) -> None:
        """The stamp of the coming decode step, kept on the device so a captured CUDA graph reads it."""
        self.stamp.fill_(step)
        self._own_host = None

    def update(self, layer: int, topk: torch.Tensor, pos: torch.Tensor, part: slice = slice(None)) -> PolicyResult:
        """The LRU policy for the batch rows in `part` (device only, without a disk tier)."""
        if self.tier is not None:
            self._page_in(layer, topk, pos, part)
        return self.serving.update(layer, self.slots[part], topk, pos, self.token_table)

    def translate(self, layer: int, topk: torch.Tensor, pos: torch.Tensor, own_rows: torch.Tensor) -> PolicyResult:
        """The serial step, mode NONE, of the whole batch: ServingLatentCache.translate (policy, H2D of the misses, own
        rows into their slots, all on the compute stream), the one implementation of that order."""
        if self.tier is not None:
            self._page_in(layer, topk, pos, slice(None))
        return self.serving.translate(layer, self.slots, self.token_table, topk, pos, own_rows)

    def fetch(self, layer: int, r: PolicyResult, part: slice = slice(None), overlapped: bool = False) -> None:
        """H2D of the misses of `r` (rows `part` of the batch) into their GPU slots (current stream; overlapped: the
        copy stream, beside compute)."""
        self.serving.fetch(layer, self.slots[part], self.token_table, r, overlapped)

    def attend_misses(self, layer: int, r: PolicyResult, q_nope: torch.Tensor, q_pe: torch.Tensor, scale: float):
        """DA's Attn1 over the fetched misses (ServingLatentCache.attend_misses)."""
        return self.serving.attend_misses(layer, r, q_nope, q_pe, scale)

    def fetch_attend(self, layer: int, r: PolicyResult, q_nope: torch.Tensor, q_pe: torch.Tensor, scale: float):
        """The misses' H2D and Attn1 in one kernel, every batch row (ServingLatentCache.fetch_attend)."""
        return self.serving.fetch_attend(layer, self.slots, self.token_table, r, q_nope, q_pe, scale)

    def store_own(self, layer: int, r: PolicyResult, own_rows: torch.Tensor) -> None:
        """Write the step's own rows into their GPU slots (compute stream)."""
        self.serving.store_own(layer, r, own_rows)

    def backup_own(self, layer: int, r: PolicyResult, pos: torch.Tensor):
        """D2H of the step's own rows (pos [B], or [B, M] for M rows per request as in MTP verify) to the host pool, on
        the copy stream after store_own. Returns its event: the compute stream waits on it before the layer ends (so a
        later step cannot evict the slot mid-copy, and a captured graph joins its copy stream)."""
        if self.tier is not None:  # the own rows' pages in frames, changed by this copy
            self.tier.ensure(self.tier.pages_of(layer, self.slots, pos), dirty=True)
            host_rows = self.serving.host_rows(layer, self.token_table, self.slots, pos).reshape(-1)
        else:  # the same rows on every layer: looked up once per step (pos is the step's tensor)
            if self._own_host is None or self._own_host[0] is not pos:
                self._own_host = (pos, self.serving.host_rows(layer, self.token_table, self.slots, pos).reshape(-1))
            host_rows = self._own_host[1]
        own_slot = r.own_slot.reshape(-1)
        if self.serving.all_resident():  # no slot is ever evicted: the D2H in stream order, nothing to wait for
            flashtrans.scatter(self.serving.gpu[layer], own_slot, self.host.data[layer], host_rows, self.backend)
            return None
        return self.streams.copy_after(
            lambda: flashtrans.scatter(self.serving.gpu[layer], own_slot, self.host.data[layer], host_rows, self.backend),
            host_rows, own_slot,
        )

    def rows(self, layer: int, r: PolicyResult) -> torch.Tensor:
        """The selected rows [B, K, 656] from the GPU pool (rows of -1 entries are garbage, masked by valid)."""
        return self.serving.rows(layer, r)

    def record(self, layer: int, r: PolicyResult) -> None:
        """Once per layer and step, after its step (every overlap mode calls it)."""
        self.misses[layer].append(r.n_miss)
        self.set_sizes[layer].append(r.n_set)
        if self.tier is not None:  # after the layer's step: write-back and read-ahead in the background
            self.serving.read_ahead(layer)

    def decode(self, layer: int, step: int | None, topk: torch.Tensor, pos: torch.Tensor, own_rows: torch.Tensor) -> DecodeRows:
        """Serial order (mode NONE): policy, H2D, wait, own row, then the rows for one attention call.
        step None: the stamp was set beforehand (set_step), as in a captured CUDA graph."""
        if step is not None:
            self.set_step(step)
        r = self.translate(layer, topk, pos, own_rows)
        backed_up = self.backup_own(layer, r, pos)
        self.record(layer, r)
        rows = self.rows(layer, r)
        self.streams.wait(backed_up)
        return DecodeRows(rows=rows, valid=topk >= 0, hit=r.hit)

    def device_bytes(self) -> int:
        return self.serving.device_bytes()

    # -- statistics and lifecycle ---------------------------------------------------------------------------
    def miss_counts(self) -> torch.Tensor:
        """[B, steps, layers] int32 misses of every decode step so far."""
        return torch.stack([torch.stack(m) for m in self.misses], dim=2).permute(1, 0, 2).cpu()

    def set_size_counts(self) -> torch.Tensor:
        """[B, steps, layers] int32 |S| of every decode step so far."""
        return torch.stack([torch.stack(m) for m in self.set_sizes], dim=2).permute(1, 0, 2).cpu()

    def release(self, b: int) -> None:
        self.serving.release(b)
        if self.tier is None:
            self.host.release(int(self.req[b]))
