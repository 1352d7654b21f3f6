"""ServingLatentCache: the ESS latent cache addressed the way a serving engine addresses its KV cache.

A serving engine (SGLang) gives every live request a slot in a request pool and every token a location in a token
pool, with a table token_table[request slot, position] = location (SGLang's req_to_token). ESS keeps its two pools
in those coordinates, so the engine's allocator stays the one owner of tokens and requests:
    host   [layers, locations + 1 sink, 656]  the Total Memory Pool, pinned, indexed by token location (owned by the
                                             engine's KV pool, which writes every new row into it); or, with a disk
                                             tier (ess.core.disk_tier), its frames, addressed through the tier
    sparse (ess.core.sparse_pool) per layer, C GPU slots per request slot, with the LRU tables
The decode step translates the indexer's top-k positions into GPU slots (`translate`), fetching the misses from the
host pool with FlashTrans; the step's own rows go to their GPU slots and to the host pool.
Everything in the step is fixed-shape device work (no host sync), so a CUDA graph can capture it; with a disk tier
`page_in` first brings the step's pages into host frames (host work: eager only).
"""

from __future__ import annotations

import numpy as np
import torch

from ess.core import flashtrans, layout, miss_attention
from ess.core.disk_tier import PagedHostTier
from ess.core.policy import STAMP_MOD, PolicyResult
from ess.core.settings import PAGE_TOKENS
from ess.core.sparse_pool import SparseMemoryPool

FLASHMLA_PAGE = PAGE_TOKENS


