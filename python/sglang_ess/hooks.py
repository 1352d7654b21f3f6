"""Where ESS hooks into SGLang 0.5.23: one table of (target, hook type, hook), registered through SGLang's own
HookRegistry. Every hook is a no-op unless the server was launched with --enable-ess. The test suite resolves every
target in the installed sglang and checks the parameters each hook relies on, so an upstream rename fails a test.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from sglang_ess import args as ess_args_mod
from sglang_ess import cpu, pd_progressive, pd_warmup, progressive, sizing
from ess.core.landing import LandingTracker
from ess.core.settings import PROGRESSIVE_REQUESTS
from sglang_ess.args import EssArgs
from sglang_ess.pool import DECODE, EXTEND, EssDSATokenToKVPool, pool_class
from sglang_ess.runtime import EssRuntime
from sglang_ess.validate import MIB, check_device, resolution_step, runtime_facts

logger = logging.getLogger("sglang_ess")

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
INDEXER_METADATA = "sglang.srt.layers.attention.dsa.dsa_indexer_metadata.DSAIndexerMetadata"
KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"
PREFILL_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
METADATA_BUFFERS = "sglang.srt.disaggregation.utils.MetadataBuffers"
DECODE_TRANSFER_QUEUE = "sglang.srt.disaggregation.decode.DecodeTransferQueue"
NIXL_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
MOONCAKE_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
MOONCAKE_REGISTRATION = "sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo"
NIXL_REGISTRATION = "sglang.srt.disaggregation.nixl.conn.KVArgsRegisterInfo"
MOONCAKE_ENGINE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
DECODE_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
DECODE_GRAPH_VOTE = "sglang.srt.managers.scheduler_components.dp_attn._local_decode_cuda_graph_vote"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
FLASH_MLA = "sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache"  # imported per call by the backend
RESOLUTION_STEP = "handle_other_validations"

@dataclasses.dataclass
class ProcessState:
    """What the hooks of one process share (SGLang runs one model runner per scheduler process)."""

    installed: bool = False
    runtime: EssRuntime | None = None  # this process's ESS runtime
    sender: pd_warmup.WarmupSender | None = None  # a PD prefill node's, instead of a runtime
    sender_pool: object = None  # the target model's KV pool on that node (its MTP draft worker has another)
    wire: tuple[int, int] | None = None  # (layers, top-k) of the PD warm-up rows, once this process has ESS
    warmup_rows: torch.Tensor | None = None  # the PD metadata buffers' warm-up rows [slots, ints] (sglang_ess.pd_warmup)
    stage_tokens: int | None = None  # the prefill staging rows sizing charged; the scheduler keeps batches within
    tier_spec: sizing.DiskTierSpec | None = None  # the disk tier sizing resolved, for the pool (--ess-disk-dir)
    lost_readers: list = dataclasses.field(default_factory=list)  # Reqs aborted for reading lost rows, not yet let go


state = ProcessState()


# -- flags -----------------------------------------------------------------------------------------------------
def after_add_cli_args(result, parser, *a, **kw):
    ess_args_mod.add_cli_args(parser)


def after_from_cli_args(server_args, cls, namespace, *a, **kw):
    ess_args_mod.attach(server_args, ess_args_mod.from_namespace(namespace))


# -- pool: ESS's DSA pool class and its sizing ----------------------------------------------------------------------
def _ess_target(kvc) -> tuple[EssArgs, dict] | None:
    """(settings, facts) when this configurator builds an ESS target pool (not the MTP draft worker's)."""
    ess = ess_args_mod.ess_args(kvc.server_args)
    if not ess.enable or getattr(kvc, "is_draft_worker", False):
        return None
    facts = runtime_facts(kvc.server_args)
    return None if facts.role == "pd-prefill" else (ess, facts)  # a prefill node keeps SGLang's pool


def around_resolve_memory_pool_config(original, kvc, pre_model_load_memory, *a, **kw):
    target = _ess_target(kvc)
    if target is None:
        return original(kvc, pre_model_load_memory, *a, **kw)
    config, state.tier_spec = sizing.resolve_memory_pool_config(kvc, pre_model_load_memory, *target)
    return config


def around_build_dsa_kv_pool(original, kvc, *a, max_running_requests, dsa_pool_class, **kw):
    target = _ess_target(kvc)
    if target is not None:
        facts = target[1]
        dsa_pool_class = pool_class(
            scratch_rows=sizing.scratch_requests(max_running_requests) * facts.query_rows,
            stage_rows=max(facts.context, sizing.relabel_stage_rows(kvc.server_args, max_running_requests, facts)),
            tier=state.tier_spec,
        )
    return original(kvc, *a, max_running_requests=max_running_requests, dsa_pool_class=dsa_pool_class, **kw)


# -- runtime ---------------------------------------------------------------------------------------------------
def before_load_model(model_runner, *a, **kw):
    """In each scheduler, before its weights load: the launch's device check (sglang_ess.validate.check_device) again
    with the free memory SGLang measured after its own start-up (`pre_model_load_memory`, what its KV budget is taken
    from), so memory other processes hold is found before the load, not after it."""
    facts = runtime_facts(model_runner.server_args)
    free_gib = getattr(model_runner, "pre_model_load_memory", None)
    if facts is None or facts.role == "pd-prefill" or getattr(model_runner, "is_draft_worker", False) or free_gib is None:
        return
    from sglang.srt.arg_groups.overrides import resolving_view

    check_device(resolving_view(model_runner.server_args), facts, free_gib * 1024 * MIB,
                 f"the free memory of {model_runner.device} before the load")


def after_init_sparse_coordinator(result, model_runner, *a, **kw):
    """Build this rank's EssRuntime once the memory pools exist, where SGLang builds HiSparse's coordinator, and
    install it as the runner's sparse-offload coordinator: the DSA backend (built later) then asks it for the selected
    rows in decode and verify, takes un-fused top-k positions, and keeps the token-granular page table."""
    server_args = model_runner.server_args
    ess = ess_args_mod.ess_args(server_args)
    if not ess.enable or getattr(model_runner, "is_draft_worker", False):
        return
    facts = runtime_facts(server_args)
    pool = model_runner.token_to_kv_pool
    if facts.role == "pd-prefill":
        if facts.windows:
            state.sender = pd_warmup.WarmupSender(
                facts.layers, facts.topk, facts.windows, model_runner.req_to_token_pool.req_to_token,
                pool.size + pool.page_size + 1, start_layer=pool.start_layer,
            )
            state.sender_pool, state.wire = pool, (facts.layers, facts.topk)
            logger.info("ESS on a PD prefill node: sends %d warm-up windows per request", facts.windows)
        return
    if not isinstance(pool, EssDSATokenToKVPool):
        raise RuntimeError(f"--enable-ess: the KV pool is {type(pool).__name__}, not ESS's (a pool hook did not apply)")
    state.runtime = EssRuntime(
        ess,
        facts,
        token_table=model_runner.req_to_token_pool.req_to_token,
        host=pool.ess_host,
        device=model_runner.device,
        start_layer=pool.start_layer,
        model=str(server_args.model_path),
        tier=pool.ess_tier,
    )
    pool.ess_runtime = state.runtime
    state.stage_tokens = pool.ess_stage.shape[0] - sizing.FIRST_ROW
    reset_on_admit(model_runner.req_to_token_pool, state.runtime)
    model_runner.hisparse_coordinator = state.runtime
    model_runner.ess_runtime = state.runtime
    if facts.role == "pd-decode" and ess.warmup_windows:
        state.wire = (facts.layers, facts.topk)
    if ess.progressive_pd:  # validate: a PD decode node's flag only
        state.runtime.progressive = progressive.ProgressiveDecode(LandingTracker(
            facts.layers, facts.context, PROGRESSIVE_REQUESTS, model_runner.req_to_token_pool.req_to_token.shape[0],
            model_runner.device, page=pool.page_size))
    logger.info("ESS runtime: %s", state.runtime.stats())


def staged_tokens(req) -> int:
    """The staging rows a request in a prefill batch can take at most: all its tokens (cached prefix and new)."""
    return req.seqlen


def around_add_one_req(original, adder, req, *a, **kw):
    """The scheduler's prefill admission: a prefill batch stages every token of its requests (sglang_ess.pool), and
    sizing charged the staging buffer for one context. A request that would take the batch past it waits for the next
    batch (SGLang's AddReqResult.OTHER); the first request of a batch always fits (it is at most one context)."""
    cap = state.stage_tokens
    if cap is not None and adder.can_run_list:
        if sum(staged_tokens(r) for r in adder.can_run_list) + staged_tokens(req) > cap:
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.OTHER
    return original(adder, req, *a, **kw)


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
    return state.sender is not None and getattr(backend, "token_to_kv_pool", None) is state.sender_pool


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
        state.sender.plan(forward_batch.req_pool_indices, seq_lens, extend_lens, backend.use_fused_topk)
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


def around_model_forward(original, model_runner, *a, **kw):
    """Each forward of the target model (eager, or a CUDA graph's replay), micro-batches and all: the runtime's
    start_forward / end_forward around it (stale overlap steps dropped; recorded rows drained, outside the graph)."""
    rt = getattr(model_runner, "ess_runtime", None)
    if rt is None:
        return original(model_runner, *a, **kw)
    rt.start_forward()
    out = original(model_runner, *a, **kw)
    rt.end_forward()
    return out


def around_forward_decode(original, backend, *a, **kw):
    """A decode call: DA's split attention (EssRuntime.split_attention) applies when the backend attends through
    FlashMLA's interface (SGLang's flashmla_kv decode), whose call the hook below wraps."""
    rt = state.runtime
    if rt is None or _ess_pool(backend) is None:
        return _in_phase(original, backend, DECODE, *a, **kw)
    rt.split_ok = getattr(backend, "dsa_decode_impl", None) == "flashmla_kv"
    try:
        out = _in_phase(original, backend, DECODE, *a, **kw)
    finally:
        rt.split_ok = False
    rt.check_split_taken()
    return out


FLASH_MLA_PARAMS = ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                    "num_splits", "softmax_scale"]


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
    out = _in_phase(original, backend, DECODE if verify else EXTEND, q, k, v, layer, forward_batch, *a, **kw)
    if _sending(backend) and not verify and top_k is not None:
        positions = ragged_positions(backend, forward_batch, top_k)
        state.sender.record(layer.layer_id, top_k if positions is None else positions,
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


INDEXER_PARAMS = ["self", "x", "q_lora", "positions", "forward_batch", "layer_id"]


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


def request_slot(req) -> int | None:
    """A Req's row of SGLang's request table: 0.5.23 keeps it in the Req's KV record (`req.kv`), no longer on the Req."""
    return req.kv.req_pool_idx


def reset_on_admit(req_pool, rt: EssRuntime) -> None:
    """Request-table rows handed to new requests start with empty ESS tables (SGLang's on-alloc-rows callback): rows
    are also freed outside release_kv_cache (the decode node's KV offload, say), and a PD request that gets no warm-up
    row must not inherit its row's previous LRU state and GPU rows. The reset waits for the next forward
    (EssRuntime.apply_admissions), in stream order after any forward still in flight."""
    previous = req_pool._on_alloc_rows

    def admit(rows: list[int]) -> None:
        if previous is not None:
            previous(rows)
        rt.reset_rows(rows)

    if previous is None:
        req_pool.register_on_alloc_rows(admit)
    else:  # SGLang allows one callback per pool: keep the one it registered, ahead of ours
        req_pool._on_alloc_rows = admit


def around_release_kv_cache(original, req, *a, **kw):
    """SGLang releases a request's KV (finish, abort, retract): ESS lets go of its rows first. Under
    --ess-progressive-pd a request whose transfer still lands keeps its KV until the transfer has ended
    (sglang_ess.progressive.ProgressiveDecode.hold); SGLang's queue then reports a pending release
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
        path = rt.release(int(idx), str(getattr(req, "rid", "")))
        if path:
            logger.info("ESS trace written: %s", path)
    return original(req, *a, **kw)


def after_has_pending_releases(result, queue, *a, **kw):
    """SGLang's decode transfer queue: a KV release ESS holds is pending too (the scheduler stays awake to run it,
    and skips its idle leak check, as for its own deferred releases)."""
    rt = state.runtime
    if not result and rt is not None and rt.progressive is not None and rt.progressive.holding():
        return True
    return None


def after_resolve_releases(result, queue, *a, **kw):
    """Every scheduler iteration (SGLang resolves its deferred releases there, before any gate): ESS's streams are
    pumped, so a release held for a transfer that has ended runs."""
    rt = state.runtime
    if rt is not None and rt.progressive is not None and rt.progressive.streams:
        rt.progressive.pump(queue)
    return None


# -- a disk-tier page that fails its checksum: its readers aborted, the prefix cache let go ------------------------------
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


def after_get_internal_state(result, controller, *a, **kw):
    """The scheduler's state readout (GET /get_server_info, `internal_states`): ESS's step counters and pool."""
    if state.runtime is not None:
        result.internal_state["ess"] = state.runtime.counts() | state.runtime.stats()
    return None


# -- PD: the warm-up state travels in an extra metadata buffer (sglang_ess.pd_warmup) -----------------------------
def after_metadata_buffers_init(result, buffers, size, *a, **kw):
    """Both PD nodes append the same buffer (its size depends on the model only), so Mooncake / NIXL send it with the
    rest of a request's metadata."""
    if state.wire is not None:
        ints = pd_warmup.row_ints(*state.wire)
        buffers.ess_warmup = state.warmup_rows = torch.zeros((size, ints), dtype=torch.int32,
                                                             device=buffers.output_ids.device)
        logger.info("ESS PD warm-up metadata: %d slots x %.2f MB", size, ints * 4 / 2**20)


