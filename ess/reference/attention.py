"""Reference DeepSeek-V3.2 attention for decode (DSA: Lightning Indexer + sparse MLA), plain PyTorch.

The steps are separate functions so that the overlap engine can reorder them:
    q_lora_of            shared low-rank query (q_a_proj + norm), used by both branches
    pre_attn             PreAttn: q_b_proj, w_kc absorption, RoPE  (independent of the indexer)
    index_query / index_key_rows / index_scores / select_topk      the Indexer and top-k
    kv_latent_rows       the step's own 656-byte latent row (kv_a_proj + norm + RoPE, quantised)
    sparse_attention     MLA over the selected latent rows, returning the log-sum-exp for split/merge
    merge_attention      log-sum-exp merge of two partial attentions (Attn0 + Attn1)
    attn_output          w_vc and o_proj
Everything computes in float32 for clarity and CPU determinism; the caches hold the real FP8 formats.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ess.core import layout
from ess.core.dsa_math import (  # noqa: F401  (the reference's own names for them)
    hadamard,
    index_scores,
    merge_attention,
    select_topk,
    shared_key_scores,
    sparse_attention,
)
from ess.core.kernels.indexer import indexer_topk_fp8
from ess.reference.config import ModelConfig


@dataclasses.dataclass
class AttentionWeights:
    q_a: torch.Tensor  # [q_lora, hidden]
    q_a_norm: torch.Tensor  # [q_lora]
    q_b: torch.Tensor  # [H * (nope + rope), q_lora]
    kv_a: torch.Tensor  # [kv_lora + rope, hidden]
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_kc: torch.Tensor  # [H, nope, kv_lora]
    w_vc: torch.Tensor  # [H, kv_lora, v]
    o_proj: torch.Tensor  # [hidden, H * v]
    idx_wq_b: torch.Tensor  # [index_heads * index_dim, q_lora]
    idx_wk: torch.Tensor  # [index_dim, hidden]
    idx_k_norm: torch.Tensor  # [index_dim] LayerNorm weight
    idx_k_norm_bias: torch.Tensor  # [index_dim] LayerNorm bias (zeros where a checkpoint has none)
    idx_weights_proj: torch.Tensor  # [index_heads, hidden]

    @staticmethod
    def random(cfg: ModelConfig, gen: torch.Generator, device: torch.device | str = "cpu") -> "AttentionWeights":
        def lin(out_f: int, in_f: int) -> torch.Tensor:
            return torch.randn(out_f, in_f, generator=gen) * in_f**-0.5

        H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        w = AttentionWeights(
            q_a=lin(cfg.q_lora_rank, cfg.hidden),
            q_a_norm=torch.ones(cfg.q_lora_rank),
            q_b=lin(H * (dn + dr), cfg.q_lora_rank),
            kv_a=lin(r + dr, cfg.hidden),
            kv_a_norm=torch.ones(r),
            w_kc=torch.randn(H, dn, r, generator=gen) * dn**-0.5,
            w_vc=torch.randn(H, r, dv, generator=gen) * r**-0.5,
            o_proj=lin(cfg.hidden, H * dv),
            idx_wq_b=lin(cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank),
            idx_wk=lin(cfg.index_head_dim, cfg.hidden),
            idx_k_norm=torch.ones(cfg.index_head_dim),
            idx_k_norm_bias=torch.zeros(cfg.index_head_dim),
            idx_weights_proj=lin(cfg.index_heads, cfg.hidden),
        )
        return AttentionWeights(**{f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)})


K_NORM_EPS = 1e-6  # the indexer's k_norm LayerNorm, as the official code (torch's default, 1e-5, differs at small keys)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@functools.lru_cache(maxsize=8)
def rope_freqs(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The rotary frequencies [qk_rope_head_dim / 2] float32, every RoPE call site's one table (cached per device, so
    nothing is copied inside a captured step). Under YaRN (cfg.yarn) the official precompute_freqs_cis's correction:
    dimensions rotating fewer than beta_slow times over original_seq_len positions are divided by rope_factor, those
    rotating more than beta_fast times are kept, a linear ramp in between. The angle at position p is p * freqs."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if cfg.yarn:
        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in original_seq_len
            return d * math.log(cfg.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_of(cfg.beta_fast)), 0)
        high = min(math.ceil(dim_of(cfg.beta_slow)), d - 1)
        smooth = 1 - ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth  # the official expression, rounding included
    return freqs.to(device)


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [..., D] at integer positions pos (broadcast over x's leading dims but the last), with
    the frequencies of rope_freqs."""
    d = x.shape[-1]
    ang = pos.to(torch.float32).unsqueeze(-1) * freqs  # [..., D/2]
    cos, sin = ang.cos(), ang.sin()
    if interleaved:  # pairs (x[2i], x[2i+1]): DeepSeek MLA's layout (is_neox_style=False)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]  # halves: the V3.2 indexer's layout
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Per-row (last dim) ue8m0 FP8 quantisation and back, as the indexer's act_quant does to its queries."""
    return layout.dequantize_index_k(layout.quantize_index_k(x))


def q_lora_of(w: AttentionWeights, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x @ w.q_a.T, w.q_a_norm)


