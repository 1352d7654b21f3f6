"""SGLang's DSA `Indexer.forward_cuda` for CPU tensors.

SGLang's indexer runs only on CUDA, HIP and XPU (its forward_native raises, and forward_cuda refuses other devices
at its end and reaches CUDA kernels and device-index asserts on the way). This is forward_cuda's eager, single-stream,
unfused path, step for step, calling SGLang's own methods for everything that is plain torch (the projections, norms
and rotary of `_get_q_k_bf16`, the index-K store of `_store_index_k_cache`, the head gates, the init/local-token mask
and the metadata's `topk_transform`) and the CPU path's kernels for the rest: FP8 quantisation of the queries
(act_quant) and the MQA logits over the paged index-K (DeepGEMM's fp8_paged_mqa_logits in decode and verify, its
fp8_mqa_logits over the batch's gathered keys in prefill). The plugin's own hook on forward_cuda (DA / DBA) then
sees the CPU indexer's result exactly as it sees the CUDA one.
"""

from __future__ import annotations

import torch

from ess.core import layout
from ess.core.dsa_math import index_scores
from sglang_ess.cpu import kernels

ROWS_PER_CHUNK = kernels.ROWS_PER_CHUNK


def forward(indexer, x, q_lora, positions, forward_batch, layer_id, return_indices=True, use_cuda_graph=True):
    """Indexer.forward_cuda's contract: store this forward's index keys, return the top-k [tokens, index_topk] int32
    (positions within each request, -1 padded: the un-fused top-k, which the CPU path selects) or None."""
    from sglang.srt.model_executor.forward_context import get_attn_backend

    metadata = get_attn_backend().get_indexer_metadata(layer_id, forward_batch)
    if metadata is None:
        return None
    if indexer._should_skip_logits_computation(forward_batch):  # every position fits the top-k: no logits
        return indexer._forward_cuda_k_only(x, positions, forward_batch, layer_id, kernels.act_quant, metadata,
                                            return_indices)
    query, key, _ = indexer._get_q_k_bf16(q_lora, x, positions, False, forward_batch=forward_batch)
    q_fp8, q_scale = kernels.act_quant(query, indexer.block_size, indexer.scale_fmt)
    indexer._store_index_k_cache(forward_batch=forward_batch, layer_id=layer_id, key=key, act_quant=kernels.act_quant)
    weights = indexer._get_logits_head_gate(x, q_scale)
    if forward_batch.seq_lens.numel() == 0:
        return torch.full((x.shape[0], indexer.index_topk), -1, dtype=torch.int32, device=x.device)
    mode = forward_batch.forward_mode
    if mode.is_decode_or_idle() or mode.is_target_verify() or mode.is_draft_extend_v2():
        return _topk_paged(indexer, forward_batch, layer_id, q_fp8, weights.squeeze(-1), metadata)
    return _topk_ragged(indexer, layer_id, q_fp8, weights.squeeze(-1), metadata)


def _pool():
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    return get_token_to_kv_pool()


def _topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
    """Indexer._get_topk_paged: each query row scores every position of its request's pages."""
    pool = _pool()
    mode = forward_batch.forward_mode
    expanded = mode.is_target_verify() or mode.is_draft_extend_v2()
    lengths = metadata.get_seqlens_expanded() if expanded else metadata.get_seqlens_int32()
    rows = sum(metadata.get_dsa_extend_len_cpu())  # the real query rows (the rest is padding)
    B = metadata.get_seqlens_int32().shape[0]
    per_request = rows // B if B else 0
    keys = kernels.index_rows_of(indexer._get_index_k_read_buffer(pool, layer_id), metadata.get_page_table_64(),
                                 pool.index_page_size)  # [B, T, 132]
    owner = torch.arange(rows, device=q_fp8.device) // max(per_request, 1)
    logits = torch.empty(rows, keys.shape[1], dtype=torch.float32, device=q_fp8.device)
    for s in range(0, rows, ROWS_PER_CHUNK):
        e = min(rows, s + ROWS_PER_CHUNK)
        logits[s:e] = index_scores(q_fp8[s:e].float(), weights[s:e].float(), keys[owner[s:e]])
    indexer._mask_init_and_local_tokens(logits, lengths)
    topk = metadata.topk_transform(logits, indexer.index_topk)
    if rows < q_fp8.shape[0]:
        pad = torch.full((q_fp8.shape[0] - rows, topk.shape[1]), -1, dtype=topk.dtype, device=topk.device)
        topk = torch.cat([topk, pad])
    return topk


def _topk_ragged(indexer, layer_id, q_fp8, weights, metadata):
    """Indexer._get_topk_ragged: the batch's keys gathered in request order, each query row scores its request's span
    [ks, ke) of them (the top-k transform masks the rest)."""
    pool = _pool()
    out = torch.full((q_fp8.shape[0], indexer.index_topk), -1, dtype=torch.int32, device=q_fp8.device)
    block_tables = metadata.get_logical_page_table()
    if len(block_tables) == 0:
        return out
    ks, _ = metadata.get_indexer_kvcache_range()
    lens_cpu = metadata.get_indexer_seq_len_cpu()
    k_fp8, k_scale = pool.get_index_k_scale_buffer(layer_id, metadata.get_indexer_seq_len(), block_tables,
                                                   int(lens_cpu.sum()), int(lens_cpu.max()))
    keys = layout.dequantize_index_k(torch.cat([k_fp8.view(torch.uint8), k_scale.view(torch.uint8)], dim=1))
    rows = ks.shape[0]
    logits = kernels.mqa_logits(q_fp8[:rows], weights[:rows], keys)
    indexer._mask_init_and_local_tokens(logits, metadata.get_seqlens_expanded(), ks)
    out[:rows] = metadata.topk_transform(logits, indexer.index_topk, ks=ks)
    return out