def after_get_buf_infos(result, buffers, *a, **kw):
    buf = getattr(buffers, "ess_warmup", None)
    if buf is None:
        return None
    ptrs, lens, item_lens = result
    return [*ptrs, buf.data_ptr()], [*lens, buf.nbytes], [*item_lens, buf[0].nbytes]


def after_set_buf(result, buffers, req, *a, **kw):
    """Prefill node, a request's last chunk: its warm-up state into its metadata row."""
    buf = getattr(buffers, "ess_warmup", None)
    if buf is not None and state.sender is not None:
        state.sender.write(buf[req.metadata_buffer_index], int(request_slot(req)), req.bootstrap_room)


def after_commit_transfer(result, queue, decode_req, *a, **kw):
    """Decode node, a request's KV and metadata arrived: load the warm-up state the prefill node sent."""
    buf = getattr(queue.metadata_buffers, "ess_warmup", None)
    req = decode_req.req
    if buf is None or state.runtime is None or req.finished_reason is not None or request_slot(req) is None:
        return
    entries = pd_warmup.read_row(buf[decode_req.metadata_buffer_index], req.bootstrap_room, *state.wire)
    if entries is None:
        return
    prompt = getattr(req, "origin_input_ids", None)
    reason = pd_warmup.check_entries(entries, len(prompt) if prompt else state.runtime.token_table.shape[1])
    if reason is not None:  # a malformed record costs this request its warm-up, nothing else
        logger.warning("ESS warm-up of request %s refused: %s; it starts with empty GPU slots", req.bootstrap_room, reason)
        return
    state.runtime.admit_transferred(int(request_slot(req)), entries)


