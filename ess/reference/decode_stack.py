"""The decode benchmark's stack (benchmark/decode_gpu.py, docs/gpu.md): L full-size DeepSeek-V3.2 decode layers over
one batch, the baseline's dense cache or ESS's, with the rest of each layer measured where a LayerRest is given; and
`TwoBatch`, the same batch as two micro-batches under two-batch overlap.

A step is written in stages (ess.reference.stages): each layer yields where SGLang's two-batch overlap of a DeepSeek
decode layer lets the other micro-batch run, five times a layer (after attention's prepare; after its core, o_proj and
the router; after launching the dispatch; after the experts and launching the combine; after the combine's wait).
Run alone, a stack drains its stages, and the order is the serial one; `TwoBatch` interleaves two stacks' stages,
micro-batch A two stages ahead, with the all-to-all's waits on a stream of their own (docs/gpu.md, "Two-batch
overlap").
"""

from __future__ import annotations

import dataclasses

import torch

from ess.analysis.sim.paper import EP
from ess.analysis.synth import SynthOptions
from ess.core import layout
from ess.core.memory import ess_device_rows
from ess.core.settings import DA_ATTN1, PAGE_TOKENS, EssConfig
from ess.reference import attention as A
from ess.reference.dense_cache import DenseLatentCache
from ess.reference.ess_cache import EssLatentCache
from ess.reference.flashmla import sparse_decode, split_decode
from ess.reference.layer_rest import Comm
from ess.reference.overlap import ess_layer_stages
from ess.reference.stages import drain, interleave


@dataclasses.dataclass
class Setup:
    cfg: object
    layers: int
    contexts: list[int]
    ratios: list[float]
    small_batches: list[int]
    warm_steps: int
    iters: int
    device: torch.device
    attention: str
    max_batch: int | None  # a cap on the largest batches (the smoke run's)
    query_rows: list[int] = dataclasses.field(default_factory=lambda: [1])  # 1: decode; 1 + draft tokens: MTP verify
    check: bool = False  # compare every ESS mode's outputs with the baseline's (a second stack: small runs only)
    dtype: torch.dtype = torch.float32  # weights and activations of the projections (bf16 on a GPU, as a server's)
    attn1: str = DA_ATTN1  # DA / DBA's Attn1 in decode rows (verify rows: two FlashMLA calls)
    residency: bool = True  # residency first (ess.core.residency); False: every ESS request offloaded
    whole_layer: bool = True  # the rest of each layer measured (ess.reference.layer_rest); False: the simulator's
    ep: int = EP  # the expert parallelism of the measured MoE share and of the all-to-all's modelled length
    fitted: SynthOptions | None = None  # locality fitted to real traces: ESS rows also with it (row "locality" fit)
    tbo: bool = False  # two-batch overlap (TwoBatch) at every batch of 2 or more
    experts: str = "fp8"  # the routed experts' precision in the measured rest (ess.reference.layer_rest.EXPERTS)


