"""EssRuntime: one per model runner (GPU rank). It owns the ESS latent cache in SGLang's coordinates (request-pool
slots, token-pool locations; see ess.core.serving) and answers the DSA backend's sparse-offload call, the same call
SGLang's HiSparse answers: swap_in_selected_pages(req_pool_indices, seq_lens, top_k, layer_id) -> indices of the
selected rows in the device latent buffer, which FlashMLA's sparse decode then reads.

Overlap (docs/design.md, Overlap), per layer from the plan or --ess-overlap:
    none      the attention call does everything: LRU step, H2D of the misses, own rows into their slots.
    da / dba  `begin`, called by the plugin right after the layer's indexer, runs the LRU step and starts the H2D of
              the misses on the copy stream; the rest of forward_absorb_prepare (q_b_proj under graph capture,
              w_kc bmm, rotary) and the KV write run meanwhile; the attention call then puts the own rows in place
              and waits for the copy. With --enable-two-batch-overlap each micro-batch's H2D also runs under the other
              micro-batch's work between op_prepare and op_core (its indexer included): that is DBA's schedule, so
              the launch checks accept dba only with TBO (a plan's dba layers run as da without it).
              Attention in a DA / DBA decode step (one query row per request) through FlashMLA's decode (SGLang's
              flashmla_kv backend) is split (docs/plugin.md, "Overlap"): the backend's FlashMLA call reads the
              top-k with the misses set to -1 (Attn0: hits and own rows, without waiting for the copy), then
              `split_attention` waits for the copy, attends to the misses with ess.core.miss_attention's kernel over
              the LRU step's compacted miss lists, and merges the two by log-sum-exp. With attn1 "fused" the copy
              itself is the miss kernel's (the H2D and Attn1 in one kernel on the copy stream beside Attn0; it needs
              the query, so it starts at the attention call, not at the indexer). With "calls", and in MTP verify,
              one FlashMLA call reads every entry after the copy (the plugin never makes a second full-width call).
              --ess-da-attn1 chooses (default "calls": the split has not been timed on a GPU yet, and its bf16 parts
              round differently from one call).
LRU-Warmup: a prefill forward's last W query rows per request give its warm-up sets (`plan_prefill`,
`warm_from_prefill`), so decode starts with the rows prefill attended to last. On a PD decode node the prefill node
sends the state those sets leave (`admit_transferred`, sglang_ess.pd.warmup).
"""

from __future__ import annotations

import logging
import math

import torch

from ess.core import miss_attention
from ess.core.disk_tier import DISK_PAGE
from ess.core.policy import PolicyResult
from ess.core.serving import ServingLatentCache
from ess.core.streams import Streams
from sglang_ess.args import EssArgs
from sglang_ess.pd import warmup as pd_warmup
from sglang_ess.recorder import StepRing, TraceRecorder
from sglang_ess.validate import EssFacts
from sglang_ess.warmup_plan import WarmupPlan

OVERLAP_EARLY = ("da", "dba")  # modes whose H2D starts at the indexer
PADDING_SLOT = 0  # SGLang's request tables keep row 0 for CUDA-graph padding; requests get rows from 1
# Counters of the decode and verify steps, kept on the device (no sync in a step) and read by the scheduler's state
# readout (/get_server_info): LRU steps (a layer of a batch), rows selected and rows missed in them, forwards with such
# steps, and those of them without a single miss.
COUNTERS = ("layer_steps", "selected_rows", "missed_rows", "forwards", "forwards_without_misses")

logger = logging.getLogger("sglang_ess")


class WarmupRefused(ValueError):
    """PD warm-up entries that cannot be loaded for their request; `reason` says why."""

    def __init__(self, req_slot: int, reason: str):
        super().__init__(f"PD warm-up entries of request slot {req_slot}: {reason}")
        self.reason = reason


def layer_modes(ess: EssArgs, num_layers: int, plan: list[str] | None) -> list[str]:
    """The overlap mode of each layer: the plan's (auto with a plan), the flag's, or DA (auto without a plan)."""
    if plan is not None:
        return list(plan[:num_layers])
    mode = "da" if ess.overlap == "auto" else ess.overlap
    return [mode] * num_layers