def around_pop_transferred(original, queue, *a, **kw):
    """Decode node, --ess-progressive-pd: requests whose phases 1 and 2 have landed pass SGLang's poll as
    transferred (sglang_ess.progressive); SGLang's own commit then admits them, the rest of their rows streaming."""
    rt = state.runtime
    prog = rt.progressive if rt is not None else None
    if prog is None:
        return original(queue, *a, **kw)
    prog.land()
    swapped = prog.before_pop(queue, request_slot)
    try:
        return original(queue, *a, **kw)
    finally:
        prog.after_pop(queue, swapped, request_slot)


# -- --ess-progressive-pd with decode CUDA graphs: a batch holding a request still landing runs eagerly ------------
def _streaming() -> bool:
    rt = state.runtime
    return rt is not None and rt.progressive is not None and rt.progressive.streaming()


def after_can_run_graph(result, runner, *a, **kw):
    """A decode batch replays its CUDA graph only when no joined request's transfer is still landing: a step may then
    wait for a row, a host wait no graph holds (docs/plugin.md, "Progressive PD transfer")."""
    if result and _streaming():
        return False
    return None


def after_decode_graph_vote(result, *a, **kw):
    """Under DP attention the ranks agree on graph or eager by a min-reduce of each rank's vote: a rank with a
    request still landing votes eager, so every rank runs eagerly with it (their collectives stay paired)."""
    if result and _streaming():
        return False
    return None