def stack_positions(context: int, steps: int, rows: int) -> int:
    """The positions a stack's request reaches: its context and `steps` steps of `rows` tokens, in whole FlashMLA
    pages."""
    return -(-(context + steps * rows) // PAGE_TOKENS) * PAGE_TOKENS


class Stack:
    """L decode layers over one batch: the baseline's dense cache (buffer None) or ESS's cache with `buffer` slots.
    rows S query rows per request and step: 1 in decode, 1 + draft tokens in MTP verify (rows b*S .. b*S+S-1 are
    request b's, at consecutive positions; one LRU step takes their union and S own tokens, as the plugin does).
    tbo: the stack is one micro-batch of a TwoBatch (its ESS layers' dba is then ess.reference.overlap's TBO one)."""

    def __init__(self, s: Setup, batch: int, context: int, buffer: int | None, rows: int, topk_steps: torch.Tensor | None,
                 warm_sets: torch.Tensor | None, seed: int = 0, budget: float | None = None, rest=None,
                 weights: A.AttentionWeights | None = None, tbo: bool = False):
        cfg, dev, L = s.cfg, s.device, s.layers
        g = torch.Generator().manual_seed(seed)
        self.s, self.B, self.S, self.context, self.buffer, self.tbo = s, batch, rows, context, buffer, tbo
        steps = s.warm_steps + 1
        self.max_len = stack_positions(context, steps, rows)
        if weights is None:  # its own generator: the inputs below do not depend on whether weights were given
            w = A.AttentionWeights.random(cfg, torch.Generator().manual_seed(seed), dev)
            weights = dataclasses.replace(w, **{f.name: getattr(w, f.name).to(s.dtype) for f in dataclasses.fields(w)})
        self.w = weights  # a micro-batch shares the other's
        self.h = torch.randn(steps, batch * rows, cfg.hidden, generator=g).to(dev, s.dtype)  # each step's hidden states
        # drawn where they live: on a GPU, the CPU's generator took seconds per large batch (setup, not timed)
        keys = torch.randn(batch, self.max_len, cfg.index_head_dim, device=dev,
                           generator=torch.Generator(device=dev).manual_seed(seed))
        # index-K [B * S, max_len, 132]: each query row scores its request's keys (shared by the layers)
        self.index_k = layout.quantize_index_k(keys).repeat_interleave(rows, 0)
        self.row_req = torch.arange(batch, device=dev).repeat_interleave(rows)  # the request of each query row
        block = layout.quantize_latent(torch.randn(4096, 512, generator=g), torch.randn(4096, 64, generator=g)).to(dev)
        prompt = block.repeat(-(-context // 4096), 1)[:context]
        self.topk_steps = topk_steps  # [steps, L, B * S, K] replayed top-k, or None: the indexer's
        # the rest of each layer and the LM head, measured (rest(self.w, tokens) -> LayerRest), or None: modelled
        self.rest = None if rest is None else rest(self.w, batch * rows)
        self.modes: list[str] = []  # per layer, for mode "plan"
        if buffer is None:
            self.cache = DenseLatentCache(L, batch, self.max_len, dev)
        else:
            device_rows = None if budget is None else ess_device_rows(budget, L, batch, context, buffer, self.max_len)
            self.cache = EssLatentCache(EssConfig(topk=cfg.index_topk, buffer_tokens=buffer), L, [context] * batch,
                                        self.max_len, dev, device_rows=device_rows)
        self.resident = None if budget is None or buffer is None else sum(self.cache.resident)  # residency first
        for li in range(L):
            for b in range(batch):
                self.cache.prefill(li, b, prompt, None)
            if buffer is not None and warm_sets is not None:
                self.cache.warmup_layer(li, warm_sets[li])

    def positions(self, t: int) -> torch.Tensor:
        """[B * S] the query rows' positions at step t."""
        first = self.context + t * self.S
        return first + torch.arange(self.S, device=self.s.device).repeat(self.B)

    def step(self, t: int, mode: str) -> list[torch.Tensor]:
        """Decode (or verify) step t of every layer, with the rest of each layer and the LM head where the stack
        measures them (else the attention path only), in the serial order; returns each layer's attention output
        [B * S, H, 512]."""
        out = []
        drain(self.stages(t, mode, Comm(self.s.device), out))
        return out

    def stages(self, t: int, mode: str, comm: Comm, out: list):
        """step(t, mode) in stages (module docstring), each layer's attention output appended to out; the
        all-to-all's waits through comm."""
        s, cfg = self.s, self.s.cfg
        pos, h = self.positions(t), self.h[t]
        if self.buffer is not None:
            self.cache.set_step(t)
        for li in range(s.layers):
            q_lora = A.q_lora_of(self.w, h)
            sel = None if self.topk_steps is None else self.topk_steps[t, li]
            if self.buffer is None:
                topk = A.indexer_topk(self.w, cfg, h, q_lora, pos, self.index_k)
                topk = topk if sel is None else sel
                self.cache.rows[li, self.row_req, pos] = A.kv_latent_rows(self.w, cfg, h, pos)
                yield  # attention's prepare | core
                q_nope, q_pe = A.pre_attn(self.w, cfg, q_lora, pos)
                idx = torch.where(topk >= 0, self.row_req.unsqueeze(1) * self.max_len + topk, -1)
                o, _ = sparse_decode(q_nope, q_pe, self.cache.rows[li].view(-1, layout.LATENT_ROW_BYTES), idx,
                                     cfg.softmax_scale, s.attention)
            elif self.S == 1:
                layer_mode = self.modes[li] if mode == "plan" else mode
                o, _ = yield from ess_layer_stages(layer_mode, self.w, cfg, h, q_lora, pos, self.index_k, self.cache,
                                                   li, s.attention, selected=sel, attn1=s.attn1, tbo=self.tbo)
            else:
                o = yield from self.verify_stages(self.modes[li] if mode == "plan" else mode, li, h, q_lora, pos, sel)
            out.append(o)
            if self.rest is not None:  # each layer reads the same h (shared weights): its output is not chained
                yield from self.rest.stages(o, h, comm)
        if self.rest is not None:
            self.rest.lm_head(h)

    def verify_stages(self, mode: str, li: int, h, q_lora, pos, sel):
        """MTP verify on ESS (staged: yields between attention's prepare and core, returns the output): one LRU step
        over the union of each request's S rows (S own tokens), then FlashMLA over every row's own top-k. none: the
        serial order; da (and dba, which runs as da here: one indexer call for the batch, as in the plugin without
        TBO): the H2D on the copy stream under PreAttn and Attn0."""
        cfg, cache, B, S = self.s.cfg, self.cache, self.B, self.S
        topk = A.indexer_topk(self.w, cfg, h, q_lora, pos, self.index_k)
        topk = topk if sel is None else sel
        sets, own = topk.reshape(B, -1), pos.reshape(B, S)
        own_rows = A.kv_latent_rows(self.w, cfg, h, pos)
        if mode == "none":
            r = cache.translate(li, sets, own, own_rows)
        else:
            r = cache.update(li, sets, own)
            fetched = cache.streams.copy_after(lambda: cache.fetch(li, r, overlapped=True), r.miss_pos, r.miss_slot)
            cache.store_own(li, r, own_rows)
        yield  # attention's prepare | core
        backed_up = cache.backup_own(li, r, own)
        cache.record(li, r)
        q_nope, q_pe = A.pre_attn(self.w, cfg, q_lora, pos)
        pool, slots = cache.serving.gpu[li], r.attn_slot.reshape(B * S, -1)
        if mode == "none":
            o, _ = sparse_decode(q_nope, q_pe, pool, slots, cfg.softmax_scale, self.s.attention)
        else:
            o, _ = split_decode(q_nope, q_pe, pool, slots, r.hit.reshape(B * S, -1), cfg.softmax_scale,
                                lambda: cache.streams.wait(fetched), self.s.attention)
        cache.streams.wait(backed_up)
        return o

    def selected(self, t: int) -> list[torch.Tensor]:
        """Each layer's top-k at step t, [B, S * K] per request: the replayed trace's, or the indexer's (the same in
        every layer: the layers share weights and index-K)."""
        if self.topk_steps is not None:
            return [self.topk_steps[t, li].reshape(self.B, -1) for li in range(self.s.layers)]
        h, cfg, pos = self.h[t], self.s.cfg, self.positions(t)
        topk = A.indexer_topk(self.w, cfg, h, A.q_lora_of(self.w, h), pos, self.index_k)
        return [topk.reshape(self.B, -1)] * self.s.layers

    # ESS: the LRU tables decide the misses; they are snapshotted and restored around every timed replay
    def tables(self) -> list[torch.Tensor]:
        sp = self.cache.sparse
        return [sp.slot_pos, sp.slot_stamp, sp.pos_slot]

    def without_misses(self, t: int) -> None:
        """The LRU tables as if every position step t selects were resident (the step's time without transfer)."""
        sp = self.cache.sparse
        sp.slot_pos.fill_(-1), sp.slot_stamp.zero_(), sp.pos_slot.fill_(-1)
        for li, sel in enumerate(self.selected(t)):
            self.cache.warmup_layer(li, sel.unsqueeze(1))

    def state(self, rows: bool) -> list[torch.Tensor]:
        """What a timed replay restores: the LRU tables, and with rows the GPU pool's rows (the check's)."""
        return self.tables() + ([self.cache.serving.gpu] if rows else [])

    def all_resident(self) -> bool:
        return self.buffer is not None and self.cache.serving.all_resident()

    def clear_misses(self) -> None:
        for m in self.cache.misses:
            m.clear()

    def layer_misses(self) -> list[float]:
        """Each layer's misses per request at the last step."""
        return [float(m[-1].float().mean()) for m in self.cache.misses]

    @property
    def first(self) -> "Stack":
        """The stack whose layer 0 the part timings read (itself; TwoBatch's micro-batch A)."""
        return self


class TwoBatch:
    """One batch as two micro-batches under two-batch overlap (SGLang's `--enable-two-batch-overlap`): stacks of
    B // 2 and B - B // 2 requests sharing the weights, replaying their rows of the batch's top-k, each with its half
    of the cache budget; a step interleaves their stages (module docstring). Stack's interface for the benchmark."""

    def __init__(self, s: Setup, batch: int, context: int, buffer: int | None, rows: int,
                 topk_steps: torch.Tensor | None, warm_sets: torch.Tensor | None, budget: float | None = None,
                 rest=None):
        cut = batch // 2
        self.halves: list[Stack] = []
        for i, part in enumerate([slice(0, cut), slice(cut, batch)]):
            n = part.stop - part.start
            self.halves.append(Stack(
                s, n, context, buffer, rows,
                None if topk_steps is None else topk_steps[:, :, part.start * rows:part.stop * rows].contiguous(),
                None if warm_sets is None else warm_sets[:, part].contiguous(), seed=i,
                budget=None if budget is None else budget * n / batch, rest=rest,
                weights=self.halves[0].w if self.halves else None, tbo=True))
        self.s, self.B, self.S, self.buffer = s, batch, rows, buffer
        self.comm = Comm(s.device, stream=True)
        self.resident = None if self.halves[0].resident is None else sum(h.resident for h in self.halves)

    def step(self, t: int, mode: str) -> list[torch.Tensor]:
        outs = [[], []]
        interleave(*(h.stages(t, mode, self.comm, o) for h, o in zip(self.halves, outs)))
        return [torch.cat(pair) for pair in zip(*outs)]

    @property
    def modes(self) -> list[str]:
        return self.halves[0].modes

    @modes.setter
    def modes(self, modes: list[str]) -> None:
        for h in self.halves:
            h.modes = modes

    @property
    def first(self) -> Stack:
        return self.halves[0]

    def tables(self) -> list[torch.Tensor]:
        return [x for h in self.halves for x in h.tables()]

    def state(self, rows: bool) -> list[torch.Tensor]:
        return [x for h in self.halves for x in h.state(rows)]

    def without_misses(self, t: int) -> None:
        for h in self.halves:
            h.without_misses(t)

    def all_resident(self) -> bool:
        return all(h.all_resident() for h in self.halves)

    def clear_misses(self) -> None:
        for h in self.halves:
            h.clear_misses()

    def layer_misses(self) -> list[float]:
        a, b = (h.layer_misses() for h in self.halves)
        na, nb = self.halves[0].B, self.halves[1].B
        return [(x * na + y * nb) / (na + nb) for x, y in zip(a, b)]


def two_batch(s: Setup, batch: int) -> bool:
    """A batch runs as two micro-batches: under `s.tbo`, from batch 2."""
    return s.tbo and batch >= 2


def make_stack(s: Setup, batch: int, context: int, buffer: int | None, rows: int, topk_steps, warm_sets,
               budget: float | None = None, rest=None):
    """The stack a configuration runs: two micro-batches where two_batch, else one."""
    if two_batch(s, batch):
        return TwoBatch(s, batch, context, buffer, rows, topk_steps, warm_sets, budget, rest)
    return Stack(s, batch, context, buffer, rows, topk_steps, warm_sets, budget=budget, rest=rest)