def request_slot(req) -> int | None:
    """A Req's row of SGLang's request table: 0.5.23 keeps it in the Req's KV record (`req.kv`), no longer on the Req."""
    return req.kv.req_pool_idx


def _per_request(x: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """Per query row values [B*S] as the LRU step takes own positions: [B], or [B, S] with S rows per request."""
    return x.long().reshape(B, S) if S > 1 else x.long()


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
        self.query_rows = facts.query_rows
        self.req_pool = None  # SGLang's request pool whose rows this runtime serves (set by the plugin)
        self._positions: dict[int, int] = {}  # request slot -> the positions its request can reach (residency)
        self._finished: set[int] = set()  # request slots let go since the last forward
        self._reach: dict[int, int] = {}  # request slot -> its resident region's rows (a multiple of C)
        self._landed: dict[int, int] = {}  # PD decode: request slot -> positions whose KV landed in the host pool
        self.demoted = self.promoted = 0  # residency: requests that crossed the wall, each way (host counts)
        self.warm_loaded = self.filled_from_host = 0  # PD decode: warm-up states loaded, resident regions filled
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
        # (layer, request-index tensor address, batch) -> (the LRU step, its H2D's done event or None when the fused
        # miss kernel is to copy, the request indices), from `begin` to the attention call of the same (micro-)batch;
        # the address tells TBO's two micro-batches apart
        self._pending: dict[tuple[int, int, int], tuple[PolicyResult, object, torch.Tensor]] = {}
        # DA's Attn1 (--ess-da-attn1): "miss" / "fused" split the attention, "calls" keeps one call
        self.attn1 = ess.da_attn1
        self.split_ok = False  # set by the plugin around a decode call of a backend that attends through FlashMLA
        self._split = None  # (layer, request indices, the LRU step, its H2D's event) from swap_in to the FlashMLA call
        self._warm: WarmupPlan | None = None  # the prefill forward's warm-up windows
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        # this forward's tally, per step row: [0, 0] += 1 a step, [1] += its sets, [2] += its misses (two kernels a step,
        # summed into the counters once a forward, outside any graph: end_forward)
        self._tally = torch.zeros(3, max(1, token_table.shape[0]), dtype=torch.int32, device=device)
        self._first = {}  # B -> [B] int32 (1, 0, 0, ...): a step's count in the tally
        self.released = 0  # requests let go (finished or aborted), a host count
        self.progressive = None  # a PD decode node's --ess-progressive-pd (sglang_ess.pd.landing.ProgressiveDecode)
        # Request rows to reset and PD warm-up states to load, from the scheduler (its request lifecycle), applied at
        # the start of the next forward (`apply_admissions`), in the forward's stream order: a forward still in flight
        # under SGLang's overlap scheduler may hold a finished request's row, and its LRU step would otherwise write
        # that row after the scheduler reset it for a new request.
        self._resets: list[int] = []
        self._loads: dict[int, torch.Tensor] = {}

    # -- the step's own rows (the ESS KV pool wrote them to the host pool already) --------------------------------
    def keep_own_rows(self, layer_id: int, rows: torch.Tensor) -> None:
        """This decode/verify step's new rows [B(*S), 656], which swap_in_selected_pages puts into their GPU slots."""
        self._own_rows[layer_id - self.start_layer] = rows

    def start_forward(self) -> None:
        """A forward of the target model begins: a step started at an indexer whose attention call never came (an
        aborted forward) must not be taken for a later one's, whose tensors may sit at the same address; the trace
        ring starts empty."""
        if self._pending:
            logger.warning("ESS: %d overlap step(s) started at the indexer were never consumed; dropped", len(self._pending))
            for (layer, _, _), (r, fetched, req) in self._pending.items():
                self._land_unfetched(layer, req, r, fetched)
            self._pending.clear()
        if self._split is not None:  # a split never taken
            layer, req, r, fetched = self._split
            self._land_unfetched(layer, req, r, fetched)
        self._split = None
        self.apply_admissions()
        if self.ring is not None:
            self.ring.reset()
        self.next_ranked.clear()
        self._tally.zero_()  # (a CUDA graph's capture runs count nothing)

    def _step(self, layer: int, req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor, serial: bool = False,
              own_rows: torch.Tensor | None = None) -> PolicyResult:
        """The LRU step of one layer for a (micro-)batch: sets [B, S*K] positions, own [B] or [B, S]. Rows of request
        slot 0 are CUDA-graph padding (SGLang's padding row, never a request's): they take no LRU step. serial: the
        whole NONE order (ServingLatentCache.translate: step, H2D of the misses, own rows); else the step alone."""
        if layer == 0:
            self.cache.next_step()
        real = req != PADDING_SLOT  # padding rows get no own token, and so (below) no set: they touch only sinks
        own = torch.where(real.unsqueeze(1) if own.dim() == 2 else real, own, -1)
        # Entries past the request's newest own position (stale or padded top-k; SGLang's HiSparse had the same hole,
        # its issue 32771) would translate to another token's slot or index past the tables: mask them (device op).
        newest = own if own.dim() == 1 else own.max(dim=1).values
        sets = torch.where(sets > newest.unsqueeze(1), -1, sets)
        if self.progressive is not None:  # --ess-progressive-pd: the rows this step reads have landed (a host wait)
            self.progressive.wait(layer, req, sets)
        if self.cache.tier is not None:
            self._page_in(layer, req, sets, own)
        if serial:
            r = self.cache.translate(layer, req, self.token_table, sets, own, own_rows)
        else:
            r = self.cache.update(layer, req, sets, own, self.token_table)
        self._count(r)
        ext = self.next_ranked.pop(0) if self.next_ranked else None
        if self.ring is not None and own.dim() == 1:  # verify steps hold several positions: not a trace step
            self.ring.append(layer, req, sets, own, ext)
        return r

    def _page_in(self, layer: int, req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor) -> None:
        """--ess-disk-dir, before a layer's LRU step: the pages of its misses into host frames, waited for (exposed;
        host work, so eager mode only); then, in the background, changed pages no step of this call used are written
        out and the pages the next layer selected at its last step are read ahead (docs/plugin.md, "Disk tier")."""
        self.cache.page_in(layer, req, self.token_table, sets, own)
        self.cache.read_ahead(layer)

    def keep_next_ranked(self, logits: torch.Tensor, lengths: torch.Tensor, topk: torch.Tensor) -> None:
        """--ess-record-lookahead d: the d positions the indexer ranks after its top-k (logits [rows, positions],
        positions >= lengths [rows] invalid; topk [rows, K] the positions it selected), device ops only, kept for the
        step of this indexer call."""
        d = self.ess.record_lookahead
        col = torch.arange(logits.shape[1], device=logits.device)
        scores = torch.where(col < lengths.reshape(-1, 1), logits.float(), -torch.inf)
        scores = scores.scatter(1, topk.long().clamp(min=0), -torch.inf)  # the top-k itself is not ranked again
        # (a -1 entry clamps to column 0, which a short row then loses from the ranks: the top-k held every position)
        vals, idx = torch.topk(scores, min(d, scores.shape[1]), dim=1)
        ext = torch.where(vals > -torch.inf, idx, -1)
        if ext.shape[1] < d:
            ext = torch.nn.functional.pad(ext, (0, d - ext.shape[1]), value=-1)
        self.next_ranked.append(ext)

    def _count(self, r: PolicyResult) -> None:
        """One LRU step into this forward's tally (two device ops: a CUDA graph captures them)."""
        B = r.n_set.shape[0]
        if B > self._tally.shape[1]:  # more rows than request slots (never in SGLang): summed first
            self._tally[:, 0] += torch.stack([torch.ones_like(r.n_set[0]), r.n_set.sum(), r.n_miss.sum()]).int()
            return
        if B not in self._first:
            self._first[B] = (torch.arange(B, device=r.n_set.device) == 0).to(torch.int32)
        self._tally[:, :B] += torch.stack([self._first[B], r.n_set, r.n_miss])

    def end_forward(self) -> None:
        """After a forward, outside any graph: the forward's tally into the counters (device ops), then the recorded
        rows go to the trace recorder (SGLang's padding rows, request slot 0, are left out)."""
        steps, sets, misses = self._tally.sum(dim=1, dtype=torch.int64)
        stepped = steps > 0
        self.counters += torch.stack([steps, sets, misses, stepped, stepped & (misses == 0)]).long()
        self._tally.zero_()
        if self.ring is None:
            return
        for layer, req, topk, own in self.ring.drain():
            real = req != PADDING_SLOT
            if real.any():
                self.recorder.record(layer, req[real], topk[real], own[real])

    # -- DA / DBA: called by the plugin right after the layer's indexer ------------------------------------------
    def begin(self, layer_id: int, req_pool_indices: torch.Tensor, positions: torch.Tensor, top_k: torch.Tensor) -> bool:
        """top_k [B*S, K] positions from the indexer for the query rows at positions [B*S] (S = 1 in decode, the draft
        tokens in MTP verify). Starts the H2D of the misses on the copy stream if this layer overlaps. Returns whether
        it did (otherwise the attention call does the whole step)."""
        layer = layer_id - self.start_layer
        B = req_pool_indices.shape[0]
        if self.modes[layer] not in OVERLAP_EARLY or B == 0 or top_k.dim() != 2 or self.cache.all_resident():
            return False  # (every request resident: no copy to overlap, the attention call does the step)
        if positions.shape[0] != top_k.shape[0] or top_k.shape[0] % B:  # padded rows: leave it to the attention call
            return False
        S = top_k.shape[0] // B
        own = _per_request(positions, B, S)
        r = self._step(layer, req_pool_indices, top_k.reshape(B, -1), own)
        if self.attn1 == "fused" and S == 1:  # the copy is the fused miss kernel's, at the attention call
            fetched = None
        else:
            fetched = self.streams.copy_after(
                lambda: self.cache.fetch(layer, req_pool_indices, self.token_table, r, overlapped=True),
                r.miss_pos, r.miss_slot, req_pool_indices,
            )
        self._pending[(layer, req_pool_indices.data_ptr(), B)] = (r, fetched, req_pool_indices)
        return True

    # -- the backend's call --------------------------------------------------------------------------------------
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
        pending = self._pending.pop((layer, req_pool_indices.data_ptr(), B), None)
        own_rows = self._own_rows[layer]
        self._own_rows[layer] = None
        if pending is None:  # mode none (or no indexer call seen): the whole step here, in the serial order
            own = _per_request(seq_lens, B, S) - 1
            r = self._step(layer, req_pool_indices, top_k.reshape(B, -1), own, serial=True, own_rows=own_rows)
        else:  # the step and its H2D started at the indexer
            r, fetched, _ = pending
            if own_rows is not None:
                self.cache.store_own(layer, r, own_rows)
            if S == 1 and self.split_ok and self.attn1 in ("miss", "fused"):
                # Attn0 reads the hits and own rows now; split_attention (the FlashMLA call's hook) waits for the copy
                if self._split is not None:
                    raise RuntimeError("ESS: a DA split attention was started and never taken by a FlashMLA call")
                self._split = (layer, req_pool_indices, r, fetched)
                return torch.where(r.hit, r.attn_slot, -1).reshape(top_k.shape).to(torch.int32)
            if fetched is None:  # fused, but this call attends in one piece: the copy first, here
                self._land_unfetched(layer, req_pool_indices, r, fetched)
            else:
                self.streams.wait(fetched)
        return r.attn_slot.reshape(top_k.shape).to(torch.int32)

    def _land_unfetched(self, layer: int, req: torch.Tensor, r, fetched) -> None:
        """A fused step (fetched None) leaves its misses resident in the tables with no copy started, the fused miss
        kernel's to make: where that kernel does not run, the rows are copied here."""
        if fetched is None:
            self.cache.fetch(layer, req, self.token_table, r)

    @property
    def split_pending(self) -> bool:
        """A DA split step waits for its FlashMLA call (sglang_ess.hooks.forward then routes that call to
        split_attention)."""
        return self._split is not None

    def split_attention(self, attn0, q: torch.Tensor, scale: float | None):
        """The FlashMLA call of a split DA step (sglang_ess.hooks.forward wraps FlashMLA's interface, when
        split_pending): attn0() makes the backend's own call, over the top-k with the misses set to -1, q [B, 1, H,
        576] its query (heads padded as the backend pads them). Returns FlashMLA's (o [B, 1, H, 512] in o's dtype,
        lse [B, H, 1]; +inf for a row without entries) of the merged attention over every entry."""
        if self._split is None:
            raise RuntimeError("ESS DA split: no split pending (the FlashMLA hook checks split_pending first)")
        layer, req, r, fetched = self._split
        self._split = None
        B = r.n_miss.shape[0]
        if q.dim() != 4 or q.shape[0] != B or q.shape[1] != 1 or q.shape[3] != 576:
            raise RuntimeError(f"ESS DA split: FlashMLA's query is {tuple(q.shape)}, expected [{B}, 1, heads, 576]")
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # FlashMLA's default
        q_nope, q_pe = q[:, 0, :, :512], q[:, 0, :, 512:]
        part1 = {}
        if fetched is None:  # fused: the misses land and are attended on the copy stream while Attn0 runs
            fetched = self.streams.copy_after(
                lambda: part1.update(o=self.cache.fetch_attend(layer, req, self.token_table, r, q_nope, q_pe, scale)),
                q, r.miss_pos, r.miss_slot, r.n_miss, req,
            )
        o0, lse0 = attn0()
        self.streams.wait(fetched)
        o1, lse1 = part1["o"] if part1 else self.cache.attend_misses(layer, r, q_nope, q_pe, scale)
        o, lse = miss_attention.merge(o0[:, 0], lse0[:, :, 0], o1, lse1, out_dtype=o0.dtype)
        return o.unsqueeze(1), torch.where(lse == -math.inf, math.inf, lse).unsqueeze(-1)

    def check_split_taken(self) -> None:
        """After the backend's decode call: a pending split means its attention did not go through FlashMLA's
        interface, and read the top-k without the misses. Never silent."""
        if self._split is not None:
            self._split = None
            raise RuntimeError("ESS DA split: the decode call returned without a FlashMLA call (its output lacks the "
                               "misses); run --ess-overlap none, or SGLang's flashmla_kv decode backend")

    def latent_buffer(self, layer_id: int) -> torch.Tensor:
        """The device latent rows that swap_in_selected_pages' indices address: [slots, 1, 656] uint8."""
        return self.cache.gpu[layer_id - self.start_layer].unsqueeze(1)

    def wait_for_pending_backup(self) -> None:
        """Part of the backend-facing contract; ESS's host writes are ordered on the compute stream."""

    # -- LRU-Warmup from prefill --------------------------------------------------------------------------------
    def plan_prefill(self, req: torch.Tensor, extend_lens: list[int]) -> None:
        """Before layer 0 of a prefill forward whose requests req [R] extend by extend_lens tokens (host ints, in
        batch order). Their LRU rows are forgotten: a new request has none, and a chunked one warms up again from its
        newest chunk (see WarmupPlan for the windows); with residency their regions stay (a resident one is filled
        as the prefill writes its rows, `fill_resident`)."""
        self.cache.forget(req)
        W = self.ess.warmup_windows
        self._warm = WarmupPlan(req, extend_lens, W) if W and req.shape[0] else None

    def warm_from_prefill(self, layer_id: int, top_k: torch.Tensor, to_positions=None, token_range=None) -> None:
        """After layer layer_id's prefill attention: LRU-Warmup of the planned requests from top_k [rows, K] (the
        forward's query rows). to_positions maps SGLang's fused top-k (token locations) to positions; None when top_k
        holds positions. token_range (start, end): this forward is a TBO micro-batch holding those query rows of the
        planned forward; windows outside it are left to the other micro-batch (an empty window changes nothing, and
        the earlier micro-batch holds the older windows, so the order of insertion is kept)."""
        got = None if self._warm is None else self._warm.sets(top_k, token_range, to_positions)
        if got is not None:
            self.cache.warmup(layer_id - self.start_layer, got[0], self.token_table, got[1])

    def kv_landed(self, req_slot: int, length: int) -> None:
        """With residency, a request's KV (its first `length` positions) landed in the host pool without a prefill
        forward: a PD transfer's commit, or SGLang restoring a retracted request's backup (the pool's load_cpu_copy).
        At the next forward, whatever happened to the request since its row was given (demoted, promoted, both), the
        rows it holds become true: a resident one's region is filled from the host pool; an offloaded one loads its
        warm-up entries if they came, else the rows its LRU tables hold are fetched (a demotion before the KV landed
        held rows never written; docs/plugin.md, "Residency first on a PD decode node")."""
        if self.cache.regions is not None:
            self._landed[req_slot] = length

    def admit_transferred(self, req_slot: int, entries: torch.Tensor, positions: int | None = None) -> None:
        """PD decode: a request whose KV arrived from a prefill node, with the warm-up state that node sent
        (entries [layers, N], sglang_ess.pd.warmup's wire format): at the next forward its GPU slots start as a
        co-located warm-up would leave them, the most recently used rows first when the union exceeds the slots.
        The entries are input from another node: ones that cannot be loaded for a request of `positions` tokens
        (default: the request table's width) are refused with the reason, before anything reads them."""
        if entries.dim() != 2 or entries.shape[0] != self.num_layers:
            raise WarmupRefused(req_slot, f"shape {tuple(entries.shape)}, expected [{self.num_layers}, N]")
        reason = pd_warmup.check_entries(entries, positions or self.token_table.shape[1])
        if reason is not None:
            raise WarmupRefused(req_slot, reason)
        self._loads[req_slot] = entries

    def abandon_transfer(self, req_slot: int) -> None:
        """PD decode: a request whose transfer is refused (its metadata malformed) leaves nothing to load."""
        self._loads.pop(req_slot, None)
        self._landed.pop(req_slot, None)

    def reset_rows(self, rows: list[int]) -> None:
        """Request-table rows handed to new requests: at the next forward they start with empty tables."""
        self._resets.extend(rows)
        for r in rows:
            self._loads.pop(r, None)  # a state loaded for the row's previous request does not carry over
            self._landed.pop(r, None)  # nor its KV's landing: the new request's comes after this
            if self.cache.tier is not None:  # nor a lost row that request read (hooks.forward.after_run_batch)
                self.cache.tier.lost_reads.pop(r, None)

    def apply_admissions(self) -> None:
        """At the start of a forward (on its stream): the rows reset since the last forward, then the warm-up states
        that arrived for them."""
        resets, self._resets = self._resets, []  # taken whole: the scheduler may add more meanwhile
        loads, self._loads = self._loads, {}
        landed, self._landed = self._landed, {}
        if resets:
            self.cache.release(torch.tensor(resets, dtype=torch.int64, device=self.cache.gpu.device), resets)
        if self.cache.regions is not None:  # new requests' rows (a finished request's row waits for its next one)
            finished, self._finished = self._finished, set()
            given = dict.fromkeys(resets)
            # first come, first resident: in the order the rows were given (plan_positions notes each as it is given; a
            # row reset without a reach, for tests and rows SGLang frees outside its release, after those)
            new = [r for r in self._positions if r in given] + [r for r in given if r not in self._positions
                                                               and r not in finished]
            self._admit_regions(new, bool(resets))
        resident = set(self.cache.resident_requests()) if self.cache.regions is not None else set()
        for slot, length in landed.items():
            if slot in resident:  # its whole KV, from the host pool where the transfer wrote it
                self.cache.fill_from_host(slot, length, self.token_table)
                self.filled_from_host += 1
            elif slot in self.cache.offloaded and slot not in loads:  # the rows its tables hold (kv_landed)
                self.cache.fill_held(slot, self.token_table)
        for slot, entries in loads.items():
            if slot in resident:
                continue  # every row of it is on the GPU already: no warm-up to load
            pos, window = pd_warmup.unpack(entries.to(self.cache.gpu.device), self.cache.capacity)
            self.cache.load_warm(slot, self.token_table, pos, self.cache.stamp - pd_warmup.WINDOWS + window)
            self.warm_loaded += 1

    # -- residency first (docs/design.md, "Residency first"; the plugin's policy in docs/plugin.md) -----------------------
    def plan_positions(self, req_slot: int, positions: int) -> None:
        """The scheduler gave request slot req_slot to a request that can reach `positions` positions (its prompt, its
        most new tokens and the draft tokens): its region is sized for them at the next forward."""
        self._positions[req_slot] = min(positions, self.token_table.shape[1])

    def _admit_regions(self, new: list[int], changed: bool) -> None:
        """At the start of a forward, in stream order: the new request slots get regions, resident while the pool has
        room, offloaded otherwise (residents demoted, largest first, to make room for an offloaded one); once a
        request left, offloaded ones are promoted while room lasts. Regions are whole multiples of C, so a freed or
        demoted region always leaves whole C-slot regions free."""
        cache, C = self.cache, self.cache.capacity
        whole = lambda positions: -(-positions // C) * C  # noqa: E731 - rows in whole multiples of C
        for slot in new:
            if slot == PADDING_SLOT:
                continue
            want = whole(self._positions.pop(slot, self.token_table.shape[1]))
            self._reach[slot] = want
            while True:
                try:
                    cache.admit(slot, want)
                    break
                except ValueError:
                    residents = [r for r in cache.resident_requests() if r != slot]
                    if not residents:
                        raise
                    victim = max(residents, key=lambda r: cache.region[r][1])
                    cache.demote(victim)
                    self.demoted += 1
        if changed and cache.offloaded:  # a request came or went: room for an offloaded one, perhaps
            for slot in sorted(cache.offloaded):
                want = self._reach.get(slot, whole(self.token_table.shape[1]))
                if cache.regions.largest_free() + C < want:
                    continue
                if cache.promote(slot, want, self.token_table, want):
                    self.promoted += 1

    def fill_resident(self, layer_id: int, rows: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> None:
        """A prefill layer's rows (staging rows [N, 656] of request slots req and positions pos) into the regions of
        resident requests."""
        self.cache.fill_resident(layer_id - self.start_layer, rows, req, pos)

    # -- request lifecycle (scheduler side) --------------------------------------------------------------------------
    def release(self, req_slot: int, rid: str = "") -> str | None:
        """A request finished or was aborted: its GPU rows are forgotten at the next forward (reset_rows; its tokens go
        back through SGLang's allocator). Returns the trace file written for it, if recording."""
        if self.progressive is not None:  # a request still landing comes here once its transfer ended (the hook holds it)
            self.progressive.release(req_slot)
        self.reset_rows([req_slot])
        self._finished.add(req_slot)
        self._positions.pop(req_slot, None)
        self._reach.pop(req_slot, None)
        self.released += 1
        if self.recorder is None:
            return None
        try:
            return self.recorder.finish(req_slot, rid)
        except OSError as e:  # the folder went away or became read-only: the server serves on without this trace
            logger.error("ESS trace of request %r not written (--ess-record-trace %s): %s", rid, self.recorder.directory, e)
            return None

    def counts(self) -> dict[str, int]:
        """The step counters (COUNTERS) as host ints: a device sync, for readouts only."""
        pending = self._tally.sum(dim=1, dtype=torch.int64)  # steps not yet summed by a forward's end
        counters = self.counters + torch.cat([pending, pending.new_zeros(len(COUNTERS) - 3)])
        return dict(zip(COUNTERS, counters.tolist())) | {"released_requests": self.released}

    def stats(self) -> dict:
        tier = self.cache.tier
        out = {"device_bytes": self.cache.device_bytes(), "modes": self.modes,
               "pd": {"warm_states_loaded": self.warm_loaded, "resident_regions_filled": self.filled_from_host}}
        if self.cache.regions is not None:
            out |= {"residency": {"device_rows": self.cache.regions.rows,
                                  "resident_requests": len(self.cache.resident_requests()),
                                  "offloaded_requests": len(self.cache.offloaded), "demoted": self.demoted,
                                  "promoted": self.promoted, "fixed_path": self.cache.fixed_path}}
        if tier is None:
            return out | {"host_bytes": self.cache.host.numel()}
        return out | {"host_bytes": tier.frame_rows.numel(), "disk_bytes": tier.L * tier.P * DISK_PAGE,
                      "tier": tier.report()}
