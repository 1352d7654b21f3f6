"""Attention over the ESS GPU pool in split form: Attn0 over the rows already on the GPU (hits and the step's own
row), Attn1 over the rows fetched this step (misses), merged by log-sum-exp. Same result as one attention call over
all selected rows, up to float32 rounding; the overlap engine runs Attn0 while the misses are in flight.
"""

from __future__ import annotations

import torch

from ess.reference import attention as A
from ess.reference.dense_cache import DecodeRows


def split_attention(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, dr: DecodeRows, scale: float) -> torch.Tensor:
    hit = dr.valid if dr.hit is None else dr.hit
    o0, lse0 = A.sparse_attention(q_nope_abs, q_pe, dr.rows, dr.valid & hit, scale)
    o1, lse1 = A.sparse_attention(q_nope_abs, q_pe, dr.rows, dr.valid & ~hit, scale)
    return A.merge_attention(o0, lse0, o1, lse1)[0]
