"""SGLang's FlashMLA interface (`sglang.kernels.ops.attention.flash_mla_interface`) for the CPU path.

SGLang's module loads FlashMLA's CUDA library when it is imported, which fails without a driver; the CPU path puts
this module in its place (sglang_ess.cpu.install), with the same names and call signatures. It computes the one
FlashMLA kernel that DeepSeek-V3.2's `flashmla_kv` backend calls, the sparse FP8 decode over 656-byte V3.2 rows (the
backend uses it for prefill too), with ess.core.dsa_math: for each query row, attention over the cache rows its
`indices` name (-1 skipped), softmax scale as given, output in the query's dtype, log-sum-exp in natural log
(+inf for a row with no valid entry, as the kernel returns). Scheduling metadata has no meaning here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ess.core import layout
from ess.core.dsa_math import sparse_attention_dequantized

NAME = "sglang.kernels.ops.attention.flash_mla_interface"
ROWS_PER_CALL = 256  # query rows attended at once (bounds the dequantised rows held in memory)


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling metadata: the CPU computation needs none."""

    tile_scheduler_metadata: object = None
    num_splits: object = None


def get_mla_metadata(cache_seqlens=None, num_q_tokens_per_head_k=None, num_heads_k=None, num_heads_q=None,
                     is_fp8_kvcache=False, topk=None):
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table, cache_seqlens, head_dim_v: int,
                           tile_scheduler_metadata, num_splits=None, softmax_scale: Optional[float] = None,
                           causal: bool = False, descale_q=None, descale_k=None, is_fp8_kvcache: bool = False,
                           indices: Optional[torch.Tensor] = None, attn_sink=None, extra_k_cache=None,
                           extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
                           kv_format: Optional[str] = None, *, use_legacy: bool = True):
    """Sparse FP8 decode (V3.2): q [N, s_q, H, 576], k_cache [pages, 64, 1, 656] FP8 rows, indices [N, s_q, K] rows
    of the flattened cache. Returns (o [N, s_q, H, head_dim_v] in q's dtype, lse [N, H, s_q] float32)."""
    unsupported = {"dense decode (indices None)": indices is None, "a BF16 cache": not is_fp8_kvcache,
                   "an attention sink": attn_sink is not None, "an extra cache": extra_k_cache is not None,
                   "topk_length": topk_length is not None, f"KV format {kv_format}": kv_format not in (None, "V32")}
    given = [what for what, on in unsupported.items() if on]
    if given or head_dim_v != layout.NOPE_DIM or q.shape[-1] != layout.NOPE_DIM + layout.ROPE_DIM:
        raise NotImplementedError(f"the CPU path's FlashMLA computes V3.2's sparse FP8 decode only (got {given}, "
                                  f"head_dim_v {head_dim_v}, q width {q.shape[-1]})")
    N, S, H, _ = q.shape
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    pool = k_cache.view(torch.uint8).reshape(-1, layout.LATENT_ROW_BYTES)
    # SGLang pads the heads to the kernel's 64 or 128 with zero queries, whose attention is the plain mean of the
    # valid rows (every score 0): those heads cost no per-head work here
    q3 = q.reshape(N * S, H, -1)
    live = torch.stack([q3[:, h].any() for h in range(H)])
    qf = q3[:, live].float()
    # each row the call reads is dequantised once (a prefill's queries share most of their rows)
    idx = indices.reshape(N * S, -1).long()
    used, where = torch.unique(idx.clamp(min=0), return_inverse=True)
    nope_all, rope_all = layout.dequantize_latent(pool[used])
    o = torch.empty(N * S, H, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(N * S, H, dtype=torch.float32, device=q.device)
    for s in range(0, N * S, ROWS_PER_CALL):
        e = min(N * S, s + ROWS_PER_CALL)
        valid = idx[s:e] >= 0
        nope, rope = nope_all[where[s:e]], rope_all[where[s:e]]
        out, l = sparse_attention_dequantized(qf[s:e, :, : layout.NOPE_DIM], qf[s:e, :, layout.NOPE_DIM:], nope, rope,
                                              valid, scale)
        count = valid.sum(1, keepdim=True)
        mean = nope.masked_fill(~valid.unsqueeze(-1), 0.0).sum(1) / count.clamp(min=1)
        o[s:e] = mean.to(q.dtype).unsqueeze(1)  # every head; the live ones are overwritten
        o[s:e, live] = out.to(q.dtype)
        lse[s:e] = torch.log(count.float())
        lse[s:e, live] = l
        lse[s:e] = torch.where(valid.any(1, keepdim=True), lse[s:e], torch.inf)
    return o.reshape(N, S, H, head_dim_v), lse.reshape(N, S, H).transpose(1, 2)


def flash_mla_sparse_fwd(*args, **kwargs):
    raise NotImplementedError("the CPU path serves DSA with the flashmla_kv backends; FlashMLA's BF16 sparse prefill "
                              "(flashmla_sparse) has no CPU replacement")
