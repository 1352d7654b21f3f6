"""ESS's hooks on the forward and the requests around it: a prefill batch's admission and staging, each model
forward, the DSA backend's decode and extend calls, the indexer, FlashMLA's decode call (DA's split attention), a
request's release, a disk-tier page lost, and the scheduler's state readout."""

from __future__ import annotations

import dataclasses
import logging

import torch

from sglang_ess.hooks.shared import state
from sglang_ess.pool import DECODE, EXTEND, EssDSATokenToKVPool
from sglang_ess.runtime import request_slot

logger = logging.getLogger("sglang_ess")


# -- prefill: admission and staging ------------------------------------------------------------------------------------
def staged_tokens(req, chunk_left: int | None) -> int:
    """The staging rows a request not yet admitted would take in a prefill batch: positions [0, prefix + chunk), its
    cached prefix (with any host hit) and the rest of its prompt, at most the tokens the batch's chunk has left
    (chunk_left; None: no chunking). An admitted one takes [0, extend_end) (ScheduleBatch's seq_lens)."""
    prefix = req.prefix_len + (req.host_hit_length or 0)
    rest = max(0, len(req.full_untruncated_fill_ids) - prefix)
    return prefix + (rest if chunk_left is None else min(rest, max(0, chunk_left)))


def around_add_one_req(original, adder, req, *a, **kw):
    """The scheduler's prefill admission: a prefill batch stages its requests' rows (prefix and chunk, see
    sglang_ess.pool), and sizing charged the staging buffer for one context. A request that would take the batch past
    it waits for the next batch (SGLang's AddReqResult.OTHER); the first request of a batch always fits (it is at most
    one context)."""
    cap = state.stage_tokens
    if cap is not None and adder.can_run_list:
        staged = sum(r.extend_end for r in adder.can_run_list)
        if staged + staged_tokens(req, adder.rem_chunk_tokens) > cap:
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.OTHER
    return original(adder, req, *a, **kw)


def after_req_to_token_alloc(result, req_pool, reqs, *a, **kw):
    """Request-table rows given to requests: with residency first, each request's reach (its prompt, its most new
    tokens, the verify rows) sizes its region at the next forward (EssRuntime.plan_positions)."""
    rt = state.runtime
    if rt is None or result is None or rt.cache.regions is None or req_pool is not rt.req_pool:
        return result
    for req in reqs:
        slot = request_slot(req)
        if slot is not None:
            new = getattr(req.sampling_params, "max_new_tokens", None)
            reach = len(req.origin_input_ids) + (rt.token_table.shape[1] if new is None else new) + rt.query_rows
            rt.plan_positions(int(slot), reach, req)
    return result


def _ess_pool(backend) -> EssDSATokenToKVPool | None:
    pool = getattr(backend, "token_to_kv_pool", None)
    return pool if isinstance(pool, EssDSATokenToKVPool) else None


def _forward_backend():
    """The attention backend of the forward in flight: SGLang 0.5.23 publishes it in its forward context
    (ForwardBatch has no attn_backend); None outside a forward."""
    from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

    return get_attn_backend() if has_forward_context() else None


def _sending(backend) -> bool:
    """This backend serves the target model of a PD prefill node that sends warm-up state."""
    return state.pd.sender is not None and getattr(backend, "token_to_kv_pool", None) is state.pd.sender_pool


def after_init_forward_metadata(result, backend, forward_batch, *a, **kw):
    """Before layer 0 of a prefill forward: stage its requests' rows (see sglang_ess.pool) and plan their LRU-Warmup.
    A TBO micro-batch is skipped: its parent forward, planned first by SGLang's TBO backend, was staged whole. On a PD
    prefill node (SGLang's pool) only the warm-up windows are planned, for the sender."""
    pool = _ess_pool(backend)
    mode = forward_batch.forward_mode
    sending = _sending(backend)
    if (pool is None and not sending) or not mode.is_extend() or mode.is_target_verify():
        return
    if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
        return
    if pool is not None:
        pool.ess_relabelled = relabelled_decode(forward_batch)
        if pool.ess_relabelled:  # each layer stages the rows its top-k selects (around_forward_extend)
            return
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    prefix_lens = list(forward_batch.extend_prefix_lens_cpu or [0] * len(seq_lens))
    extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
    if sending:
        state.pd.sender.plan(forward_batch.req_pool_indices, seq_lens, extend_lens, backend.use_fused_topk)
        return
    pool.stage_extend(backend.req_to_token, forward_batch.req_pool_indices, seq_lens, prefix_lens)
    if pool.ess_runtime is not None:
        pool.ess_runtime.plan_prefill(forward_batch.req_pool_indices, extend_lens)


