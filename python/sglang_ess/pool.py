"""EssDSATokenToKVPool: SGLang's DSA KV pool with the latent cache moved to pinned host memory.

What stays on the GPU: index-K of every token (the Lightning Indexer reads it every step), a staging buffer for
prefill, and a small scratch for the rows a decode step writes. The latent cache of every token lives in the pinned
host pool, indexed by SGLang's token location, so SGLang's allocator, radix cache and PD transfer keep their
addresses. The pool's `kv_buffer` entries *are* the host pool's layers: SGLang's PD transfer (which reads
`get_contiguous_buf_infos`) therefore lands received latent rows straight in host memory.

Reads, by phase (set by the plugin around the DSA backend's forward calls):
    extend (prefill)  the batch's requests are staged: their host rows (the cached prefix) are gathered into the
                      staging buffer, layer by layer, and the new rows are written there; the backend translates
                      its page table through `translate_loc_to_hisparse_device` (the sparse-offload hook SGLang
                      already calls), so FlashMLA reads staging rows.
    decode / verify   the backend asks the ESS runtime (its sparse-offload coordinator) for the selected rows,
                      which live in the runtime's per-request GPU slots (ess.core.serving).
Writes: SGLang's own quantiser (`_write_mla_kv_buffer`) makes the 656-byte FP8 rows in GPU memory, then FlashTrans
copies them to their host rows (D2H); in decode the same rows are the step's own rows for the runtime. On the resident
path (docs/plugin.md, "Two paths") a decode row is written straight into its request's region and not backed up.

With --ess-disk-dir the host pool is a disk tier (ess.core.disk_tier) whose virtual rows are the token locations:
`ess_host` holds its frames, every access first brings the locations' pages into frames (`_pages_in`, host work
that waits for the device: eager mode only) and addresses them through the tier's page map (`_host_rows`). The tier
quarantines a page that fails its checksum: every read charges the request-table row of a reader of a lost row
(`_check_read`; the plugin aborts that request), every write finds the rows again, a copy carries the loss along.
"""

from __future__ import annotations

import numpy as np
import torch

from ess.core import layout
from ess.core.kernels import flashtrans
from ess.core.disk_tier import PagedHostTier
from ess.core.pinned import pinned_zeros
from ess.core.serving import batch_tokens, whole_pages
from sglang_ess import device_bytes
from sglang_ess.sizing import FIRST_ROW, DiskTierSpec
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc

EXTEND, DECODE = "extend", "decode"
# the plugin's flags, which the disk tier's messages name
TIER_FLAGS = {"host_budget": "--ess-host-pool-gib", "disk_dir": "--ess-disk-dir", "disk_gib": "--ess-disk-gib"}