def pre_attn(w: AttentionWeights, cfg: ModelConfig, q_lora: torch.Tensor, pos: torch.Tensor):
    """PreAttn: q_b_proj, the absorbed w_kc bmm and RoPE. Returns (q_nope_absorbed [N,H,512], q_pe [N,H,64])."""
    q = (q_lora @ w.q_b.T).view(-1, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    # the products in the weights' dtype (bf16 weights: a server's speed), the results float32 as attention reads them
    q_nope_abs = torch.einsum("nhd,hdr->nhr", q_nope, w.w_kc).float()
    return q_nope_abs, rope(q_pe.float(), pos.unsqueeze(-1), rope_freqs(cfg, q_pe.device), interleaved=True)


def kv_latent_rows(w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The 656-byte latent rows [N, 656] of tokens x [N, hidden] at positions pos [N]."""
    kv = x @ w.kv_a.T
    c_kv, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return layout.quantize_latent(rms_norm(c_kv, w.kv_a_norm), rope(k_pe, pos, rope_freqs(cfg, k_pe.device), interleaved=True))


def index_key_rows(w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The 132-byte index-K rows [N, 132]."""
    k = torch.nn.functional.layer_norm(x @ w.idx_wk.T, (cfg.index_head_dim,), w.idx_k_norm, w.idx_k_norm_bias, K_NORM_EPS)
    k_pe, k_nope = k.split([cfg.qk_rope_head_dim, cfg.index_head_dim - cfg.qk_rope_head_dim], dim=-1)
    k = torch.cat([rope(k_pe, pos, rope_freqs(cfg, k_pe.device), interleaved=False), k_nope], dim=-1)
    return layout.quantize_index_k(hadamard(k))


def index_query(w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, q_lora: torch.Tensor, pos: torch.Tensor):
    """Indexer queries [N, Hi, 128] (through FP8, as the real kernel sees them) and head weights [N, Hi]."""
    q = (q_lora @ w.idx_wq_b.T).float().view(-1, cfg.index_heads, cfg.index_head_dim)  # float32 past the product
    q_pe, q_nope = q.split([cfg.qk_rope_head_dim, cfg.index_head_dim - cfg.qk_rope_head_dim], dim=-1)
    q = torch.cat([rope(q_pe, pos.unsqueeze(-1), rope_freqs(cfg, q_pe.device), interleaved=False), q_nope], dim=-1)
    q = fp8_round_trip(hadamard(q))
    weights = (x @ w.idx_weights_proj.T).float() * (cfg.index_heads**-0.5 * cfg.index_head_dim**-0.5)
    return q, weights


def attn_output(w: AttentionWeights, o_latent: torch.Tensor) -> torch.Tensor:
    """w_vc then o_proj: [N, H, 512] -> [N, hidden]."""
    return torch.einsum("nhr,hrv->nhv", o_latent, w.w_vc).flatten(1) @ w.o_proj.T


def indexer_topk(w: AttentionWeights, cfg: ModelConfig, h, q_lora, pos, index_k_layer, part: slice = slice(None),
                 lookahead: int = 0):
    """The Lightning Indexer and top-k of decode queries, for the batch rows in `part` (their index-K rows, the
    step's own included, already in index_k_layer [B, T, 132]). lookahead d > 0: the best K + d positions, best first
    (the first K are the top-k)."""
    q_idx, weights = index_query(w, cfg, h[part], q_lora[part], pos[part])
    k = cfg.index_topk + lookahead
    if index_k_layer.is_cuda:  # a GPU times it: the Triton kernel over the FP8 rows in place, equal to the math below
        # up to fp32 summation order (ess.core.kernels.indexer); q_idx went through FP8, so bf16 holds it exactly
        return indexer_topk_fp8(q_idx.to(torch.bfloat16), weights, index_k_layer[part], pos[part], k, backend="triton")
    return select_topk(index_scores(q_idx, weights, index_k_layer[part]), pos[part], k)


def prefill_topk(q: torch.Tensor, weights: torch.Tensor, k_rows: torch.Tensor, k: int, chunk: int = 256) -> torch.Tensor:
    """Causal top-k sets [L, k] of every prefill query of one request (queries q [L, Hi, 128], keys k_rows [L, 132])."""
    L = q.shape[0]
    keys = layout.dequantize_index_k(k_rows)
    out = []
    for s in range(0, L, chunk):
        e = min(L, s + chunk)
        scores = shared_key_scores(q[s:e], weights[s:e], keys)
        out.append(select_topk(scores, torch.arange(s, e, device=q.device), k))
    return torch.cat(out)


def prefill_attention(q_nope_abs, q_pe, rows: torch.Tensor, topk: torch.Tensor, scale: float, chunk: int = 256):
    """Sparse MLA of every prefill query over its own top-k set, from the request's rows [L, 656]."""
    L = rows.shape[0]
    c_kv, k_pe = layout.dequantize_latent(rows)
    out = []
    for s in range(0, L, chunk):
        e = min(L, s + chunk)
        sel = torch.zeros(e - s, L + 1, dtype=torch.bool, device=rows.device)
        sel.scatter_(1, torch.where(topk[s:e] >= 0, topk[s:e].long(), L), True)
        scores = (torch.einsum("lhr,tr->lht", q_nope_abs[s:e], c_kv) + torch.einsum("lhr,tr->lht", q_pe[s:e], k_pe)) * scale
        p = torch.softmax(scores.masked_fill(~sel[:, :L].unsqueeze(1), -math.inf), dim=-1)
        out.append(torch.einsum("lht,tr->lhr", p, c_kv))
    return torch.cat(out)