def relabelled_decode(forward_batch) -> bool:
    """A decode batch that SGLang's DP attention relabelled as one-token extends (prepare_mlp_sync_batch, so that every
    DP rank presents one shape to the collectives while another rank prefills): its rows are decode steps."""
    mode = forward_batch.forward_mode
    logical = getattr(forward_batch, "logical_forward_mode", mode)
    return mode.is_extend() and logical.is_decode()


def _in_phase(original, backend, phase, *a, **kw):
    pool = _ess_pool(backend)
    if pool is None:
        return original(backend, *a, **kw)
    previous, pool.ess_phase = pool.ess_phase, phase
    try:
        return original(backend, *a, **kw)
    finally:
        pool.ess_phase = previous


# -- each forward, and the DSA backend's calls -------------------------------------------------------------------------
def around_model_forward(original, model_runner, *a, **kw):
    """Each forward of the target model (eager, or a CUDA graph's replay), micro-batches and all: the runtime's
    start_forward / end_forward around it (stale overlap steps dropped; recorded rows drained, outside the graph)."""
    rt = getattr(model_runner, "ess_runtime", None)
    if rt is None:
        return original(model_runner, *a, **kw)
    forward_batch = a[0] if a else kw.get("forward_batch")
    mode = getattr(forward_batch, "forward_mode", None)
    rt.start_forward(decode=mode is not None and (mode.is_decode() or mode.is_target_verify()))
    out = original(model_runner, *a, **kw)
    rt.end_forward()
    return out


def around_forward_decode(original, backend, *a, **kw):
    """A decode call: DA's split attention (EssRuntime.split_attention) applies when the backend attends through
    FlashMLA's interface (SGLang's flashmla_kv decode), whose call the hook below wraps."""
    rt = state.runtime
    if rt is None or _ess_pool(backend) is None:
        return _in_phase(original, backend, DECODE, *a, **kw)
    forward_batch = a[4] if len(a) > 4 else kw.get("forward_batch")
    if forward_batch is not None:  # the new rows' slots and positions, for the resident path's writes
        rt.set_batch(forward_batch.req_pool_indices, forward_batch.positions)
    rt.split_ok = getattr(backend, "dsa_decode_impl", None) == "flashmla_kv"
    try:
        out = _in_phase(original, backend, DECODE, *a, **kw)
    finally:
        rt.split_ok = False
    rt.check_split_taken()
    return out


FLASH_MLA_PARAMS = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                    "num_splits", "softmax_scale")


def around_flash_mla(original, *a, **kw):
    """FlashMLA's decode call: in a split DA step, it is Attn0 (the backend passed the top-k with the misses set to
    -1), and the runtime adds Attn1 over the misses and the merge (EssRuntime.split_attention)."""
    rt = state.runtime
    if rt is None or not rt.split_pending:
        return original(*a, **kw)
    args = dict(zip(FLASH_MLA_PARAMS, a)) | kw
    return rt.split_attention(lambda: original(*a, **kw), args["q"], args.get("softmax_scale"))