class EssDSATokenToKVPool(DSATokenToKVPool):
    # Set on the subclass that `pool_class` makes for one launch.
    scratch_rows: int = 1  # rows a decode/verify step writes at most (the largest batch x query rows)
    stage_rows: int = 1  # staging rows for prefill, charged by sizing; under SGLang the plugin's admission hook keeps
    # every prefill batch within them, elsewhere (tools, tests) the buffer grows on demand
    backend: str = "auto"  # FlashTrans backend
    tier_spec: DiskTierSpec | None = None  # --ess-disk-dir

    # -- buffers ---------------------------------------------------------------------------------------------
    def _create_buffers(self):
        """Called by SGLang's constructor in place of the device latent buffer."""
        if self.kv_cache_dim != layout.LATENT_ROW_BYTES or self.store_dtype != torch.uint8:
            raise ValueError(f"--enable-ess needs the packed 656-byte FP8 latent rows, got {self.kv_cache_dim} x {self.store_dtype}")
        pin = torch.device(self.device).type == "cuda"
        locs = self.size + self.page_size  # SGLang's location space (location 0 is its padding slot)
        self.ess_tier = None
        if self.tier_spec is None:
            # + 1 sink row that fixed-shape gathers read for -1 entries
            # pinned at exactly its size (ess.core.pinned: torch's pinned allocator would round it up to a power of two)
            self.ess_host = pinned_zeros((self.layer_num, locs + 1, layout.LATENT_ROW_BYTES), pin=pin)
            self.kv_buffer = [self.ess_host[i, :locs].unsqueeze(1) for i in range(self.layer_num)]
        else:  # the frames of a disk tier over the location space (one view per layer, all of the same frames)
            spec = self.tier_spec
            self.ess_tier = PagedHostTier(self.layer_num, locs, spec.host_bytes, spec.disk_dir, spec.disk_bytes,
                                          self.device, TIER_FLAGS, quarantine=True)
            self.ess_host = self.ess_tier.data
            self.kv_buffer = [self.ess_host[i].unsqueeze(1) for i in range(self.layer_num)]
        self.ess_scratch = torch.zeros(FIRST_ROW + self.scratch_rows, 1, layout.LATENT_ROW_BYTES, dtype=torch.uint8,
                                       device=self.device)
        self.ess_scratch_idx = torch.arange(FIRST_ROW, FIRST_ROW + self.scratch_rows, device=self.device)
        self.ess_stage = torch.zeros(whole_pages(FIRST_ROW + self.stage_rows), 1, layout.LATENT_ROW_BYTES,
                                     dtype=torch.uint8, device=self.device)
        self.ess_stage_of_loc = torch.full((locs + 1,), -1, dtype=torch.int32, device=self.device)
        self.ess_phase = EXTEND
        self.ess_relabelled = False  # this forward is DP attention's relabelled decode (sglang_ess.hooks.forward)
        self.ess_runtime = None  # set by the plugin once the runtime exists
        self._stage_locs: torch.Tensor | None = None  # locations of the staged rows, in staging order
        self._stage_pos: torch.Tensor | None = None  # the position of each staging row's token (-1: row 0)
        self._stage_req: torch.Tensor | None = None  # the request slot of each staging row (-1: row 0)
        self._stage_cached: tuple[torch.Tensor, ...] | None = None  # cached prefix: locations, staging rows, readers
        self._staged_layers: set[int] = set()

    # -- host rows: by location, or through the disk tier ------------------------------------------------------------
    def _host_rows(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        return loc.long() if self.ess_tier is None else self.ess_tier.rows(layer, loc)

    def _pages_in(self, layer: int, loc: torch.Tensor, dirty: bool = False) -> None:
        """With a disk tier: the pages of these locations on `layer` into host frames (dirty: about to be written)."""
        if self.ess_tier is not None:
            self.ess_tier.ensure(self.ess_tier.pages(layer, loc), dirty)

    def _check_read(self, layer: int, loc: torch.Tensor, reader: torch.Tensor) -> None:
        """With a disk tier: the request-table rows `reader` (broadcast over loc) read these locations on `layer`."""
        if self.ess_tier is not None:
            self.ess_tier.check_read(layer, loc, reader)

    def _rewritten(self, layer: int, loc: torch.Tensor, lost=None, note: str = "") -> None:
        if self.ess_tier is not None:
            self.ess_tier.rewritten(layer, loc, lost, note)

    def get_kv_size_bytes(self):
        """Device bytes, measured from the tensors (SGLang logs and reports this as the KV cache size): the pool's,
        and once the plugin set it, its runtime's; the host pool is reported by the runtime."""
        return device_bytes.measured(self, getattr(self, "ess_runtime", None))

    # -- prefill staging ------------------------------------------------------------------------------------------
    def stage_extend(self, token_table: torch.Tensor, req: torch.Tensor, seq_lens_cpu: list[int], prefix_lens_cpu: list[int]) -> None:
        """Plan an extend batch: staging rows for every token of its requests (positions [0, seq_len) of each, in
        batch order, from FIRST_ROW). Called once per forward, before layer 0; lengths come from the host, so nothing
        syncs."""
        n = int(sum(seq_lens_cpu))
        self._stage_room(n)
        locs, pos, owner = batch_tokens(token_table, req, seq_lens_cpu)
        self.ess_stage_of_loc.fill_(-1)
        self.ess_stage_of_loc[locs] = torch.arange(FIRST_ROW, FIRST_ROW + n, dtype=torch.int32, device=locs.device)
        self._stage_locs = locs
        self._stage_pos = torch.cat([torch.full((FIRST_ROW,), -1, dtype=pos.dtype, device=pos.device), pos])
        self._stage_req = torch.cat([torch.full((FIRST_ROW,), -1, dtype=owner.dtype, device=pos.device), owner])
        self._stage_cached = None
        if any(p > 0 for p in prefix_lens_cpu):  # only the cached prefix comes from the host; the layer writes the rest
            cached_locs, cached_pos, readers = batch_tokens(token_table, req, prefix_lens_cpu)
            seq = torch.tensor(seq_lens_cpu, device=locs.device)
            starts = FIRST_ROW + torch.cumsum(seq, 0) - seq  # each request's first staging row
            lens = torch.tensor(prefix_lens_cpu, device=locs.device)
            rows = torch.repeat_interleave(starts, lens, output_size=cached_locs.shape[0]) + cached_pos
            self._stage_cached = (cached_locs, rows, readers)
        self._staged_layers = set()

    def _stage_room(self, n: int) -> None:
        """Staging rows for n tokens after the writer's reserved row 0: the buffer grows when a batch needs more than
        any before (sizing charges the rows SGLang's admission lets a batch take)."""
        if FIRST_ROW + n > self.ess_stage.shape[0]:
            self.ess_stage = torch.zeros(whole_pages(FIRST_ROW + n), 1, layout.LATENT_ROW_BYTES, dtype=torch.uint8,
                                         device=self.device)

    def stage_selected(self, token_table: torch.Tensor, req: torch.Tensor, seq_lens: torch.Tensor, layer: int,
                       top_k: torch.Tensor, fused: bool) -> None:
        """A decode step that SGLang relabelled as one-token extends (DP attention), one layer: staging rows for the
        rows its top-k selects (top_k [B, K] positions, or token locations when fused), gathered from the host, and for
        each request's own new row, which the layer writes. At most B x (top-k + 1) rows, instead of every token of
        the requests (a host sync: these forwards run eager)."""
        own = token_table[req.long(), (seq_lens.long() - 1).clamp(min=0)].long()
        locs = top_k.long() if fused else torch.where(
            top_k >= 0, token_table[req.long().unsqueeze(1), top_k.long().clamp(min=0)].long(), -1)
        mine = torch.isin(locs, own)  # the own rows: this layer writes them, nothing reads them from the host
        selected = torch.unique(locs[(locs >= 0) & ~mine])
        need = torch.cat([selected, own])
        n = need.shape[0]
        self._stage_room(n)
        self.ess_stage_of_loc.fill_(-1)
        self.ess_stage_of_loc[need] = torch.arange(FIRST_ROW, FIRST_ROW + n, dtype=torch.int32, device=need.device)
        self._stage_locs = None  # nothing more to stage for this layer
        rows = torch.arange(FIRST_ROW, FIRST_ROW + selected.shape[0], device=need.device)
        self._pages_in(layer, selected)
        if self.ess_tier is not None:
            self.ess_tier.check_read(layer, torch.where(mine, -1, locs), req.unsqueeze(1))
        flashtrans.gather(self.ess_host[layer], self._host_rows(layer, selected), self.ess_stage[:, 0], rows, self.backend)

    def _stage_layer(self, layer: int) -> None:
        """Bring the staged batch's cached rows of one layer from the host (once per layer and forward)."""
        if layer in self._staged_layers or self._stage_locs is None:
            return
        self._staged_layers.add(layer)
        if self._stage_cached is not None:
            locs, rows, readers = self._stage_cached
            self._pages_in(layer, locs)
            self._check_read(layer, locs, readers)
            flashtrans.gather(self.ess_host[layer], self._host_rows(layer, locs), self.ess_stage[:, 0], rows, self.backend)

    def translate_loc_to_hisparse_device(self, locs: torch.Tensor) -> torch.Tensor:
        """Token locations -> staging rows (-1 and padding stay -1). The DSA backend calls this on its prefill page
        table when a sparse-offload coordinator is set."""
        rows = self.ess_stage_of_loc[locs.long().clamp(min=0)]
        return torch.where(locs >= 0, rows, torch.full_like(rows, -1))

    def stage_positions(self, locs: torch.Tensor) -> torch.Tensor:
        """Token locations of the staged batch (SGLang's fused prefill top-k) -> positions within their requests
        (int64; -1 stays -1)."""
        rows = self.translate_loc_to_hisparse_device(locs).long()
        return torch.where(rows >= 0, self._stage_pos[rows.clamp(min=0)], -1)

    # -- SGLang's pool interface ------------------------------------------------------------------------------------
    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        local = layer_id - self.start_layer
        n = loc.shape[0]
        rt = self.ess_runtime
        if self.ess_phase != EXTEND and rt is not None and rt.resident_forward:
            # the resident path: the new rows straight into their regions (SGLang's quantiser writing there), no backup
            # (host copies once: EssRuntime.flush)
            self._write_mla_kv_buffer(rt.latent_buffer(layer_id), rt.own_region_rows(layer_id, n), cache_k_nope,
                                      cache_k_rope)
            return
        if self.ess_phase == EXTEND:
            self._stage_layer(local)
            buf, rows = self.ess_stage, self.ess_stage_of_loc[loc.long()].long()
        else:
            if n > self.scratch_rows:
                raise RuntimeError(f"ESS decode scratch holds {self.scratch_rows} rows, the step wrote {n}")
            buf, rows = self.ess_scratch, self.ess_scratch_idx[:n]
        self._write_mla_kv_buffer(buf, rows, cache_k_nope, cache_k_rope)  # SGLang's FP8 quantiser
        if self.ess_phase == EXTEND and self.ess_runtime is not None and self._stage_locs is not None:
            # residency first: the staged requests' rows (cached prefix and new alike) into resident regions
            n_staged = self._stage_pos.shape[0]
            self.ess_runtime.fill_resident(layer_id, self.ess_stage[:n_staged, 0], self._stage_req, self._stage_pos)
        self._pages_in(local, loc, dirty=True)
        self._rewritten(local, loc)
        flashtrans.scatter(buf[:, 0], rows, self.ess_host[local], self._host_rows(local, loc), self.backend)  # D2H backup
        if self.ess_phase != EXTEND and self.ess_runtime is not None:
            self.ess_runtime.keep_own_rows(layer_id, buf[FIRST_ROW:FIRST_ROW + n, 0])  # a view: read before the next
            # layer writes

    def get_key_buffer(self, layer_id: int):
        if self.ess_phase == EXTEND:
            self._stage_layer(layer_id - self.start_layer)
            buf = self.ess_stage
        else:
            buf = self.ess_runtime.latent_buffer(layer_id)
        return buf.view(self.dtype)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        raise NotImplementedError("--enable-ess: dense MHA prefill reads the latent cache by location; it is off with ESS")

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        """Move latent rows (host) and index-K (device) together. The host rows of every layer go through device
        memory, gathered then scattered back by FlashTrans on the current stream: ordered after the GPU work that
        writes host rows (the new rows' D2H), which a CPU copy was not, and every source is read before any target
        is written, as SGLang's own move reads before it writes."""
        if tgt_loc.numel() == 0:
            return
        t, s = tgt_loc.reshape(-1).long().to(self.device), src_loc.reshape(-1).long().to(self.device)
        if self.ess_tier is None:
            layers, rows = self.ess_host.shape[:2]
            base = torch.arange(layers, device=self.device).unsqueeze(1) * rows
            src, dst = (base + s).flatten(), (base + t).flatten()
            flat = self.ess_host.view(-1, layout.LATENT_ROW_BYTES)
            self._move_rows(flat, src, flat, dst)
        else:  # layer by layer, each layer's source and target pages in frames
            for layer in range(self.layer_num):
                tier = self.ess_tier
                tier.ensure(np.union1d(tier.pages(layer, s), tier.pages(layer, t)))
                tier.ensure(tier.pages(layer, t), dirty=True)
                self._move_rows(self.ess_host[layer], tier.rows(layer, s), self.ess_host[layer], tier.rows(layer, t))
                tier.rewritten(layer, t, *tier.lost_state(layer, s))  # a lost row stays lost where it goes
        self.index_key_cache.move(tgt_loc, src_loc)

    def _move_rows(self, src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        moving = torch.empty(src_rows.shape[0], layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=self.device)
        order = torch.arange(moving.shape[0], device=self.device)
        flashtrans.gather(src, src_rows, moving, order, self.backend)
        flashtrans.scatter(moving, order, dst, dst_rows, self.backend)

    def _frame_rows(self, layer: int, idx: torch.Tensor, dirty: bool = False) -> torch.Tensor:
        """The disk tier's frame rows (a host tensor) of locations idx on `layer`, their pages in frames first."""
        self._pages_in(layer, idx, dirty)
        return self.ess_tier.rows(layer, idx.to(self.device)).cpu()

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """A PD decode node's retraction backup of a request's rows (their locations `indices`, positions from 0): a
        resident request's rows that its region alone holds go to the host pool first."""
        if self.ess_runtime is not None and req_pool_index is not None:
            rt = self.ess_runtime
            if rt.flush(int(req_pool_index), indices.numel()):
                rt.streams.host_wait(rt.streams.recorded())  # the copy below reads the host pool on the host
        idx = indices.long()
        if self.ess_tier is None:
            kv = self.ess_host[:, idx.cpu()].clone()
        else:  # with the rows' lost state (a failed checksum), which load_cpu_copy restores
            kv = torch.stack([self.ess_host[i][self._frame_rows(i, idx)] for i in range(self.layer_num)])
            lost = [self.ess_tier.lost_state(i, idx) for i in range(self.layer_num)]
            if any(mask is not None and mask.any() for mask, _ in lost):
                return {"kv": kv, "index_k": self.index_key_cache.cpu_copy(indices), "ess_lost": lost}
        return {"kv": kv, "index_k": self.index_key_cache.cpu_copy(indices)}

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        """Rows back from get_cpu_copy: SGLang restoring a retracted PD request's backup (cpu_tensor) into its new
        request row, whose first len(indices) positions have then landed (EssRuntime.kv_landed)."""
        idx = indices.long()
        if self.ess_tier is None:
            self.ess_host[:, idx.cpu()] = kv_cache_cpu["kv"]
        else:
            lost = kv_cache_cpu.get("ess_lost") or [(None, "")] * self.layer_num
            for i in range(self.layer_num):
                self.ess_host[i][self._frame_rows(i, idx, dirty=True)] = kv_cache_cpu["kv"][i]
                self._rewritten(i, idx, *lost[i])
        self.index_key_cache.load_cpu_copy(kv_cache_cpu["index_k"], indices)
        if self.ess_runtime is not None and req_pool_index is not None:
            self.ess_runtime.kv_landed(int(req_pool_index), idx.numel())


def pool_class(scratch_rows: int, stage_rows: int, backend: str = "auto", tier: DiskTierSpec | None = None) -> type:
    """The pool class for one launch (SGLang constructs the pool itself, with its own arguments)."""
    return type(
        "EssDSATokenToKVPool",
        (EssDSATokenToKVPool,),
        {"__module__": __name__, "scratch_rows": max(1, scratch_rows), "stage_rows": max(1, stage_rows), "backend": backend,
         "tier_spec": tier},
    )

