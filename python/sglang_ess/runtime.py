"""EssRuntime: one per model runner (GPU rank), the object SGLang's hooks and its DSA backend talk to. It owns the ESS
latent cache in SGLang's coordinates (request-pool slots, token-pool locations; see ess.core.serving) and answers the
backend's sparse-offload call, the same call SGLang's HiSparse answers: swap_in_selected_pages(req_pool_indices,
seq_lens, top_k, layer_id) -> indices of the selected rows in the device latent buffer, which FlashMLA's sparse
decode then reads.

Here: the path of a forward, the LRU step of a layer (padding rows and stale entries masked, a progressive PD decode's
wait for landed rows, the disk tier's page-in, the step counted and recorded) and the order of a forward (admissions
first, the counters and the trace after). A forward takes one of two paths, chosen from what the host knows after the
admissions (docs/plugin.md, "Two paths"): with no offloaded request live, the resident path (stock's step over the
regions: each entry start + position, each new row written straight into its region, no LRU step, no fetch, no
counters, no D2H backup: a resident request's rows go to the host pool once, when they must, `flush`); else the
general path. Under CUDA graphs each batch size has a graph of each path (sglang_ess.hooks.graphs). Its parts, one
concern each:
    sglang_ess.overlap_steps        DA / DBA: the step started at the indexer, and the split FlashMLA call
    sglang_ess.prefill_warmup       LRU-Warmup from a prefill forward's top-k
    sglang_ess.residency_admission  residency first: regions for the request slots given since the last forward
    sglang_ess.kv_arrivals          KV landed without a prefill forward, and PD warm-up states
    sglang_ess.readout              the step counters and the state readout
"""

from __future__ import annotations

import logging

import torch

from ess.core.policy import PolicyResult
from ess.core.serving import ServingLatentCache
from ess.core.streams import Streams
from sglang_ess import readout
from sglang_ess.args import EssArgs, EssFacts
from sglang_ess.kv_arrivals import KvArrivals
from sglang_ess.overlap_steps import OverlapSteps
from sglang_ess.prefill_warmup import PrefillWarmup
from sglang_ess.recorder import StepRing, TraceRecorder, lookahead
from sglang_ess.residency_admission import PADDING_SLOT, ResidencyAdmission

logger = logging.getLogger("sglang_ess")


def layer_modes(ess: EssArgs, num_layers: int, plan: list[str] | None) -> list[str]:
    """The overlap mode of each layer: the plan's (auto with a plan), the flag's, or DA (auto without a plan)."""
    if plan is not None:
        return list(plan[:num_layers])
    mode = "da" if ess.overlap == "auto" else ess.overlap
    return [mode] * num_layers


def request_slot(req) -> int | None:
    """A Req's row of SGLang's request table: 0.5.23 keeps it in the Req's KV record (`req.kv`), no longer on the Req."""
    return req.kv.req_pool_idx


