"""One layer's decode attention with ESS, in the three overlap modes of the brief (section 2).

    none  indexer, top-k, cache update, H2D of misses, wait, attention (one call over all selected rows)
    da    indexer, top-k, cache update; the H2D starts on the copy stream while PreAttn and Attn0 (the rows already
          on the GPU: hits and the own row) run; then wait, Attn1 (the fetched rows) and the log-sum-exp merge
    dba   the indexer, top-k and cache update run per batch half: half A's H2D overlaps half B's indexer; then as da
Attn1 (attn1, ess.core.settings.DA_ATTN1_KINDS): "miss" the compact kernel over each request's compacted miss list
(ess.core.kernels.miss_attention); "fused" the misses' H2D and Attn1 as one kernel on the copy stream, beside Attn0 (it needs
the query, so the copy starts after PreAttn); "calls" a second full-width call with the hits set to -1. Attn0 is the
attention backend over the top-k with the misses set to -1 in all three.
The step's own row is written to its GPU slot on the compute stream and backed up to the host (D2H) on the copy
stream in every mode. On the CPU the streams run in program order, so the same code computes the same values.
Every step has fixed shapes and no host synchronisation.

Under two-batch overlap (`ess_layer_stages`, tbo=True: the layer is one micro-batch's, docs/gpu.md "Two-batch
overlap") the layer yields once, where SGLang's two-batch overlap yields between attention's prepare and core: after
the misses' H2D is launched (or, in none, done). There dba is the micro-batch's whole H2D on the copy stream under
the other micro-batch's stage, then one attention call once it has landed (the micro-batch is already the half).
"""

from __future__ import annotations

import torch

from ess.reference.ess_cache import EssLatentCache
from ess.reference.flashmla import sparse_decode, split_decode
from ess.core.kernels import miss_attention
from ess.core.policy import PolicyResult
from ess.core.settings import DA_ATTN1, DA_ATTN1_KINDS, OVERLAP_MODES
from ess.reference import attention as A
from ess.reference.config import ModelConfig
from ess.reference.stages import drain

MODES = OVERLAP_MODES


def _cat(parts: list[PolicyResult]) -> PolicyResult:
    if len(parts) == 1:
        return parts[0]
    cat = lambda f: None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts])
    return PolicyResult(*(cat(f) for f in PolicyResult.__dataclass_fields__))


def batch_parts(batch: int, mode: str) -> list[slice]:
    if mode == "dba" and batch > 1:
        return [slice(0, batch // 2), slice(batch // 2, batch)]
    return [slice(0, batch)]


def ess_layer_attention(mode: str, w: A.AttentionWeights, cfg: ModelConfig, h, q_lora, pos, index_k_layer,
                        cache: EssLatentCache, layer: int, attention: str = "reference", selected=None,
                        attn1: str = DA_ATTN1):
    """Returns (o_latent [B, H, 512], topk [B, K]). The cache's stamp must be set (cache.set_step).
    attention: the sparse MLA backend of ess.reference.flashmla ("reference", "flashmla" or "auto").
    selected [B, K]: top-k to use instead of the indexer's (a replayed trace); the indexer still runs, for its cost.
    attn1: DA / DBA's Attn1 (module docstring)."""
    return drain(ess_layer_stages(mode, w, cfg, h, q_lora, pos, index_k_layer, cache, layer, attention, selected, attn1))


def ess_layer_stages(mode: str, w: A.AttentionWeights, cfg: ModelConfig, h, q_lora, pos, index_k_layer,
                     cache: EssLatentCache, layer: int, attention: str = "reference", selected=None,
                     attn1: str = DA_ATTN1, tbo: bool = False):
    """ess_layer_attention as a generator: it yields once, after the misses' H2D is launched, and returns (o_latent,
    topk) (`yield from`). tbo: one micro-batch of two-batch overlap (module docstring: dba there)."""
    if mode not in MODES:
        raise ValueError(f"overlap mode must be one of {MODES}, got {mode!r}")
    if attn1 not in DA_ATTN1_KINDS:
        raise ValueError(f"Attn1 kind must be one of {DA_ATTN1_KINDS}, got {attn1!r}")
    tbo_dba = tbo and mode == "dba"  # the whole H2D under the other micro-batch's stage, then one call
    fused = mode != "none" and attn1 == "fused" and not tbo_dba
    streams = cache.streams
    own_rows = A.kv_latent_rows(w, cfg, h, pos)

    def indexer(part=slice(None)):
        topk = A.indexer_topk(w, cfg, h, q_lora, pos, index_k_layer, part)
        return topk if selected is None else selected[part]

    one_call = mode == "none" or tbo_dba  # one attention call over every selected row
    if mode == "none":  # the serial order, on the compute stream (ServingLatentCache.translate)
        topk = indexer()
        r = cache.translate(layer, topk, pos, own_rows)
    else:
        topks, results = [], []
        for part in [slice(None)] if tbo else batch_parts(h.shape[0], mode):
            topk = indexer(part)
            r = cache.update(layer, topk, pos[part], part)
            # the copy stream runs in order: the last part's event covers every H2D of the step
            if not fused:  # fused: the copy is Attn1's, below
                fetched = streams.copy_after(lambda: cache.fetch(layer, r, part, overlapped=True), r.miss_pos, r.miss_slot)
            topks.append(topk)
            results.append(r)
        r = _cat(results)
        topk = torch.cat(topks)
        cache.store_own(layer, r, own_rows)
    yield  # two-batch overlap: the other micro-batch's stage runs here, beside the H2D
    backed_up = cache.backup_own(layer, r, pos)  # D2H overlaps PreAttn and the attention below
    cache.record(layer, r)
    q_nope_abs, q_pe = A.pre_attn(w, cfg, q_lora, pos)
    pool, scale = cache.serving.gpu[layer], cfg.softmax_scale
    if one_call:
        if mode != "none":
            streams.wait(fetched)
        o, _ = sparse_decode(q_nope_abs, q_pe, pool, r.attn_slot, scale, attention)
    elif attn1 == "calls":  # Attn0 over hits and the own row, wait for the H2D, Attn1 a second full-width call
        o, _ = split_decode(q_nope_abs, q_pe, pool, r.attn_slot, r.hit, scale, lambda: streams.wait(fetched), attention)
    else:
        if fused:  # the misses land and are attended on the copy stream while Attn0 runs
            part1 = {}
            fetched = streams.copy_after(
                lambda: part1.update(o=cache.fetch_attend(layer, r, q_nope_abs, q_pe, scale)),
                q_nope_abs, q_pe, r.miss_pos, r.miss_slot, r.n_miss)
        o0, lse0 = sparse_decode(q_nope_abs, q_pe, pool, torch.where(r.hit, r.attn_slot, -1), scale, attention)
        streams.wait(fetched)
        o1, lse1 = part1["o"] if fused else cache.attend_misses(layer, r, q_nope_abs, q_pe, scale)
        o, _ = miss_attention.merge(o0, lse0, o1, lse1)
    streams.wait(backed_up)
    return o, topk