# -- PD over Mooncake or NIXL, --ess-progressive-pd: ordered sends and progress reports (sglang_ess.pd_progressive) --
def _warmup_pages(mgr, chunk, prefix_pages: int):
    """Prefill node: the warm-up pages of a chunk's request, hottest first, from its metadata row."""
    rows, page = state.warmup_rows, mgr.kv_args.page_size
    if rows is None or state.wire is None or chunk.prefill_aux_index is None:
        return pd_progressive.hot_pages(None, 0, page)
    entries = pd_warmup.read_row(rows[chunk.prefill_aux_index], chunk.room, *state.wire)
    return pd_progressive.hot_pages(entries, (prefix_pages + chunk.index_slice.stop) * page, page)


def around_transfer_worker(original, mgr, queue, executor, *a, **kw):
    """Prefill node with ESS (Mooncake): the worker takes its chunks through OrderedQueue, which sends a progressive
    room's last chunk in phases and reports each (a room no decode peer asked that of passes through unchanged)."""
    if state.sender is None:
        return original(mgr, queue, executor, *a, **kw)
    return original(mgr, pd_progressive.OrderedQueue(queue, mgr, executor, _warmup_pages), executor, *a, **kw)


def around_nixl_transfer_worker(original, mgr, queue, *a, **kw):
    """around_transfer_worker for NIXL's worker (no executor: its writes are handles it waits on)."""
    if state.sender is None:
        return original(mgr, queue, *a, **kw)
    return original(mgr, pd_progressive.OrderedQueue(queue, mgr, None, _warmup_pages), *a, **kw)