def around_forward_extend(original, backend, q, k, v, layer, forward_batch, *a, **kw):
    """MTP target-verify reads the ESS GPU slots like decode; a prefill reads the staging buffer, and its top-k
    (SGLang passes it as the keyword topk_indices) then warms the requests' GPU rows up for decode, or, on a PD
    prefill node, is recorded for the decode node."""
    verify = forward_batch.forward_mode.is_target_verify()
    pool = _ess_pool(backend)
    top_k = kw.get("topk_indices")
    if pool is not None and not verify and pool.ess_relabelled:
        # DP attention's relabelled decode: the step's own rows and the rows its top-k selects, staged for this layer
        # (the requests' GPU slots and LRU state stay as they are: no LRU step, no warm-up)
        pool.stage_selected(backend.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                            layer.layer_id - pool.start_layer, top_k, backend.use_fused_topk)
        return _in_phase(original, backend, EXTEND, q, k, v, layer, forward_batch, *a, **kw)
    if verify and pool is not None and pool.ess_runtime is not None:
        pool.ess_runtime.set_batch(forward_batch.req_pool_indices, forward_batch.positions)
    out = _in_phase(original, backend, DECODE if verify else EXTEND, q, k, v, layer, forward_batch, *a, **kw)
    if _sending(backend) and not verify and top_k is not None:
        positions = ragged_positions(backend, forward_batch, top_k)
        state.pd.sender.record(layer.layer_id, top_k if positions is None else positions,
                               getattr(forward_batch, "tbo_parent_token_range", None), positions=positions is not None)
    if pool is not None and pool.ess_runtime is not None and not verify and top_k is not None:
        to_positions = pool.stage_positions if backend.use_fused_topk else None  # fused: token locations
        token_range = getattr(forward_batch, "tbo_parent_token_range", None)
        pool.ess_runtime.warm_from_prefill(layer.layer_id, top_k, to_positions, token_range)
    return out