def whole_pages(rows: int) -> int:
    """FlashMLA reads a latent buffer as [-1, 64, 1, 656] pages: row counts are rounded up to whole pages."""
    return max(1, -(-rows // FLASHMLA_PAGE)) * FLASHMLA_PAGE


def batch_tokens(token_table: torch.Tensor, req: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of a batch's requests req [R] (positions [0, seq_len) of each, host lengths, in batch order): their
    locations and positions [sum(seq_lens)] int64. Fixed by the host lengths, so nothing syncs."""
    n = int(sum(seq_lens))
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=req.device)
    owner = torch.repeat_interleave(req.long(), lens, output_size=n)
    pos = torch.arange(n, device=req.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=n)
    return token_table[owner, pos].long(), pos


class ServingLatentCache:
    def __init__(
        self,
        num_layers: int,
        max_requests: int,
        capacity: int,
        max_context: int,
        host: torch.Tensor,
        device: torch.device | str,
        backend: str = "auto",
        kernel: str = "auto",
        tier: PagedHostTier | None = None,
    ):
        """host: the engine's host pool [layers, locations + 1 sink, 656], pinned (the ESS KV pool owns it and writes
        every new row into it). backend: FlashTrans' (ess.core.flashtrans); kernel: the LRU step's (ess.core.sparse_pool).
        tier: a disk tier whose virtual rows are the token table's values; host is then its `data`."""
        if host.dim() != 3 or host.shape[0] != num_layers or host.shape[2] != layout.LATENT_ROW_BYTES:
            raise ValueError(f"host pool shape {tuple(host.shape)}, expected ({num_layers}, locations + 1, {layout.LATENT_ROW_BYTES})")
        self.capacity = capacity
        self.host = host
        self.host_sink = host.shape[1] - 1
        self.tier = tier
        self.selected_pages: list[np.ndarray | None] = [None] * num_layers  # tier: each layer's last step's pages
        self.sparse = SparseMemoryPool(num_layers, max_requests, capacity, max_context, device, kernel)
        slots = whole_pages(max_requests * capacity + 1)  # + the sink slot
        self.gpu = torch.zeros(num_layers, slots, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=device)
        self.sink_slot = self.sparse.sink_slot
        self.backend = backend
        self.stamp = torch.zeros((), dtype=torch.int32, device=device)

    # -- addressing -------------------------------------------------------------------------------------------
    def locations(self, token_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token location of each (request slot, position) [B, ...]; -1 where pos < 0."""
        flat = pos.long().reshape(pos.shape[0], -1)
        loc = token_table[req.long().unsqueeze(1), flat.clamp(min=0)].long()
        return torch.where(flat >= 0, loc, -1).reshape(pos.shape)

    def host_of(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """Host rows of token locations on `layer` (-1: the sink row): the location itself, or with a disk tier its
        row in the frames."""
        if self.tier is not None:
            return self.tier.rows(layer, loc)
        loc = loc.long()
        return torch.where(loc >= 0, loc, torch.full_like(loc, self.host_sink))

    def host_rows(self, layer: int, token_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Host row of each (request slot, position) on `layer`; the sink row where pos < 0."""
        return self.host_of(layer, self.locations(token_table, req, pos))

    # -- a disk tier: pages into host frames before the device reads them (host work, outside CUDA graphs) -----------
    def missing(self, layer: int, req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """The positions of sets [B, N] that the coming LRU step will fetch: selected, not in req's GPU slots, not
        the step's own (own [B] or [B, M]); -1 elsewhere."""
        sets = sets.long()
        own = own.long().reshape(own.shape[0], -1)
        is_own = (sets.unsqueeze(-1) == own.unsqueeze(1)).any(-1)
        resident = self.sparse.pos_slot[layer, req.long().unsqueeze(1), sets.clamp(min=0)] >= 0
        return torch.where(is_own | resident | (sets < 0), -1, sets)

    def page_in(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, sets: torch.Tensor,
                own: torch.Tensor, more: bool = False) -> None:
        """Before a layer's LRU step: its misses' rows into host frames (their sectors read, waited for). The pages of every
        selected position are kept for the next step's read-ahead (more: this call is a further part of the same
        step, as DBA's second half, whose pages join the first part's)."""
        tier = self.tier
        fetched = self.locations(token_table, req, self.missing(layer, req, sets, own))
        tier.ensure_rows(layer, fetched)
        tier.check_read(layer, fetched, req.long().unsqueeze(1))  # a lost row (a failed checksum) charges its request
        pages = tier.pages(layer, self.locations(token_table, req, sets))
        kept = self.selected_pages[layer]
        self.selected_pages[layer] = np.union1d(kept, pages) if more and kept is not None else pages

    def read_ahead(self, layer: int) -> None:
        """After page_in: changed pages no call of this step used are written out, and the pages the next layer
        selected at its last step are read into frames, both in the background."""
        self.tier.clean()
        ahead = self.selected_pages[(layer + 1) % len(self.selected_pages)]
        if ahead is not None:
            self.tier.prefetch(ahead)

    # -- LRU-Warmup ---------------------------------------------------------------------------------------------
    def warmup(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, sets: torch.Tensor, first_stamp=None) -> None:
        """LRU-Warmup of request slots req [B] from their last W prefill top-k sets [B, W, K] (oldest first), window w
        stamped first_stamp + w (default: W below the current stamp), in one compaction (SparseMemoryPool.warm), then
        one gather of the rows that became resident."""
        if first_stamp is None:
            first_stamp = self.stamp - sets.shape[1]
        took = self.sparse.warm(layer, req, sets, first_stamp)
        pos, slots = self.sparse.resident_slots(layer, req)  # rows of the slots that took a position are fetched
        slots = torch.where(took, slots, torch.full_like(slots, -1))
        loc = self.locations(token_table, req, torch.where(took, pos, -1))
        if self.tier is not None:
            self.tier.ensure_rows(layer, loc)
            self.tier.check_read(layer, loc, req.long().view(-1, *[1] * (loc.dim() - 1)))
        flashtrans.gather(self.host[layer], self.host_of(layer, loc).flatten(), self.gpu[layer], slots.flatten(), self.backend)

    def load_warm(self, req: int, token_table: torch.Tensor, pos: torch.Tensor, stamps: torch.Tensor) -> None:
        """Request slot req's LRU state on every layer from another node's warm-up (SparseMemoryPool.load: pos and
        stamps [layers, M]), then one gather of the resident rows of all layers from the host pool."""
        if self.tier is not None:
            raise NotImplementedError("a disk tier does not take a PD warm-up (the plugin refuses --ess-disk-dir on PD nodes)")
        self.sparse.load(req, pos, stamps)
        L, slots = self.gpu.shape[:2]
        C = self.capacity
        held = self.sparse.slot_pos[:, req, :C].long()  # [L, C]
        r = torch.tensor([req], device=held.device)
        # without a tier the rows are the locations, the same on every layer (the sink row where empty)
        rows = self.host_rows(0, token_table, r, held.reshape(1, -1)).reshape(L, C)
        layer = torch.arange(L, device=held.device).unsqueeze(1)
        src = (layer * self.host.shape[1] + rows).flatten()
        dst = torch.where(held >= 0, layer * slots + req * C + torch.arange(C, device=held.device), -1).flatten()
        flashtrans.gather(self.host.view(-1, layout.LATENT_ROW_BYTES), src, self.gpu.view(-1, layout.LATENT_ROW_BYTES), dst, self.backend)

    # -- the decode step ------------------------------------------------------------------------------------------
    def next_step(self) -> None:
        """Advance the LRU stamp once per forward pass (a device op, so a captured graph advances it too). One global
        counter keeps every request's own order of steps, which is all LRU compares."""
        self.stamp.add_(1).remainder_(STAMP_MOD)  # bounded for the life of a server (ess.core.policy compares ages)

    def update(self, layer: int, req: torch.Tensor, topk: torch.Tensor, own_pos: torch.Tensor,
               token_table: torch.Tensor | None = None) -> PolicyResult:
        """The LRU step (token_table: the fused kernel also reads each miss's host row from it)."""
        return self.sparse.step(layer, req, topk, own_pos, self.stamp, token_table)

    def miss_rows(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, r: PolicyResult) -> torch.Tensor:
        """Each miss's host row [B, K] (the sink row where padded)."""
        if r.miss_row is None:
            return self.host_rows(layer, token_table, req, r.miss_pos)
        return r.miss_row if self.tier is None else self.tier.rows(layer, r.miss_row)  # the fused step read them

    def fetch(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, r: PolicyResult, overlapped: bool = False) -> None:
        """H2D of the misses into their GPU slots (FlashTrans over the compacted miss lists, current stream;
        overlapped: on the copy stream, beside compute)."""
        rows = self.miss_rows(layer, req, token_table, r)
        flashtrans.gather_lists(self.host[layer], rows, self.gpu[layer], r.miss_slot, r.n_miss, self.backend, overlapped)

    # -- DA's Attn1 over the misses only (ess.core.miss_attention; one query row per request) -------------------------
    def attend_misses(self, layer: int, r: PolicyResult, q_nope: torch.Tensor, q_pe: torch.Tensor, scale: float):
        """Attn1 after `fetch`: each request's query [B, H, 512 / 64] over its fetched rows (its compacted miss list and
        device count). Returns (o [B, H, 512], lse [B, H]) float32, to merge with Attn0 (miss_attention.merge)."""
        return miss_attention.miss_attention(q_nope, q_pe, self.gpu[layer], r.miss_slot, r.n_miss, scale, self.backend)

    def fetch_attend(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, r: PolicyResult,
                     q_nope: torch.Tensor, q_pe: torch.Tensor, scale: float):
        """`fetch` and `attend_misses` in one kernel (miss_attention.copy_attend): each missing row read from the host
        pool once, stored in its GPU slot and attended as it lands."""
        rows = self.miss_rows(layer, req, token_table, r)
        return miss_attention.copy_attend(q_nope, q_pe, self.host[layer], rows, self.gpu[layer], r.miss_slot, r.n_miss,
                                          scale, self.backend)

    def rows(self, layer: int, r: PolicyResult) -> torch.Tensor:
        """The selected rows [B, K, 656] after a step (rows of -1 entries are garbage: mask them)."""
        return self.gpu[layer][r.attn_slot.clamp(min=0)]

    def store_own(self, layer: int, r: PolicyResult, own_rows: torch.Tensor) -> None:
        """The step's own rows [B(, M), 656] into their GPU slots."""
        own_slot = r.own_slot.reshape(-1).long()
        own_slot = torch.where(own_slot >= 0, own_slot, torch.full_like(own_slot, self.sink_slot))
        self.gpu[layer].index_copy_(0, own_slot, own_rows.reshape(-1, layout.LATENT_ROW_BYTES))

    def translate(
        self,
        layer: int,
        req: torch.Tensor,
        token_table: torch.Tensor,
        topk: torch.Tensor,
        own_pos: torch.Tensor,
        own_rows: torch.Tensor | None = None,
    ) -> PolicyResult:
        """The serial step, mode NONE, in one call: policy, H2D of the misses, own rows into their slots, in that order
        on the current stream. The one implementation of that order: the plugin's runtime, the reference overlap
        engine and the reference cache call it. r.attn_slot then indexes self.gpu[layer] for every top-k entry (-1
        entries stay -1)."""
        r = self.update(layer, req, topk, own_pos, token_table)
        self.fetch(layer, req, token_table, r)
        if own_rows is not None:
            self.store_own(layer, r, own_rows)
        return r

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def release(self, req: int | torch.Tensor) -> None:
        """Forget the GPU rows of request slot(s) req (finished, aborted, or prefilling anew); their host rows are the
        engine's tokens, freed by it."""
        self.sparse.reset(req)

    def device_bytes(self) -> int:
        return self.gpu.numel() + self.sparse.table_bytes()