class EssRuntime:
    def __init__(
        self,
        ess: EssArgs,
        facts: EssFacts,
        token_table: torch.Tensor,
        host: torch.Tensor,
        device: torch.device | str,
        start_layer: int = 0,
        model: str = "",
        backend: str = "auto",
        kernel: str = "auto",
        tier=None,
    ):
        """token_table: SGLang's req_to_token [request slots, max context] (int32 locations); host: the ESS KV pool's
        host pool [layers, locations + 1, 656], or with --ess-disk-dir its disk tier's frames (tier: the
        ess.core.disk_tier.PagedHostTier over token locations); facts: from sglang_ess.validate.validate_model."""
        self.ess = ess
        self.start_layer = start_layer
        self.num_layers = facts.layers
        self.token_table = token_table
        # residency first: the same GPU rows (a request slot's C slots each) as one pool of regions
        rows = token_table.shape[0] * facts.buffer if facts.residency else None
        self.cache = ServingLatentCache(
            self.num_layers, token_table.shape[0], facts.buffer, token_table.shape[1], host, device, backend, kernel, tier,
            device_rows=rows,
        )
        self.cache.fixed_path = facts.fixed_step
        self.relabelled_decodes = facts.relabelled_decodes
        self.query_rows = facts.query_rows
        self.req_pool = None  # SGLang's request pool whose rows this runtime serves (set by the plugin)
        self.streams = Streams(device)
        self.modes = layer_modes(ess, self.num_layers, facts.plan)
        self.recorder = TraceRecorder(ess.record_trace, self.num_layers, model, facts.topk) if ess.record_trace else None
        # one forward's decode rows: every layer of every request slot
        self.ring = (StepRing(self.num_layers * token_table.shape[0], facts.topk, device, ess.record_lookahead)
                     if self.recorder else None)
        # with --ess-record-lookahead: the next-ranked positions of each indexer call (sglang_ess.hooks.forward), first
        # in first out: every call's step takes the oldest (TBO's micro-batches run their indexers and steps in the same
        # order)
        self.next_ranked: list[torch.Tensor] = []
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)  # read by SGLang's graph runners
        self._own_rows: list[torch.Tensor | None] = [None] * self.num_layers
        # the path of the forward in flight (set by start_forward, or by a CUDA graph's capture), and the decode/verify
        # forwards each path took (host counts: a graph's replay is counted when chosen)
        self.resident_forward = False
        self.paths = {"resident": 0, "general": 0}
        self.graphs_captured: dict[str, int] = {}  # decode CUDA graphs captured per path (sglang_ess.hooks.graphs)
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None  # the decode call's (request slots, positions)
        self._own_region: dict[int, torch.Tensor] = {}  # req tensor's data_ptr -> its new rows' region rows
        self._flushed = None  # an event after the last flush outside a forward (GPU), waited for by the next forward
        self.progressive = None  # a PD decode node's --ess-progressive-pd (sglang_ess.pd.landing.ProgressiveDecode)
        self.released = 0  # requests let go (finished or aborted), a host count
        self.step_counters = readout.StepCounters(token_table.shape[0], device)
        self.overlap = OverlapSteps(self.cache, token_table, self.streams, self.modes, ess.da_attn1, self._step)
        self.warmup = PrefillWarmup(self.cache, token_table, ess.warmup_windows)
        self.residency = ResidencyAdmission(self.cache, token_table)
        self.arrivals = KvArrivals(self.cache, token_table, self.num_layers)
        # Request rows to reset, from the scheduler (its request lifecycle), applied at the start of the next forward
        # (`apply_admissions`), in the forward's stream order: a forward still in flight under SGLang's overlap
        # scheduler may hold a finished request's row, and its LRU step would otherwise write that row after the
        # scheduler reset it for a new request.
        self._resets: list[int] = []

    # -- a forward -----------------------------------------------------------------------------------------------------
    def start_forward(self, decode: bool = True) -> None:
        """A forward of the target model begins: overlap steps never taken are dropped, the admissions since the last
        forward applied, the forward's path chosen (decode: a decode or verify forward, counted); the trace ring and
        the tally start empty."""
        self.overlap.drop_unconsumed()
        self.streams.wait(self._flushed)
        self._flushed = None
        self.apply_admissions()
        self.resident_forward = self.resident_path_ok()
        self._own_region.clear()  # a forward's own (under CUDA graphs, each graph computes and reads its own)
        if decode:
            self.paths["resident" if self.resident_forward else "general"] += 1
        if self.ring is not None:
            self.ring.reset()
        self.next_ranked.clear()
        self.step_counters.start_forward()

    def end_forward(self) -> None:
        """After a forward, outside any graph: the forward's tally into the counters (device ops), then the recorded
        rows go to the trace recorder (SGLang's padding rows, request slot 0, are left out)."""
        self.step_counters.end_forward()
        if self.ring is None:
            return
        for layer, req, topk, own in self.ring.drain():
            real = req != PADDING_SLOT
            if real.any():
                self.recorder.record(layer, req[real], topk[real], own[real])

    def resident_path_ok(self) -> bool:
        """The resident path serves the next forward: regions exist and no offloaded request is live (host-known), no
        disk tier (whose host rows are paged: every new row is backed up), no DP attention (a relabelled decode reads
        the host pool), no trace being recorded (the LRU step is what it records), and the host knows how far each
        resident request's rows reach (its flush)."""
        return (self.cache.regions is not None and not self.cache.offloaded and self.cache.tier is None
                and not self.relabelled_decodes and self.recorder is None and self.residency.tracks_all())

    @staticmethod
    def _masked(req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """own [B] or [B, S] (padding rows -1) and sets [B, S*K] with entries past the request's newest own position
        set to -1 (stale or padded top-k; SGLang's HiSparse had the same hole, its issue 32771: they would translate to
        another token's slot or index past the tables). Device ops."""
        own = own.long().reshape(req.shape[0], S) if S > 1 else own.long()  # [B], or [B, S]
        real = req != PADDING_SLOT  # padding rows get no own token, and so (below) no set: they touch only sinks
        own = torch.where(real.unsqueeze(1) if own.dim() == 2 else real, own, -1)
        newest = own if own.dim() == 1 else own.max(dim=1).values
        return torch.where(sets > newest.unsqueeze(1), -1, sets), own

    def _resident_step(self, layer: int, req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor,
                       S: int) -> torch.Tensor:
        """The resident path's step of one layer: every entry start + position (ServingLatentCache.resident_result);
        the new rows are in their regions already (own_region_rows). Returns the slots [B, S*K]."""
        sets, own = self._masked(req, sets, own, S)
        if self.progressive is not None:  # a request still landing: the rows this step reads have landed
            self.progressive.wait(layer, req, sets)
        return self.cache.resident_result(req, sets, own).attn_slot

    def _step(self, layer: int, req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor, S: int, serial: bool = False,
              own_rows: torch.Tensor | None = None) -> PolicyResult:
        """The LRU step of one layer for a (micro-)batch: sets [B, S*K] positions, own [B*S] the own positions of S
        query rows per request. Rows of request slot 0 are CUDA-graph padding (SGLang's padding row, never a
        request's): they take no LRU step. serial: the whole NONE order (ServingLatentCache.translate: step, H2D of
        the misses, own rows); else the step alone."""
        if layer == 0:
            self.cache.next_step()
        sets, own = self._masked(req, sets, own, S)
        if self.progressive is not None:  # --ess-progressive-pd: the rows this step reads have landed (a host wait)
            self.progressive.wait(layer, req, sets)
        if self.cache.tier is not None:
            # --ess-disk-dir: the pages of the misses into host frames, waited for (exposed; host work, so eager mode
            # only); then, in the background, changed pages no step of this call used are written out and the pages
            # the next layer selected at its last step are read ahead (docs/plugin.md, "Disk tier")
            self.cache.page_in(layer, req, self.token_table, sets, own)
            self.cache.read_ahead(layer)
        if serial:
            r = self.cache.translate(layer, req, self.token_table, sets, own, own_rows)
        else:
            r = self.cache.update(layer, req, sets, own, self.token_table)
        self.step_counters.count(r)
        ext = self.next_ranked.pop(0) if self.next_ranked else None
        if self.ring is not None and own.dim() == 1:  # verify steps hold several positions: not a trace step
            self.ring.append(layer, req, sets, own, ext)
        return r

    # -- the decode step's calls: the pool's write, the indexer, the backend -------------------------------------------
    def set_batch(self, req_pool_indices: torch.Tensor, positions: torch.Tensor) -> None:
        """The decode / verify call's request slots [B] and positions [B * S] (the backend's forward batch, before its
        pool write)."""
        self._batch = (req_pool_indices, positions)

    def own_region_rows(self, layer_id: int, n: int) -> torch.Tensor:
        """The resident path: the region rows [n] of this call's n new rows (S = n / B per request), where the pool
        writes them. Computed at the first layer of each (micro-)batch, then reused by its other layers (graph-safe:
        the same tensors in a capture)."""
        req, pos = self._batch
        key = req.data_ptr()
        if layer_id == self.start_layer or key not in self._own_region:
            S = n // max(1, req.shape[0])
            slots = req.repeat_interleave(S) if S > 1 else req
            self._own_region[key] = self.cache.region_rows(slots, pos.reshape(-1)[:n])
        return self._own_region[key]

    def keep_own_rows(self, layer_id: int, rows: torch.Tensor) -> None:
        """This decode/verify step's new rows [B(*S), 656] (the ESS KV pool wrote them to the host pool already),
        which swap_in_selected_pages puts into their GPU slots."""
        self._own_rows[layer_id - self.start_layer] = rows

    def keep_next_ranked(self, logits: torch.Tensor, lengths: torch.Tensor, topk: torch.Tensor) -> None:
        """--ess-record-lookahead: an indexer call's next-ranked positions (sglang_ess.recorder.lookahead), kept for
        the step of this indexer call."""
        self.next_ranked.append(lookahead(logits, lengths, topk, self.ess.record_lookahead))

    def begin(self, layer_id: int, req_pool_indices: torch.Tensor, positions: torch.Tensor,
              top_k: torch.Tensor) -> bool:
        """Right after a layer's indexer (top_k [B*S, K] positions for the query rows at positions [B*S]): a DA / DBA
        layer's step and its H2D start here (OverlapSteps.begin). Returns whether they did (never on the resident
        path: nothing to fetch)."""
        if self.resident_forward:
            return False
        return self.overlap.begin(layer_id - self.start_layer, req_pool_indices, positions, top_k)

    def swap_in_selected_pages(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """top_k: positions [B, K] (decode), or [B, S, K] with seq_lens [B * S] (MTP target-verify: S query rows per
        request, whose union is one LRU step with S own tokens). Returns int32 slots of the same shape, -1 kept."""
        layer = layer_id - self.start_layer
        B = req_pool_indices.shape[0]
        if B == 0:  # an empty batch: nothing to translate
            return torch.full(top_k.shape, -1, dtype=torch.int32, device=top_k.device)
        S = top_k.shape[1] if top_k.dim() == 3 else 1
        if self.resident_forward:
            return self._resident_step(layer, req_pool_indices, top_k.reshape(B, -1), seq_lens - 1, S).reshape(
                top_k.shape)
        own_rows, self._own_rows[layer] = self._own_rows[layer], None
        slots = self.overlap.take(layer, req_pool_indices, S, own_rows)  # a step started at the indexer
        if slots is None:  # mode none (or no indexer call seen): the whole step here, in the serial order
            r = self._step(layer, req_pool_indices, top_k.reshape(B, -1), seq_lens - 1, S, serial=True,
                           own_rows=own_rows)
            slots = r.attn_slot
        return slots.reshape(top_k.shape).to(torch.int32)

    @property
    def split_pending(self) -> bool:
        """A DA split step waits for its FlashMLA call (OverlapSteps.split_attention)."""
        return self.overlap.split_pending

    def split_attention(self, attn0, q: torch.Tensor, scale: float | None):
        """The FlashMLA call of a split DA step: Attn0 (attn0()), Attn1 over the misses, merged (OverlapSteps)."""
        return self.overlap.split_attention(attn0, q, scale)

    def check_split_taken(self) -> None:
        """After the backend's decode call: a split its FlashMLA call never took raises (OverlapSteps)."""
        self.overlap.check_split_taken()

    def latent_buffer(self, layer_id: int) -> torch.Tensor:
        """The device latent rows that swap_in_selected_pages' indices address: [slots, 1, 656] uint8."""
        return self.cache.gpu[layer_id - self.start_layer].unsqueeze(1)

    def wait_for_pending_backup(self) -> None:
        """Part of the backend-facing contract; ESS's host writes are ordered on the compute stream."""

    # -- prefill -------------------------------------------------------------------------------------------------------
    def plan_prefill(self, req: torch.Tensor, extend_lens: list[int]) -> None:
        """Before layer 0 of a prefill forward: its requests' LRU-Warmup windows (PrefillWarmup.plan)."""
        self.warmup.plan(req, extend_lens)

    def warm_from_prefill(self, layer_id: int, top_k: torch.Tensor, to_positions=None, token_range=None) -> None:
        """After a layer's prefill attention: LRU-Warmup from its top-k (PrefillWarmup.warm)."""
        self.warmup.warm(layer_id - self.start_layer, top_k, to_positions, token_range)

    def fill_resident(self, layer_id: int, rows: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> None:
        """A prefill layer's rows (staging rows [N, 656] of request slots req and positions pos) into the regions of
        resident requests."""
        self.cache.fill_resident(layer_id - self.start_layer, rows, req, pos)

    # -- request lifecycle (scheduler side), applied at the next forward -----------------------------------------------
    def plan_positions(self, req_slot: int, positions: int, req=None) -> None:
        """Request slot req_slot went to a request (SGLang's Req) that can reach `positions` positions
        (ResidencyAdmission.plan)."""
        self.residency.plan(req_slot, positions, req)

    def reset_rows(self, rows: list[int]) -> None:
        """Request-table rows handed to new requests: at the next forward they start with empty tables."""
        self._resets.extend(rows)
        for r in rows:
            self.arrivals.forget(r)  # what arrived for the row's previous request does not carry over
            if self.cache.tier is not None:  # nor a lost row that request read (hooks.forward.after_run_batch)
                self.cache.tier.lost_reads.pop(r, None)

    def kv_landed(self, req_slot: int, length: int) -> None:
        """With residency, a request's KV landed in the host pool without a prefill forward (KvArrivals.kv_landed)."""
        self.arrivals.kv_landed(req_slot, length)

    def admit_transferred(self, req_slot: int, entries: torch.Tensor, positions: int | None = None) -> None:
        """PD decode: a request's warm-up state from its prefill node (KvArrivals.admit_transferred; raises
        WarmupRefused)."""
        self.arrivals.admit_transferred(req_slot, entries, positions)

    def abandon_transfer(self, req_slot: int) -> None:
        """PD decode: a request whose transfer is refused (its metadata malformed) leaves nothing to load."""
        self.arrivals.forget(req_slot)

    def apply_admissions(self) -> None:
        """At the start of a forward (on its stream): the rows reset since the last forward, their regions, then what
        arrived for them."""
        resets, self._resets = self._resets, []  # taken whole, with the arrivals: the scheduler may add more meanwhile
        arrived = self.arrivals.take()
        if resets:
            self.cache.release(torch.tensor(resets, dtype=torch.int64, device=self.cache.gpu.device), resets)
        if self.cache.regions is not None:
            self.residency.admit(resets)
        self.arrivals.apply(*arrived)

    def flush(self, req_slot: int, upto: int | None = None) -> int:
        """Host copies once, outside a forward: a resident request's rows that only its region holds to the host pool
        (ResidencyAdmission.flush; upto: positions [0, upto) at most), before SGLang's radix cache or a PD backup reads
        them. The next forward waits for the copy. Returns the rows copied per layer."""
        n = self.residency.flush(req_slot, upto)
        if n:
            self._flushed = self.streams.recorded()
        return n

    def release(self, req_slot: int, rid: str = "", keep_upto: int | None = None) -> str | None:
        """A request finished or was aborted: its GPU rows are forgotten at the next forward (reset_rows; its tokens go
        back through SGLang's allocator); keep_upto: SGLang keeps its positions [0, keep_upto) (the radix cache), so
        a resident request's rows go to the host pool first. Returns the trace file written for it, if recording."""
        if self.progressive is not None:  # a request still landing comes here once its transfer ended (the hook holds it)
            self.progressive.release(req_slot)
        if keep_upto:
            self.flush(req_slot, keep_upto)
        self.reset_rows([req_slot])
        self.residency.release(req_slot)
        self.released += 1
        if self.recorder is None:
            return None
        try:
            return self.recorder.finish(req_slot, rid)
        except OSError as e:  # the folder went away or became read-only: the server serves on without this trace
            logger.error("ESS trace of request %r not written (--ess-record-trace %s): %s", rid, self.recorder.directory, e)
            return None

    # -- readout -------------------------------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """The step counters of the forwards that ended, and the requests released, as host ints: a device sync."""
        return self.step_counters.read() | {"released_requests": self.released,
                                            "resident_forwards": self.paths["resident"],
                                            "general_forwards": self.paths["general"]}

    def stats(self) -> dict:
        """The runtime's state for the readout (sglang_ess.readout.state)."""
        return readout.state(self)

    @property
    def split_ok(self) -> bool:
        """Set by the plugin around a decode call of a backend that attends through FlashMLA."""
        return self.overlap.split_ok

    @split_ok.setter
    def split_ok(self, value: bool) -> None:
        self.overlap.split_ok = value