def around_conclude_transfer(original, mgr, *a, **kw):
    """A phase1 part's Success is held back until the room's last part (the decode node hears of phase 1 from ESS);
    any other conclusion ends the hold (pd_progressive.concluded)."""
    room = kw.get("bootstrap_room")
    if pd_progressive.hold_conclusion(mgr, room, kw.get("status")):
        return None
    result = original(mgr, *a, **kw)
    pd_progressive.concluded(mgr, room, result)
    return result


def around_send_aux(original, mgr, *a, **kw):
    """The last part of a progressive room sends no metadata: phase 1 did, and the decode node may have reused the
    slot since the request joined."""
    if pd_progressive.skip_metadata():
        return pd_progressive.engine(mgr).NO_SEND
    return original(mgr, *a, **kw)


def around_await_handles(original, mgr, handles, *a, **kw):
    """NIXL's worker waits on every handle of a chunk, the metadata's among them: a send ESS skipped has none."""
    return original(mgr, [h for h in handles if h is not pd_progressive.Nixl.NO_SEND], *a, **kw)


def after_registration_message(result, mgr, *a, **kw):
    """Decode node with --ess-progressive-pd: its Mooncake or NIXL registration asks prefill nodes for progressive
    sends (one frame more, past every field SGLang reads)."""
    if state.runtime is not None and state.runtime.progressive is not None:
        return [*result, pd_progressive.REGISTRATION]
    return None


def after_registration_info(result, cls, msg, *a, **kw):
    """Prefill node: whether a decode rank's registration asked for progressive sends."""
    result.ess_progressive = bool(msg) and msg[-1] == pd_progressive.REGISTRATION
    return None


def around_abort_notification(original, mgr, msg, *a, **kw):
    """Prefill node: a decode node's NEED (the pages a step waits for) into the notes its transfer workers read; every
    other message goes on to SGLang (its abort notifications, then its bootstrap messages)."""
    try:
        if pd_progressive.note_need(msg, mgr):
            return True
    except Exception:  # SGLang's bootstrap thread dies on an exception, and with it the node's new transfers
        logger.exception("ESS progressive PD: a NEED message could not be noted")
        return True
    return original(mgr, msg, *a, **kw)


