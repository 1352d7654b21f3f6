"""Torch implementations of the kernels SGLang 0.5.23 calls for DeepSeek-V3.2's sparse attention, for CPU tensors.

Each keeps the contract of the SGLang kernel it stands for (named beside it; the tests run SGLang's own Triton kernels
under Triton's interpreter against these). The math of the indexer and of the sparse attention is ess.core.dsa_math,
equal to DeepSeek's official inference code. These run on a CPU only (sglang_ess.cpu.patches routes CUDA tensors to
SGLang's kernels), so clarity wins over speed; every loop is over chunks of rows, bounding the memory a step holds.
"""

from __future__ import annotations

import torch

from ess.core import layout
from ess.core.dsa_math import hadamard, shared_key_scores

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ROWS_PER_CHUNK = 256  # query rows scored at once by the indexer's logits


# -- sglang.kernels.ops.quantization.act_quant_triton.act_quant ----------------------------------------------------
def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None):
    """Block-wise FP8 quantisation of the last dimension: per block of `block_size` values amax = max(|x|, 1e-4),
    scale = amax / 448, rounded up to a power of two when scale_fmt is given (ue8m0); y = clamp(x / scale, +-448) in
    float8_e4m3fn. Returns (y like x, scales [..., D / block_size] float32)."""
    lead, D = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(*lead, D // block_size, block_size)
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    scale = amax * (1.0 / FP8_MAX)
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return y.reshape(x.shape), scale


# -- sglang.kernels.ops.quantization.dsa_quant_k_cache.quantize_k_cache_separate -----------------------------------
def quantize_k_cache_separate(k_nope: torch.Tensor, k_rope: torch.Tensor, tile_size: int = 128):
    """The FP8 latent rows' two parts: (nope_part [T, 1, 512 + 4 x 4] uint8: FP8 values then one float32 scale per
    128-value tile, scale = amax / 448 without an epsilon and q = clamp(x * (1 / scale), +-448); rope_part [T, 1, 128]
    uint8: the BF16 RoPE values' bytes)."""
    nope = (k_nope.squeeze(1) if k_nope.dim() == 3 else k_nope).float()
    rope = k_rope.squeeze(1) if k_rope.dim() == 3 else k_rope
    T, D = nope.shape
    tiles = nope.reshape(T, D // tile_size, tile_size)
    scale = tiles.abs().amax(dim=-1) / FP8_MAX
    q = (tiles * (1.0 / scale).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    nope_part = torch.cat([q.reshape(T, D).view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(T, -1)], 1)
    rope_part = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(T, -1)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


# -- sglang.kernels.ops.kvcache.dsa_index_k_cache: SetKAndS / GetKAndS ----------------------------------------------
def _index_page_parts(buf: torch.Tensor, page_size: int, head_dim: int):
    """SGLang's index-K pages [pages, page_size x (head_dim + 4)] bytes as (values [pages, page_size, head_dim],
    scale bytes [pages, page_size, 4]): per page, every token's values, then every token's float32 scale."""
    values = buf[:, : page_size * head_dim].view(buf.shape[0], page_size, head_dim)
    scales = buf[:, page_size * head_dim :].view(buf.shape[0], page_size, 4)
    return values, scales


def set_k_and_s(cls, pool, buf: torch.Tensor, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale: torch.Tensor):
    """Write tokens' FP8 index keys [T, 128] and float32 scales [T] or [T, 1] at token locations loc [T]."""
    page = pool.index_page_size
    values, scales = _index_page_parts(buf, page, index_k.shape[-1])
    loc = loc.long()
    values[loc // page, loc % page] = index_k.view(torch.uint8)
    scales[loc // page, loc % page] = index_k_scale.float().reshape(-1, 1).contiguous().view(torch.uint8)


def get_k_and_s(cls, pool, buf: torch.Tensor, page_indices: torch.Tensor, seq_len_tensor: torch.Tensor,
                seq_len_sum: int, max_seq_len: int):
    """The index keys of requests' first seq_len tokens, concatenated in batch order: (values [seq_len_sum, 128]
    uint8, scale bytes [seq_len_sum, 4] uint8). page_indices [B, pages]: each request's page table."""
    page = pool.index_page_size
    values, scales = _index_page_parts(buf, page, pool.index_head_dim)
    lens = seq_len_tensor.long()
    owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=seq_len_sum)
    pos = torch.arange(seq_len_sum, device=lens.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens,
                                                                                  output_size=seq_len_sum)
    pages = page_indices.long()[owner, pos // page]
    return values[pages, pos % page], scales[pages, pos % page]


# -- sglang.kernels.ops.quantization.hadamard.hadamard_transform, as dsa_indexer.rotate_activation calls it ----------
def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh-Hadamard transform of the last dimension, in x's dtype."""
    return hadamard(x.float()).to(x.dtype)


# -- sglang.kernels.ops.attention.dsa.transform_index ----------------------------------------------------------------
def transform_index_page_table_decode(page_table: torch.Tensor, topk_indices: torch.Tensor, result=None,
                                      page_size: int = 1) -> torch.Tensor:
    """Row i's top-k positions -> their token locations page_table[i, position]; -1 stays -1."""
    valid = topk_indices >= 0
    loc = torch.gather(page_table, 1, topk_indices.long().clamp(min=0))
    out = torch.where(valid, loc, -1).to(torch.int32)
    if result is None:
        return out
    result.copy_(out)
    return result


def transform_index_page_table_prefill(page_table: torch.Tensor, topk_indices: torch.Tensor, extend_lens_cpu,
                                       page_size: int = 1, output_num_tokens=None, page_table_is_expanded: bool = False,
                                       cu_seqlens_q=None) -> torch.Tensor:
    """Each query row's top-k positions -> token locations through its request's page table row (or, expanded, its
    own row); rows past the batch's tokens (up to output_num_tokens) are -1."""
    real = int(sum(extend_lens_cpu))
    total = real if output_num_tokens is None else output_num_tokens
    result = torch.full((total, topk_indices.shape[1]), -1, dtype=torch.int32, device=topk_indices.device)
    if real == 0:
        return result
    lens = torch.tensor(list(extend_lens_cpu), device=topk_indices.device)
    rows = torch.arange(real, device=topk_indices.device) if page_table_is_expanded else \
        torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=real)
    idx = topk_indices[:real].long()
    loc = page_table[rows.unsqueeze(1), idx.clamp(min=0)]
    result[:real] = torch.where(idx >= 0, loc, -1).to(torch.int32)
    return result


# -- the Lightning Indexer's logits (DeepGEMM's fp8_paged_mqa_logits / fp8_mqa_logits) ------------------------------
def index_rows_of(buf: torch.Tensor, page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token's 132-byte index-K row [B, pages x page_size, 132] through page tables [B, pages] (-1 pages read
    page 0: their positions lie past the request and the top-k masks them)."""
    pages = buf[page_table.long().clamp(min=0)]  # [B, P, page bytes]
    B, P = page_table.shape
    return layout.index_k_pages_to_rows(pages.reshape(B * P, -1)).reshape(B, P * page_size, layout.INDEX_ROW_BYTES)


def mqa_logits(q_fp8: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits[r, t] = sum_h weights[r, h] x ReLU(q[r, h] . keys[t]) for query rows q_fp8 [R, H, 128] (FP8 values; their
    scales are in the weights, as SGLang folds them) over dequantised keys [T, 128], in chunks of rows."""
    out = torch.empty(q_fp8.shape[0], keys.shape[0], dtype=torch.float32, device=q_fp8.device)
    for s in range(0, q_fp8.shape[0], ROWS_PER_CHUNK):
        e = min(q_fp8.shape[0], s + ROWS_PER_CHUNK)
        out[s:e] = shared_key_scores(q_fp8[s:e].float(), weights[s:e].float(), keys)
    return out


# -- sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func (its CPU build's assign_req_to_token_pool_cpu) ----
def assign_req_to_token_pool(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                             end_offset: torch.Tensor, out_cache_loc: torch.Tensor, batch_size: int) -> None:
    """Request i's positions [start_i, end_i) take the next end_i - start_i locations of out_cache_loc, in batch
    order."""
    owner, pos, n = _spans(start_offset[:batch_size], end_offset[:batch_size])
    req_to_token[req_pool_indices[:batch_size].long()[owner], pos] = out_cache_loc[:n].to(req_to_token.dtype)


def _spans(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows [start_i, end_i) of every request i, in batch order: (owner request, position) per row, and the count."""
    lens = (end - start).long()
    n = int(lens.sum())
    owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=n)
    first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=n)
    return owner, start.long()[owner] + torch.arange(n, device=lens.device) - first, n


# -- sglang.kernels.ops.speculative.cache_locs (their CPU build's _cpu ops) -------------------------------------------
def assign_draft_cache_locs_contiguous(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                       seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, topk: int, num_cols: int,
                                       positions=None, mrope=None) -> None:
    """Request i's topk x num_cols locations from position seq_lens[i] on, into out_cache_loc's i-th block; the
    draft positions (seq_lens[i], topk times) into positions and each axis of mrope where given."""
    bs, width = seq_lens.shape[0], topk * num_cols
    cols = seq_lens.long().unsqueeze(1) + torch.arange(width, device=seq_lens.device)
    out_cache_loc.view(bs, width)[:] = req_to_token[req_pool_indices.long().unsqueeze(1), cols].to(out_cache_loc.dtype)
    draft = seq_lens.unsqueeze(1).expand(bs, topk)
    if positions is not None:
        positions.view(bs, topk)[:] = draft.to(positions.dtype)
    if mrope is not None:
        mrope.view(3, bs, topk)[:] = draft.to(mrope.dtype)


def assign_extend_cache_locs(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                             end_offset: torch.Tensor, batch_size: int, draft_token_num: int, device) -> torch.Tensor:
    """The locations of request i's positions [start_i, end_i), concatenated in batch order (int64, batch_size x
    draft_token_num entries; those past the spans are left unset, as the kernel leaves them)."""
    out = torch.empty(batch_size * draft_token_num, dtype=torch.int64, device=device)
    owner, pos, n = _spans(start_offset[:batch_size], end_offset[:batch_size])
    out[:n] = req_to_token[req_pool_indices.long()[owner], pos].long()
    return out


# -- sglang.kernels.ops.attention.pad.seqlens_expand_triton ----------------------------------------------------------
def seqlens_expand(extend_seq_lens: torch.Tensor, seq_lens: torch.Tensor, total_len: int, max_q_len: int):
    """Each query row's causal length: request i's extend_seq_lens[i] rows see seq_lens[i] - q + 1 + j tokens (row j,
    at least 0), concatenated in batch order (int32, total_len entries)."""
    q = extend_seq_lens.long()
    owner = torch.repeat_interleave(torch.arange(q.shape[0], device=q.device), q, output_size=total_len)
    j = torch.arange(total_len, device=q.device) - torch.repeat_interleave(torch.cumsum(q, 0) - q, q, output_size=total_len)
    return (seq_lens.long()[owner] - q[owner] + 1 + j).clamp(min=0).to(torch.int32)
