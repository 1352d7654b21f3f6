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

Residency first (`device_rows`, docs/design.md, "Residency first"): the GPU pool is one pool of rows carved into a
region per request (ess.core.residency). A RESIDENT request's region holds every position it can reach (row = start +
position): its rows never miss and skip the LRU step (with no offloaded request live, the step is skipped
altogether, a host-known fact: nothing syncs). An OFFLOADED request's region is its C slots, run by the LRU policy
(whose slot numbers req * C + j become start + j). Without `device_rows` every request slot owns C slots at
req * C, offloaded, as before.
Everything in the step is fixed-shape device work (no host sync), so a CUDA graph can capture it; with a disk tier
`page_in` first brings the step's pages into host frames (host work: eager only).
"""

from __future__ import annotations

import numpy as np
import torch

from ess.core import layout
from ess.core.kernels import flashtrans, miss_attention, residency_map
from ess.core.disk_tier import PagedHostTier
from ess.core.policy import STAMP_MOD, PolicyResult
from ess.core.residency import RowRegions
from ess.core.settings import PAGE_TOKENS
from ess.core.sparse_pool import SparseMemoryPool

FLASHMLA_PAGE = PAGE_TOKENS


def whole_pages(rows: int) -> int:
    """FlashMLA reads a latent buffer as [-1, 64, 1, 656] pages: row counts are rounded up to whole pages."""
    return max(1, -(-rows // FLASHMLA_PAGE)) * FLASHMLA_PAGE


def batch_tokens(token_table: torch.Tensor, req: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """Every token of a batch's requests req [R] (positions [0, seq_len) of each, host lengths, in batch order): their
    locations, positions and request slots [sum(seq_lens)] int64. Fixed by the host lengths, so nothing syncs."""
    n = int(sum(seq_lens))
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=req.device)
    owner = torch.repeat_interleave(req.long(), lens, output_size=n)
    pos = torch.arange(n, device=req.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=n)
    return token_table[owner, pos].long(), pos, owner


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
        device_rows: int | None = None,
    ):
        """host: the engine's host pool [layers, locations + 1 sink, 656], pinned (the ESS KV pool owns it and writes
        every new row into it). backend: FlashTrans' (ess.core.kernels.flashtrans); kernel: the LRU step's (ess.core.sparse_pool).
        tier: a disk tier whose virtual rows are the token table's values; host is then its `data`.
        device_rows: residency first, a GPU pool of that many rows per layer from which `admit` gives each request its
        region; None: C slots per request slot, every request offloaded."""
        if host.dim() != 3 or host.shape[0] != num_layers or host.shape[2] != layout.LATENT_ROW_BYTES:
            raise ValueError(f"host pool shape {tuple(host.shape)}, expected ({num_layers}, locations + 1, {layout.LATENT_ROW_BYTES})")
        self.capacity = capacity
        self.host = host
        self.host_sink = host.shape[1] - 1
        self.tier = tier
        self.selected_pages: list[np.ndarray | None] = [None] * num_layers  # tier: each layer's last step's pages
        self.sparse = SparseMemoryPool(num_layers, max_requests, capacity, max_context, device, kernel)
        self.max_context = max_context
        self.regions = None if device_rows is None else RowRegions(device_rows)
        rows = max_requests * capacity if device_rows is None else device_rows
        slots = whole_pages(rows + 1)  # + the sink slot
        self.gpu = torch.zeros(num_layers, slots, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=device)
        self.sink_slot = rows
        # residency first: each request slot's region (start, rows) on the host; start and residency on the device
        # for the step
        self.region: dict[int, tuple[int, int]] = {}
        self.start = (torch.arange(max_requests, device=device) * capacity).long()
        self.start32 = self.start.to(torch.int32)  # the same, for the resident step's int32 slots
        self.is_resident = torch.zeros(max_requests, dtype=torch.bool, device=device)
        self.offloaded: set[int] = set()  # request slots admitted offloaded (host-known: the step's skips)
        self.moved: set[int] = set()  # offloaded request slots whose region is not at req * C (their slots are mapped)
        self._constants: dict[tuple, object] = {}  # constant step outputs and indices, made once per shape
        # a step captured once and replayed for any batch (CUDA graphs): the host-known skips are off, every step takes
        # the general path (resident sets masked out of the LRU step, offloaded slots mapped)
        self.fixed_path = False
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

    # -- residency first: each request's region (host-side, between forward passes) -------------------------------
    def admit(self, req: int, positions: int, resident: bool = True) -> bool:
        """Request slot req's region: resident (a row for each of positions [0, positions), which the request must
        never pass) when the pool has room and `resident` allows, else offloaded (C slots). Returns whether resident;
        raises when not even C rows are free (the caller demotes a resident request first, or admits fewer)."""
        if self.regions is None:
            raise ValueError("admit: this cache has no device_rows (every request is offloaded)")
        self.release(req)
        start = self.regions.alloc(positions) if resident else None
        resident = start is not None
        if not resident:
            start = self.regions.alloc(self.capacity)
            if start is None:
                raise ValueError(f"request slot {req}: {self.capacity} free device rows wanted, the largest free region "
                                 f"has {self.regions.largest_free()}")
        self._set_region(req, start, positions if resident else self.capacity, resident)
        return resident

    def demote(self, req: int, length: int | None = None) -> None:
        """A resident request (length positions written; None: at least C, or unknown) becomes offloaded without a
        copy: its region shrinks to the first C rows, which keep positions [0, min(length, C)) as LRU residents,
        older than any step's; the rest are misses to fetch from the host pool, which holds every row once the caller
        flushed the rows that only the region held (`flush`). A position not written yet that the tables call resident
        is harmless: no step selects a position past its own, and its own row lands in the slot its table names."""
        start, n = self.region[req]
        if req in self.offloaded:
            raise ValueError(f"request slot {req} is offloaded already")
        C = self.capacity
        self.regions.free(start + C, n - C)
        self._set_region(req, start, C, False)
        held = torch.arange(C, device=self.start.device)
        pos = (held if length is None else torch.where(held < length, held, -1)).expand(self.gpu.shape[0], C)
        self.sparse.load(req, pos, (self.stamp - 1).expand(self.gpu.shape[0], C))

    def promote(self, req: int, positions: int, token_table: torch.Tensor, length: int) -> bool:
        """An offloaded request becomes resident when a region of `positions` rows is free (its own C slots counted):
        its `length` written rows come from the host pool in one H2D per layer, its LRU state is dropped. Returns
        whether it moved."""
        if req not in self.offloaded or positions <= self.capacity:
            return False
        old, n = self.region[req]
        self.regions.free(old, n)
        start = self.regions.alloc(positions)
        if start is None:  # stays offloaded, in its slots
            self.regions.take(old, n)
            return False
        self.sparse.reset(req)
        self._set_region(req, start, positions, True)
        self.fill_from_host(req, length, token_table)
        return True

    def fill_from_host(self, req: int, length: int, token_table: torch.Tensor) -> None:
        """A resident request's region gets its first `length` rows from the host pool, one H2D per layer (a
        promotion, or a PD decode node's request whose KV landed in the host pool)."""
        start = self.region[req][0]
        pos = torch.arange(min(length, self.max_context, self.region[req][1]), device=self.start.device)
        r = torch.tensor([req], device=self.start.device)
        for layer in range(self.gpu.shape[0]):
            src = self.host_rows(layer, token_table, r, pos.unsqueeze(0)).flatten()
            flashtrans.gather(self.host[layer], src, self.gpu[layer], start + pos, self.backend)

    def _set_region(self, req: int, start: int, rows: int, resident: bool) -> None:
        self.region[req] = (start, rows)
        self.start[req] = start
        self.start32[req] = start
        self.is_resident[req] = resident
        (self.offloaded.discard if resident else self.offloaded.add)(req)
        # where the LRU policy numbers its slots (req * C) the region needs no mapping
        (self.moved.add if not resident and start != req * self.capacity else self.moved.discard)(req)

    def resident_requests(self) -> list[int]:
        return sorted(r for r in self.region if r not in self.offloaded)

    def _any_resident(self) -> bool:
        return len(self.offloaded) < len(self.region)

    def _constants_for(self, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Constant -1 [B, KK] and 0 [B] int32 outputs, made once per shape (never written by their readers)."""
        key = (tuple(topk.shape), topk.device)
        if key not in self._constants:
            self._constants[key] = (torch.full(topk.shape, -1, dtype=torch.int32, device=topk.device),
                                    torch.zeros(topk.shape[0], dtype=torch.int32, device=topk.device))
        return self._constants[key]

    def _mapped(self, r: PolicyResult | None, req: torch.Tensor, topk: torch.Tensor, own_pos: torch.Tensor) -> PolicyResult:
        """ess.core.kernels.residency_map.map_result: r (the LRU step over the offloaded rows) in the regions' rows; None: every
        request resident, each entry a hit at start + position, nothing to fetch, no set (n_set 0)."""
        none, zero = self._constants_for(topk)
        return residency_map.map_result(r, req, topk, own_pos, self.start32, self.is_resident, self.capacity, none, zero,
                                     self.backend)

    def all_resident(self) -> bool:
        """No offloaded request is live (host-known): the step skips the LRU policy and the fetch (not on the fixed
        path)."""
        return self.regions is not None and not self.offloaded and not self.fixed_path

    def region_rows(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(request slot req [N], position pos [N]; -1: none) -> the rows of resident ones in their regions, int64; the
        sink slot elsewhere (an offloaded slot, CUDA-graph padding). Device ops only."""
        r = req.long().clamp(min=0)
        keep = self.is_resident[r] & (req >= 0) & (pos >= 0)
        return torch.where(keep, self.start[r] + pos.long(), self.sink_slot)

    def resident_result(self, req: torch.Tensor, topk: torch.Tensor, own_pos: torch.Tensor) -> PolicyResult:
        """The step of a batch whose requests are all resident: every entry a hit at start + position, nothing to
        fetch (residency_map.map_result without an LRU result)."""
        return self._mapped(None, req, topk, own_pos)

    def flush(self, req: int, token_table: torch.Tensor, lo: int, hi: int) -> int:
        """Host copies once: a resident request's region rows of positions [lo, hi) to their host rows, every layer in
        one FlashTrans copy (docs/design.md, "Residency first"). The resident step writes a new row into the region
        only; this runs when the host pool must hold it: before a demotion, before the request's rows go to the radix
        cache, before a PD retraction's backup. Returns the rows copied per layer (0: not resident, or nothing)."""
        if self.regions is None or req not in self.region or req in self.offloaded or self.tier is not None:
            return 0
        start, rows = self.region[req]
        hi = min(hi, rows, token_table.shape[1])
        if hi <= lo:
            return 0
        dev = self.gpu.device
        pos = torch.arange(lo, hi, device=dev)
        loc = token_table[req, lo:hi].long().to(dev)
        layer = torch.arange(self.gpu.shape[0], device=dev).unsqueeze(1)
        src = (layer * self.gpu.shape[1] + start + pos).flatten()
        dst = (layer * self.host.shape[1] + loc).flatten()
        flashtrans.scatter(self.gpu.view(-1, layout.LATENT_ROW_BYTES), src, self.host.view(-1, layout.LATENT_ROW_BYTES),
                           dst, self.backend)
        return hi - lo

    def fill_resident(self, layer: int, rows: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> None:
        """Rows [N, 656] of (request slot req [N], position pos [N]; -1: none) into the regions of the resident ones
        (a prefill's rows, as it writes them); the others go to the sink row. Device work only."""
        if self.regions is None or not self._any_resident():
            return
        self.gpu[layer].index_copy_(0, self.region_rows(req, pos), rows)

    def forget(self, req: torch.Tensor) -> None:
        """Forget the LRU rows of request slots req (a new prefill of theirs), keeping their regions."""
        self.sparse.reset(req)

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
        if self.regions is not None:  # a resident request holds every row already
            sets = torch.where(self.is_resident[req.long()].view(-1, 1, 1), -1, sets)
        took = self.sparse.warm(layer, req, sets, first_stamp)
        pos, slots = self.sparse.resident_slots(layer, req)  # rows of the slots that took a position are fetched
        slots = torch.where(took, residency_map.physical(slots, req, self.start32, self.capacity).long() if self.regions is not None else slots, -1)
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
        self.fill_held(req, token_table)

    def fill_held(self, req: int, token_table: torch.Tensor) -> None:
        """Every row request slot req's LRU tables hold, on every layer, from the host pool in one gather: after
        load_warm's state, or once a request's KV lands in the host pool after its tables were set (a PD request
        demoted before its KV arrived holds rows never written to its slots). A held position not written yet gets
        whatever its table entry points at, as after a demotion (see `demote`)."""
        if self.tier is not None:
            raise NotImplementedError("fill_held reads host rows by token location; a disk tier's are frames (the plugin "
                                      "refuses --ess-disk-dir on PD nodes)")
        L, slots = self.gpu.shape[:2]
        C = self.capacity
        held = self.sparse.slot_pos[:, req, :C].long()  # [L, C]
        r = torch.tensor([req], device=held.device)
        # without a tier the rows are the locations, the same on every layer (the sink row where empty)
        rows = self.host_rows(0, token_table, r, held.reshape(1, -1)).reshape(L, C)
        layer = torch.arange(L, device=held.device).unsqueeze(1)
        src = (layer * self.host.shape[1] + rows).flatten()
        dst = torch.where(held >= 0, layer * slots + self.start[req] + torch.arange(C, device=held.device), -1).flatten()
        flashtrans.gather(self.host.view(-1, layout.LATENT_ROW_BYTES), src, self.gpu.view(-1, layout.LATENT_ROW_BYTES), dst, self.backend)

    # -- the decode step ------------------------------------------------------------------------------------------
    def next_step(self) -> None:
        """Advance the LRU stamp once per forward pass (a device op, so a captured graph advances it too). One global
        counter keeps every request's own order of steps, which is all LRU compares."""
        self.stamp.add_(1).remainder_(STAMP_MOD)  # bounded for the life of a server (ess.core.policy compares ages)

    def update(self, layer: int, req: torch.Tensor, topk: torch.Tensor, own_pos: torch.Tensor,
               token_table: torch.Tensor | None = None) -> PolicyResult:
        """The LRU step (token_table: the fused kernel also reads each miss's host row from it). With regions: resident
        requests' entries map to their rows (their sets masked out of the LRU step, which is skipped when no request
        is offloaded), offloaded requests' slots to their regions."""
        if self.regions is None:
            return self.sparse.step(layer, req, topk, own_pos, self.stamp, token_table)
        if not self.offloaded and not self.fixed_path:
            return self.resident_result(req, topk, own_pos)
        if not self._any_resident() and not self.fixed_path:  # none resident: mapped only if moved
            r = self.sparse.step(layer, req, topk, own_pos, self.stamp, token_table)
            return self._mapped(r, req, topk, own_pos) if self.moved else r
        sets, own = residency_map.premask(req, topk, own_pos, self.is_resident, self.backend)
        return self._mapped(self.sparse.step(layer, req, sets, own, self.stamp, token_table), req, topk, own_pos)

    def miss_rows(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, r: PolicyResult) -> torch.Tensor:
        """Each miss's host row [B, K] (the sink row where padded)."""
        if r.miss_row is None:
            return self.host_rows(layer, token_table, req, r.miss_pos)
        return r.miss_row if self.tier is None else self.tier.rows(layer, r.miss_row)  # the fused step read them

    def fetch(self, layer: int, req: torch.Tensor, token_table: torch.Tensor, r: PolicyResult, overlapped: bool = False) -> None:
        """H2D of the misses into their GPU slots (FlashTrans over the compacted miss lists, current stream;
        overlapped: on the copy stream, beside compute)."""
        if self.all_resident():
            return
        rows = self.miss_rows(layer, req, token_table, r)
        flashtrans.gather_lists(self.host[layer], rows, self.gpu[layer], r.miss_slot, r.n_miss, self.backend, overlapped)

    # -- DA's Attn1 over the misses only (ess.core.kernels.miss_attention; one query row per request) -------------------------
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
        own_slot = r.own_slot.reshape(-1)
        n = own_slot.shape[0]
        key = ("rows", n, own_slot.device)
        if key not in self._constants:  # 0..n-1, made once per shape
            self._constants[key] = torch.arange(n, dtype=torch.int32, device=own_slot.device)
        # one FlashTrans copy (one kernel on a GPU); a -1 slot (no own token) copies nothing
        rows = own_rows.reshape(-1, layout.LATENT_ROW_BYTES).contiguous()
        flashtrans.copy_rows(rows, self._constants[key], self.gpu[layer], own_slot, self.backend)

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
    def release(self, req: int | torch.Tensor, slots: list[int] | None = None) -> None:
        """Forget the GPU rows of request slot(s) req (finished, aborted, or prefilling anew), and with regions give its
        region back (slots: req as host ints, saving a device read); their host rows are the engine's tokens, freed by
        it."""
        self.sparse.reset(req)
        if self.regions is not None:
            if slots is None:
                slots = [int(x) for x in req.reshape(-1).tolist()] if isinstance(req, torch.Tensor) else [req]
            freed = [r for r in dict.fromkeys(slots) if r in self.region]  # (a row reset twice is freed once)
            for r in freed:
                self.regions.free(*self.region.pop(r))
                self.offloaded.discard(r)
                self.moved.discard(r)
            if freed:  # a freed slot is no one's region: nothing reads it as resident
                self.is_resident[torch.tensor(freed, device=self.is_resident.device)] = False

    def device_bytes(self) -> int:
        return self.gpu.numel() + self.sparse.table_bytes()