def around_handle_chunk_ready(original, mgr, msg, *a, **kw):
    """Decode node: ESS's progress reports are taken into the inbox (dropped without --ess-progressive-pd); every
    other message goes on to SGLang."""
    if msg and msg[0] == pd_progressive.TAG:
        if state.runtime is not None and state.runtime.progressive is not None:
            return pd_progressive.take(msg, mgr)
        return True
    return original(mgr, msg, *a, **kw)


# -- PD transfer engines: ESS's latent layers are pinned host memory ------------------------------------------------
def host_memory_kinds(ptrs: list[int], kinds: list[str], host: torch.Tensor) -> list[str]:
    """NIXL memory kinds of KV buffers: DRAM for the ones inside ESS's host pool, the others as given."""
    low = host.data_ptr()
    high = low + host.numel() * host.element_size()
    return ["DRAM" if low <= p < high else k for p, k in zip(ptrs, kinds)]


def before_nixl_manager(manager, args, *a, **kw):
    """SGLang tells NIXL a KV buffer is host memory (DRAM) only under HiSparse (disaggregation/decode.py): ESS's
    decode node would register its pinned latent layers as GPU memory."""
    if state.runtime is not None and getattr(args, "kv_data_ptrs", None):
        kinds = list(getattr(args, "kv_data_mem_kinds", None) or ["VRAM"] * len(args.kv_data_ptrs))
        args.kv_data_mem_kinds = host_memory_kinds(list(args.kv_data_ptrs), kinds, state.runtime.cache.host)


def after_mooncake_register(result, engine, *a, **kw):
    """Mooncake's batch registration only logs a failure at debug level; with ESS a node whose buffers are not
    registered would send or receive nothing, so it stops here instead."""
    if result != 0 and (state.runtime is not None or state.sender is not None):
        raise RuntimeError(f"--enable-ess: Mooncake could not register the KV buffers (batch_register returned {result}); "
                           "check the transfer engine's memory registration limits")
    return None


