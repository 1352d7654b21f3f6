"""DeepSeek Sparse Attention's math over the cache formats of ess.core.layout, in plain torch: the Lightning Indexer's
scores and top-k, sparse MLA over 656-byte latent rows with its log-sum-exp, and the exact merge of two partial
attentions. The reference model (ess.reference.attention) is built from these, and the plugin's CPU path
(sglang_ess.cpu.kernels) computes SGLang's DSA kernels with them. Equal to DeepSeek's official inference code
(docs/design.md, "The reference model"); float32 throughout.
"""

from __future__ import annotations

import functools
import math

import torch

from ess.core import layout


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    """Cached per device: a host-to-device copy inside a decode step could not be captured in a CUDA graph."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d**-0.5).to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The indexer's rotate_activation: a normalised Walsh-Hadamard transform of the last dimension (a power of 2)."""
    return x @ _hadamard_matrix(x.shape[-1], x.device)


def index_scores(q: torch.Tensor, weights: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
    """score[n, t] = sum_h weights[n, h] * ReLU(q[n, h] . k[n, t]) over index-K rows k_rows [N, T, 132]."""
    k = layout.dequantize_index_k(k_rows)
    return (torch.relu(torch.einsum("nhd,ntd->nht", q, k)) * weights.unsqueeze(-1)).sum(1)


def shared_key_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """index_scores for queries q [N, H, D] that all see the same dequantised keys k [T, D]."""
    return (torch.relu(torch.einsum("nhd,td->nht", q, k)) * weights.unsqueeze(-1)).sum(1)


def select_topk(scores: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k token positions [N, k] int32 among positions <= pos [N]; ties go to the lower position; -1 padded."""
    t = torch.arange(scores.shape[1], device=scores.device)
    masked = torch.where(t <= pos.unsqueeze(-1), scores, torch.full_like(scores, -math.inf))
    if masked.shape[1] < k:
        masked = torch.nn.functional.pad(masked, (0, k - masked.shape[1]), value=-math.inf)
    vals, idx = torch.sort(masked, dim=1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    return torch.where(vals > -math.inf, idx, torch.full_like(idx, -1)).to(torch.int32)


def sparse_attention(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float):
    """MLA over latent rows [N, K, 656] where valid [N, K]. Returns (o_latent [N, H, 512], lse [N, H]).

    An empty row set gives o = 0 and lse = -inf, so that partial results merge exactly. Rows outside `valid` are
    zeroed first: in split attention they may be slots whose fetch is still in flight (any bytes, NaN included).
    """
    return sparse_attention_dequantized(q_nope_abs, q_pe, *layout.dequantize_latent(rows), valid, scale)


def sparse_attention_dequantized(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                                 valid: torch.Tensor, scale: float):
    """sparse_attention over rows already dequantised: c_kv [N, K, 512], k_pe [N, K, 64] float32."""
    c_kv = c_kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    k_pe = k_pe.masked_fill(~valid.unsqueeze(-1), 0.0)
    s = (torch.einsum("nhr,nkr->nhk", q_nope_abs, c_kv) + torch.einsum("nhr,nkr->nhk", q_pe, k_pe)) * scale
    s = s.masked_fill(~valid.unsqueeze(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [N, H]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("nhk,nkr->nhr", p, c_kv), lse


def merge_attention(o0: torch.Tensor, lse0: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor):
    """Exact log-sum-exp merge of two partial attentions over disjoint row sets."""
    lse = torch.logaddexp(lse0, lse1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w0 = torch.exp(lse0 - safe).unsqueeze(-1)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    return o0 * w0 + o1 * w1, lse