def ragged_positions(backend, forward_batch, top_k: torch.Tensor) -> torch.Tensor | None:
    """A prefill top-k that SGLang fused into offsets of the batch's ragged KV (TopkTransformMethod.RAGGED, its FP8
    sparse prefill backends: each request's KV from cu_seqlens_k[request] on, the row's base in the metadata's
    topk_indices_offset), as positions within each request; None for any other top-k (positions, or token locations
    of the PAGED transform)."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    if not backend.use_fused_topk:
        return None
    if backend.get_topk_transform_method(forward_batch.forward_mode) != TopkTransformMethod.RAGGED:
        return None
    base = backend.forward_metadata.topk_indices_offset[: top_k.shape[0]].to(top_k.device).unsqueeze(1)
    return torch.where(top_k >= 0, top_k - base, -1)


INDEXER_PARAMS = ("self", "x", "q_lora", "positions", "forward_batch", "layer_id")


def after_indexer(result, indexer, *a, **kw):
    """Right after a decode/verify layer's indexer: the runtime starts the H2D of the misses (DA / DBA layers), so it
    runs under the rest of forward_absorb_prepare instead of before the attention."""
    rt = state.runtime
    if rt is None or not isinstance(result, torch.Tensor):
        return None
    args = dict(zip(INDEXER_PARAMS[1:], a)) | kw
    forward_batch, layer_id = args["forward_batch"], args["layer_id"]
    mode = forward_batch.forward_mode
    if not (mode.is_decode() or mode.is_target_verify()):
        return None
    if _ess_pool(_forward_backend()) is None:  # the MTP draft worker's forward (its own backend and pool)
        return None
    if not 0 <= layer_id - rt.start_layer < rt.num_layers:
        return None
    rt.begin(layer_id, forward_batch.req_pool_indices, args["positions"], result)
    return None


def around_topk_transform(original, metadata, logits, topk, *a, **kw):
    """--ess-record-lookahead: where the indexer turns its logits into the top-k (decode and verify of the target
    model hand ESS un-fused positions), the runtime also keeps the positions ranked next, for the trace recorder."""
    out = original(metadata, logits, topk, *a, **kw)
    rt = state.runtime
    if rt is None or not rt.ess.record_lookahead or not metadata.force_unfused_topk:
        return out
    if _ess_pool(_forward_backend()) is None:  # another model's indexer (the MTP draft worker's)
        return out
    lengths = kw.get("ke_offset")
    rt.keep_next_ranked(logits, metadata.get_seqlens_expanded() if lengths is None else lengths, out)
    return out


# -- a request's release -----------------------------------------------------------------------------------------------
def around_release_kv_cache(original, req, *a, **kw):
    """SGLang releases a request's KV (finish, abort, retract): ESS lets go of its rows first. Under
    --ess-progressive-pd a request whose transfer still lands keeps its KV until the transfer has ended
    (sglang_ess.pd.landing.ProgressiveDecode.hold); SGLang's queue then reports a pending release
    (after_has_pending_releases), so the scheduler neither idles nor checks for leaks meanwhile."""
    rt, idx = state.runtime, request_slot(req)
    prog = rt.progressive if rt is not None else None
    if prog is not None and idx is not None and prog.landing(int(idx)):
        prog.hold(int(idx), lambda: _release(original, req, a, kw))
        return None
    return _release(original, req, a, kw)


def _release(original, req, a, kw):
    rt, idx = state.runtime, request_slot(req)
    if rt is not None and idx is not None:
        # what SGLang keeps of the request (its radix cache, or a streaming session's row) is read from the host pool
        # later: a resident request's rows go there first (host copies once)
        kept = (kw.get("checkpoint") and not req.skip_radix_cache_insert) or getattr(req, "session", None) is not None
        path = rt.release(int(idx), str(getattr(req, "rid", "")), req.owned_kv_len() if kept else None)
        if path:
            logger.info("ESS trace written: %s", path)
    return original(req, *a, **kw)


# -- a disk-tier page that fails its checksum: its readers aborted, the prefix cache let go ----------------------------
def after_run_batch(result, scheduler, batch, *a, **kw):
    """Right after a forward (the disk tier reads pages on the host while it runs): each request of the batch that read
    a lost row (ess.core.disk_tier, quarantine) ends with that page's error, its output dropped and kept out of the
    prefix cache, as SGLang ends a request whose external KV load failed; the rest of the batch goes on."""
    rt = state.runtime
    tier = rt.cache.tier if rt is not None else None
    if tier is None or not tier.lost_reads or batch is None:
        return None
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in batch.reqs:
        message = tier.lost_reads.get(request_slot(req))
        if message is None or req.finished() or req.discard_output_reason is not None:
            continue
        reason = FINISH_ABORT(f"{message}: the request read KV rows lost with that page and is aborted; the server "
                              "serves on", HTTPStatus.INTERNAL_SERVER_ERROR, "DiskTierError")
        req.skip_radix_cache_insert = True
        req.discard_output_reason = reason  # a prefill's output is dropped
        req.to_finish = reason  # a decode step's
        if scheduler.chunked_req is req:  # its next chunk never runs (SGLang's own path for a failed KV load)
            scheduler._pending_chunked_abort_req = req
        state.lost_readers.append(req)
        logger.error("ESS disk tier: request %s aborted: %s", req.rid, message)
    return None


def before_get_next_batch(scheduler, *a, **kw):
    """Before the scheduler matches new requests against the prefix cache: once every request aborted for a lost row
    is let go, the cache's unlocked prefixes are evicted, so no later request reuses a lost row (a cached prefix is
    recomputed instead; a request still running keeps its rows and is aborted only if it reads a lost one)."""
    if not state.lost_readers or not all(r.kv.is_kv_released for r in state.lost_readers):
        return
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree = scheduler.tree_cache
    evicted = tree.evict(EvictParams(num_tokens=tree.evictable_size())).num_tokens_evicted
    logger.warning("ESS disk tier: %d cached prefix tokens evicted after a lost page", evicted)
    state.lost_readers.clear()


# -- the scheduler's state readout -------------------------------------------------------------------------------------
def after_get_internal_state(result, controller, *a, **kw):
    """The scheduler's state readout (GET /get_server_info, `internal_states`): ESS's step counters and pool, and its
    device bytes as measured from the tensors beside what sizing charged."""
    if state.runtime is not None:
        charged = state.device_charged
        device = {"measured": state.pool.get_kv_size_bytes(),
                  "charged": dataclasses.asdict(charged) | {"total": charged.total}}
        result.internal_state["ess"] = state.runtime.counts() | state.runtime.stats() | {"device": device}
    return None