def _hook_table():
    from sglang.srt.plugins.hook_registry import HookType

    return [
        (f"{SERVER_ARGS}.add_cli_args", HookType.AFTER, after_add_cli_args),
        (f"{SERVER_ARGS}.from_cli_args", HookType.AFTER, after_from_cli_args),
        (f"{KV_CONFIGURATOR}._resolve_memory_pool_config", HookType.AROUND, around_resolve_memory_pool_config),
        (f"{KV_CONFIGURATOR}._build_dsa_kv_pool", HookType.AROUND, around_build_dsa_kv_pool),
        (f"{MODEL_RUNNER}.load_model", HookType.BEFORE, before_load_model),
        (f"{MODEL_RUNNER}.maybe_init_hisparse_coordinator", HookType.AFTER, after_init_sparse_coordinator),
        (f"{MODEL_RUNNER}.forward", HookType.AROUND, around_model_forward),
        (f"{DSA_BACKEND}.init_forward_metadata", HookType.AFTER, after_init_forward_metadata),
        (f"{INDEXER}.forward_cuda", HookType.AFTER, after_indexer),
        (f"{INDEXER_METADATA}.topk_transform", HookType.AROUND, around_topk_transform),
        (f"{DSA_BACKEND}.forward_decode", HookType.AROUND, around_forward_decode),
        (FLASH_MLA, HookType.AROUND, around_flash_mla),
        (f"{DSA_BACKEND}.forward_extend", HookType.AROUND, around_forward_extend),
        (RELEASE_KV, HookType.AROUND, around_release_kv_cache),
        (f"{PREFILL_ADDER}.add_one_req", HookType.AROUND, around_add_one_req),
        (f"{INTERNAL_STATE}.get_internal_state", HookType.AFTER, after_get_internal_state),
        (f"{SCHEDULER}.run_batch", HookType.AFTER, after_run_batch),
        (f"{SCHEDULER}.get_next_batch_to_run", HookType.BEFORE, before_get_next_batch),
        (f"{METADATA_BUFFERS}.__init__", HookType.AFTER, after_metadata_buffers_init),
        (f"{METADATA_BUFFERS}.get_buf_infos", HookType.AFTER, after_get_buf_infos),
        (f"{METADATA_BUFFERS}.set_buf", HookType.AFTER, after_set_buf),
        (f"{DECODE_TRANSFER_QUEUE}._commit_transfer_to_req", HookType.AFTER, after_commit_transfer),
        (f"{DECODE_TRANSFER_QUEUE}.pop_transferred", HookType.AROUND, around_pop_transferred),
        (f"{DECODE_TRANSFER_QUEUE}.has_pending_deferred_releases", HookType.AFTER, after_has_pending_releases),
        (f"{DECODE_TRANSFER_QUEUE}.resolve_deferred_releases", HookType.AFTER, after_resolve_releases),
        (f"{NIXL_MANAGER}.__init__", HookType.BEFORE, before_nixl_manager),
        (f"{MOONCAKE_ENGINE}.batch_register", HookType.AFTER, after_mooncake_register),
        (f"{DECODE_GRAPH_RUNNER}.can_run_graph", HookType.AFTER, after_can_run_graph),
        (DECODE_GRAPH_VOTE, HookType.AFTER, after_decode_graph_vote),
        (f"{MOONCAKE_MANAGER}.transfer_worker", HookType.AROUND, around_transfer_worker),
        (f"{MOONCAKE_MANAGER}.conclude_transfer", HookType.AROUND, around_conclude_transfer),
        (f"{MOONCAKE_MANAGER}.send_aux", HookType.AROUND, around_send_aux),
        (f"{MOONCAKE_MANAGER}.build_receiver_registration_message", HookType.AFTER, after_registration_message),
        (f"{MOONCAKE_REGISTRATION}.from_zmq", HookType.AFTER, after_registration_info),
        (f"{MOONCAKE_MANAGER}.handle_chunk_ready", HookType.AROUND, around_handle_chunk_ready),
        (f"{MOONCAKE_MANAGER}._handle_abort_notification", HookType.AROUND, around_abort_notification),
        (f"{NIXL_MANAGER}.transfer_worker", HookType.AROUND, around_nixl_transfer_worker),
        (f"{NIXL_MANAGER}.conclude_transfer", HookType.AROUND, around_conclude_transfer),
        (f"{NIXL_MANAGER}.send_aux", HookType.AROUND, around_send_aux),
        (f"{NIXL_MANAGER}._await_handles", HookType.AROUND, around_await_handles),
        (f"{NIXL_MANAGER}.build_receiver_registration_message", HookType.AFTER, after_registration_message),
        (f"{NIXL_REGISTRATION}.from_zmq", HookType.AFTER, after_registration_info),
        (f"{NIXL_MANAGER}.handle_chunk_ready", HookType.AROUND, around_handle_chunk_ready),
        (f"{NIXL_MANAGER}._handle_abort_notification", HookType.AROUND, around_abort_notification),
    ]


