"""Sparse MLA decode over a latent pool by row indices: FlashMLA's kernel on a GPU, its torch reference elsewhere.

The kernel SGLang 0.5.23 runs for DeepSeek-V3.2 decode is FlashMLA's legacy sparse FP8 decode (SM90, the V3.2
656-byte row format of ess.core.layout), shipped in the `sgl-flash-mla` wheel. It reads the pool as [-1, 64, 1, 656]
pages (ESS's GPU pools are whole 64-row pages) and, per query row, a fixed-width list of row indices where -1 means
"skip". Both backends compute the same function:

    o[n, h] = softmax_k(scale * <q[n, h], row(idx[n, k])>) @ nope(idx[n, k])     over the entries idx[n, k] >= 0
    lse[n, h] = log-sum-exp of those scores (natural log; -inf when no entry is valid)

Found on an H100 (docs/gpu.md): the V3.2 format takes no `topk_length` (the kernel asserts "V3.2 does not support
dynamic topk length"), so an Attn0 / Attn1 split is two full-width calls, each with -1 for the other part's entries.
"""

from __future__ import annotations

import functools

import torch

from ess.core import layout
from ess.core.kernels import miss_attention
from ess.core.settings import PAGE_TOKENS
from ess.reference import attention as A

PAGE = PAGE_TOKENS
HEAD_DIM_V = layout.NOPE_DIM  # 512


@functools.lru_cache(maxsize=1)
def _flash_mla():
    try:
        import flash_mla
    except ImportError:
        return None
    return flash_mla if flash_mla.has_legacy() else None


def available() -> bool:
    """FlashMLA's legacy (SM90, V3.2 format) kernels are importable and a CUDA device is present."""
    return torch.cuda.is_available() and _flash_mla() is not None


def _backend(backend: str, pool: torch.Tensor) -> str:
    if backend == "auto":
        return "flashmla" if pool.is_cuda and available() else "reference"
    if backend not in ("flashmla", "reference"):
        raise ValueError(f"attention backend must be 'auto', 'flashmla' or 'reference', got {backend!r}")
    if backend == "flashmla" and not (pool.is_cuda and available()):
        raise RuntimeError("attention backend 'flashmla' needs a CUDA pool and the sgl-flash-mla wheel (legacy kernels)")
    return backend


def sparse_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, scale: float,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope [N, H, 512] and q_pe [N, H, 64] (the absorbed query of N query rows), pool [R, 656] uint8 latent rows
    (R a multiple of 64 for the kernel), idx [N, K] row indices (-1: skip). Returns (o [N, H, 512] float32,
    lse [N, H] float32; o = 0 and lse = -inf for a row without valid entries). FlashMLA takes the query in bf16 and
    returns o in bf16; the reference keeps q's precision."""
    if pool.dim() != 2 or pool.shape[1] != layout.LATENT_ROW_BYTES or pool.dtype != torch.uint8:
        raise ValueError(f"latent pool must be uint8 [rows, {layout.LATENT_ROW_BYTES}], got {pool.dtype} {tuple(pool.shape)}")
    if _backend(backend, pool) == "reference":
        return A.sparse_attention(q_nope, q_pe, pool[idx.long().clamp(min=0)], idx >= 0, scale)
    if pool.shape[0] % PAGE:
        raise ValueError(f"FlashMLA reads whole {PAGE}-row pages; the pool has {pool.shape[0]} rows")
    fm = _flash_mla()
    q = torch.cat([q_nope, q_pe], dim=-1).to(torch.bfloat16).unsqueeze(1)  # [N, 1, H, 576]
    meta, _ = fm.get_mla_metadata()
    o, lse = fm.flash_mla_with_kvcache(
        q, pool.view(-1, PAGE, 1, layout.LATENT_ROW_BYTES), None, None, HEAD_DIM_V, meta, softmax_scale=scale,
        indices=idx.to(torch.int32).unsqueeze(1), is_fp8_kvcache=True, use_legacy=True,
    )
    # A row with no valid entry: whatever the kernel returns there (see docs/gpu.md), the contract is o = 0 and
    # lse = -inf, so that split parts merge exactly.
    empty = (idx < 0).all(1)
    o = torch.where(empty[:, None, None], 0.0, o[:, 0].float())
    return o, torch.where(empty[:, None], -torch.inf, lse[:, :, 0])


def split_decode(q_nope, q_pe, pool, idx, hit, scale, before_attn1=lambda: None, backend: str = "auto"):
    """DA's split: Attn0 over the entries already on the GPU (hit), then before_attn1() (wait for the misses' H2D),
    Attn1 over the rest, merged by log-sum-exp. Equals one call over all entries up to rounding."""
    none = torch.full_like(idx, -1)
    o0, lse0 = sparse_decode(q_nope, q_pe, pool, torch.where(hit, idx, none), scale, backend)
    before_attn1()
    o1, lse1 = sparse_decode(q_nope, q_pe, pool, torch.where(hit, none, idx), scale, backend)
    return miss_attention.merge(o0, lse0, o1, lse1)
