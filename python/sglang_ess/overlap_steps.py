"""DA / DBA overlap (docs/design.md, "Overlap"), per layer from the plan or --ess-overlap: the layer's LRU step started
right after its indexer, and the attention call that takes it.

    none      the attention call does everything: LRU step, H2D of the misses, own rows into their slots.
    da / dba  `begin`, called by the plugin right after the layer's indexer, runs the LRU step and starts the H2D of
              the misses on the copy stream; the rest of forward_absorb_prepare (q_b_proj under graph capture,
              w_kc bmm, rotary) and the KV write run meanwhile; the attention call (`take`) then puts the own rows in
              place and waits for the copy. With --enable-two-batch-overlap each micro-batch's H2D also runs under the
              other micro-batch's work between op_prepare and op_core (its indexer included): that is DBA's schedule,
              so the launch checks accept dba only with TBO (a plan's dba layers run as da without it).

Attention in a DA / DBA decode step (one query row per request) through FlashMLA's decode (SGLang's flashmla_kv
backend) is split (docs/plugin.md, "Overlap"): the backend's FlashMLA call reads the top-k with the misses set to -1
(Attn0: hits and own rows, without waiting for the copy), then `split_attention` waits for the copy, attends to the
misses with ess.core.kernels.miss_attention's kernel over the LRU step's compacted miss lists, and merges the two by
log-sum-exp. With attn1 "fused" the copy itself is the miss kernel's (the H2D and Attn1 in one kernel on the copy
stream beside Attn0; it needs the query, so it starts at the attention call, not at the indexer). With "calls", and in
MTP verify, one FlashMLA call reads every entry after the copy (the plugin never makes a second full-width call).
--ess-da-attn1 chooses (default "calls": the split has not been timed on a GPU yet, and its bf16 parts round
differently from one call).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from ess.core.kernels import miss_attention
from ess.core.policy import PolicyResult
from ess.core.serving import ServingLatentCache
from ess.core.streams import Streams

OVERLAP_EARLY = ("da", "dba")  # modes whose H2D starts at the indexer

logger = logging.getLogger("sglang_ess")


class OverlapSteps:
    def __init__(self, cache: ServingLatentCache, token_table: torch.Tensor, streams: Streams, modes: list[str],
                 attn1: str, step: Callable[..., PolicyResult]):
        """modes: each layer's overlap mode; attn1: --ess-da-attn1; step(layer, req, sets, own, S): the runtime's LRU
        step of one layer (EssRuntime._step)."""
        self.cache = cache
        self.token_table = token_table
        self.streams = streams
        self.modes = modes
        self.attn1 = attn1  # "miss" / "fused" split the attention, "calls" keeps one call
        self.step = step
        self.split_ok = False  # set by the plugin around a decode call of a backend that attends through FlashMLA
        # (layer, request-index tensor address, batch) -> (the LRU step, its H2D's done event or None when the fused
        # miss kernel is to copy, the request indices), from `begin` to the attention call of the same (micro-)batch;
        # the address tells TBO's two micro-batches apart
        self.pending: dict[tuple[int, int, int], tuple[PolicyResult, object, torch.Tensor]] = {}
        self._split = None  # (layer, request indices, the LRU step, its H2D's event) from `take` to the FlashMLA call

    def begin(self, layer: int, req: torch.Tensor, positions: torch.Tensor, top_k: torch.Tensor) -> bool:
        """Right after layer `layer`'s indexer: top_k [B*S, K] positions for the query rows at positions [B*S] (S = 1
        in decode, the draft tokens in MTP verify). Starts the H2D of the misses on the copy stream if this layer
        overlaps. Returns whether it did (otherwise the attention call does the whole step)."""
        B = req.shape[0]
        if self.modes[layer] not in OVERLAP_EARLY or B == 0 or top_k.dim() != 2 or self.cache.all_resident():
            return False  # (every request resident: no copy to overlap, the attention call does the step)
        if positions.shape[0] != top_k.shape[0] or top_k.shape[0] % B:  # padded rows: leave it to the attention call
            return False
        S = top_k.shape[0] // B
        r = self.step(layer, req, top_k.reshape(B, -1), positions, S)
        if self.attn1 == "fused" and S == 1:  # the copy is the fused miss kernel's, at the attention call
            fetched = None
        else:
            fetched = self.streams.copy_after(
                lambda: self.cache.fetch(layer, req, self.token_table, r, overlapped=True),
                r.miss_pos, r.miss_slot, req,
            )
        self.pending[(layer, req.data_ptr(), B)] = (r, fetched, req)
        return True

    def take(self, layer: int, req: torch.Tensor, S: int, own_rows: torch.Tensor | None) -> torch.Tensor | None:
        """The attention call of `layer` for the batch req [B] (S query rows per request): the step `begin` started
        for it, its own rows put in place. Returns the step's slots [B, S*K] once its copy is waited for, or, in a
        split DA step, at once with the misses -1 (split_attention then waits). None: no step was started (mode
        none, or no indexer call seen), the caller runs the whole step."""
        pending = self.pending.pop((layer, req.data_ptr(), req.shape[0]), None)
        if pending is None:
            return None
        r, fetched, _ = pending
        if own_rows is not None:
            self.cache.store_own(layer, r, own_rows)
        if S == 1 and self.split_ok and self.attn1 in ("miss", "fused"):
            # Attn0 reads the hits and own rows now; split_attention (the FlashMLA call's hook) waits for the copy
            if self._split is not None:
                raise RuntimeError("ESS: a DA split attention was started and never taken by a FlashMLA call")
            self._split = (layer, req, r, fetched)
            return torch.where(r.hit, r.attn_slot, -1)
        if fetched is None:  # fused, but this call attends in one piece: the copy first, here
            self._land_unfetched(layer, req, r, fetched)
        else:
            self.streams.wait(fetched)
        return r.attn_slot

    def drop_unconsumed(self) -> None:
        """A forward begins: a step started at an indexer whose attention call never came (an aborted forward) must
        not be taken for a later one's, whose tensors may sit at the same address."""
        if self.pending:
            logger.warning("ESS: %d overlap step(s) started at the indexer were never consumed; dropped", len(self.pending))
            for (layer, _, _), (r, fetched, req) in self.pending.items():
                self._land_unfetched(layer, req, r, fetched)
            self.pending.clear()
        if self._split is not None:  # a split never taken
            layer, req, r, fetched = self._split
            self._land_unfetched(layer, req, r, fetched)
        self._split = None

    def _land_unfetched(self, layer: int, req: torch.Tensor, r, fetched) -> None:
        """A fused step (fetched None) leaves its misses resident in the tables with no copy started, the fused miss
        kernel's to make: where that kernel does not run, the rows are copied here."""
        if fetched is None:
            self.cache.fetch(layer, req, self.token_table, r)

    # -- the split FlashMLA call of a DA decode step -------------------------------------------------------------------
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