# Parameters of each target that the hook above relies on (by name, in order from the first).
EXPECTED_PARAMS = {
    f"{SERVER_ARGS}.add_cli_args": ["parser"],
    f"{SERVER_ARGS}.from_cli_args": ["cls", "args"],
    f"{KV_CONFIGURATOR}._resolve_memory_pool_config": ["self", "pre_model_load_memory"],
    f"{KV_CONFIGURATOR}._build_dsa_kv_pool": ["self", "max_total_num_tokens", "max_running_requests", "dsa_pool_class"],
    f"{MODEL_RUNNER}.load_model": ["self"],
    f"{MODEL_RUNNER}.maybe_init_hisparse_coordinator": ["self"],
    f"{MODEL_RUNNER}.forward": ["self", "forward_batch"],
    f"{DSA_BACKEND}.init_forward_metadata": ["self", "forward_batch"],
    f"{DSA_BACKEND}.forward_decode": ["self", "q", "k", "v", "layer", "forward_batch"],
    f"{DSA_BACKEND}.forward_extend": ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache", "q_rope",
                                      "k_rope", "topk_indices"],
    f"{INDEXER}.forward_cuda": INDEXER_PARAMS,
    FLASH_MLA: FLASH_MLA_PARAMS,
    f"{INDEXER_METADATA}.topk_transform": ["self", "logits", "topk", "ks", "cu_seqlens_q", "ke_offset"],
    RELEASE_KV: ["req", "tree_cache"],
    f"{PREFILL_ADDER}.add_one_req": ["self", "req", "has_chunked_req"],
    f"{INTERNAL_STATE}.get_internal_state": ["self", "recv_req"],
    f"{SCHEDULER}.run_batch": ["self", "batch"],
    f"{SCHEDULER}.get_next_batch_to_run": ["self"],
    f"{METADATA_BUFFERS}.__init__": ["self", "size"],
    f"{METADATA_BUFFERS}.get_buf_infos": ["self"],
    f"{METADATA_BUFFERS}.set_buf": ["self", "req"],
    f"{DECODE_TRANSFER_QUEUE}._commit_transfer_to_req": ["self", "decode_req"],
    f"{DECODE_TRANSFER_QUEUE}.pop_transferred": ["self", "rids_to_check"],
    f"{DECODE_TRANSFER_QUEUE}.has_pending_deferred_releases": ["self"],
    f"{DECODE_TRANSFER_QUEUE}.resolve_deferred_releases": ["self"],
    f"{NIXL_MANAGER}.__init__": ["self", "args"],
    f"{MOONCAKE_ENGINE}.batch_register": ["self", "ptrs", "lengths"],
    f"{DECODE_GRAPH_RUNNER}.can_run_graph": ["self", "forward_batch"],
    DECODE_GRAPH_VOTE: ["local_batch", "disable_cuda_graph"],
    f"{MOONCAKE_MANAGER}.transfer_worker": ["self", "queue", "executor"],
    f"{MOONCAKE_MANAGER}.conclude_transfer": ["self", "bootstrap_room", "status", "targets", "failure_reason"],
    f"{MOONCAKE_MANAGER}.send_aux": ["self", "req", "prefill_aux_index", "dst_aux_ptrs"],
    f"{MOONCAKE_MANAGER}.build_receiver_registration_message": ["self"],
    f"{MOONCAKE_REGISTRATION}.from_zmq": ["cls", "msg"],
    f"{MOONCAKE_MANAGER}.handle_chunk_ready": ["self", "msg"],
    f"{MOONCAKE_MANAGER}._handle_abort_notification": ["self", "msg"],
    f"{NIXL_MANAGER}.transfer_worker": ["self", "queue"],
    f"{NIXL_MANAGER}.conclude_transfer": ["self", "bootstrap_room", "status", "targets", "failure_reason"],
    f"{NIXL_MANAGER}.send_aux": ["self", "peer_name", "prefill_aux_index", "dst_aux_ptrs"],
    f"{NIXL_MANAGER}._await_handles": ["self", "handles"],
    f"{NIXL_MANAGER}.build_receiver_registration_message": ["self"],
    f"{NIXL_REGISTRATION}.from_zmq": ["cls", "msg"],
    f"{NIXL_MANAGER}.handle_chunk_ready": ["self", "msg"],
    f"{NIXL_MANAGER}._handle_abort_notification": ["self", "msg"],
}


def launch_error_hook(previous):
    """sys.excepthook for the launcher: a refused ESS launch ends with its message alone, one line, as SGLang's
    argument errors do, not as the last line of a traceback; every other exception goes to `previous`."""

    def hook(kind, value, tb):
        if isinstance(value, ess_args_mod.EssArgsError):
            print(f"sglang: error: {value}", file=sys.stderr)
            return
        previous(kind, value, tb)

    hook.ess = True
    return hook


def install() -> list[str]:
    """Register every hook (SGLang applies them after all plugins ran). Returns the targets."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry

    table = _hook_table()
    if not state.installed:  # SGLang loads plugins once per process; tests may call this again
        # the CPU path first: its kernels then sit inside ESS's hooks on the same targets (the indexer's forward)
        cpu.install()
        for target, kind, hook in table:
            HookRegistry.register(target, hook, kind)
        register_resolution_hook(RESOLUTION_STEP)(resolution_step)
        if not getattr(sys.excepthook, "ess", False):
            sys.excepthook = launch_error_hook(sys.excepthook)
        state.installed = True
    return [t for t, _, _ in table]


def check_installed() -> list[str]:
    """Targets that SGLang failed to patch (it logs and goes on; ESS would then be silently off)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t, _, _ in _hook_table() if t not in HookRegistry._patched]

