"""ESS's hooks on PD disaggregation: the warm-up state in an extra metadata buffer (sglang_ess.pd.warmup), the decode
node's transfer queue under --ess-progressive-pd (sglang_ess.pd.landing), the ordered sends and progress reports
over Mooncake and NIXL (sglang_ess.pd.sending, sglang_ess.pd.engines), and the transfer engines' memory registration.
What they share across SGLang's threads is `state.pd` (sglang_ess.pd.state)."""

from __future__ import annotations

import logging

import torch

from sglang_ess.hooks.shared import state
from sglang_ess.kv_arrivals import WarmupRefused
from sglang_ess.pd import engines, sending
from sglang_ess.pd import warmup as pd_warmup
from sglang_ess.runtime import request_slot

logger = logging.getLogger("sglang_ess")


# -- the warm-up state travels in an extra metadata buffer (sglang_ess.pd.warmup) --------------------------------------
def after_metadata_buffers_init(result, buffers, size, *a, **kw):
    """Both PD nodes append the same buffer (its size depends on the model only), so Mooncake / NIXL send it with the
    rest of a request's metadata."""
    if state.pd.wire is not None:
        ints = pd_warmup.row_ints(*state.pd.wire)
        buffers.ess_warmup = state.pd.warmup_rows = torch.zeros((size, ints), dtype=torch.int32,
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
    if buf is not None and state.pd.sender is not None:
        state.pd.sender.write(buf[req.metadata_buffer_index], int(request_slot(req)), req.bootstrap_room)


def after_commit_transfer(result, queue, decode_req, *a, **kw):
    """Decode node, a request's KV and metadata arrived: load the warm-up state the prefill node sent."""
    buf = getattr(queue.metadata_buffers, "ess_warmup", None)
    req = decode_req.req
    if state.runtime is None or req.finished_reason is not None or request_slot(req) is None:
        return
    prompt = getattr(req, "origin_input_ids", None)
    if prompt:  # residency first: a resident request's region is filled from the host pool at the next forward
        state.runtime.kv_landed(int(request_slot(req)), len(prompt))
    if buf is None:
        return
    entries = pd_warmup.read_row(buf[decode_req.metadata_buffer_index], req.bootstrap_room, *state.pd.wire)
    if entries is None:
        return
    try:
        state.runtime.admit_transferred(int(request_slot(req)), entries, len(prompt) if prompt else None)
    except WarmupRefused as e:  # the wire is input: a malformed record ends its own request, nothing reads it
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort

        message = f"ESS: the PD warm-up metadata of request {req.bootstrap_room} is malformed ({e.reason})"
        logger.error("%s; the request is aborted", message)
        state.runtime.abandon_transfer(int(request_slot(req)))
        # SGLang's transfer queue then streams the abort and releases the request, as for its own metadata checks
        prepare_abort(req, message, status_code=HTTPStatus.BAD_GATEWAY)


# -- the decode node's transfer queue, --ess-progressive-pd (sglang_ess.pd.landing) ------------------------------------
def around_pop_transferred(original, queue, *a, **kw):
    """Decode node, --ess-progressive-pd: requests whose phases 1 and 2 have landed pass SGLang's poll as
    transferred (sglang_ess.pd.landing); SGLang's own commit then admits them, the rest of their rows streaming."""
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


# -- --ess-progressive-pd with decode CUDA graphs: a batch holding a request still landing runs eagerly ----------------
def _streaming() -> bool:
    rt = state.runtime
    return rt is not None and rt.progressive is not None and rt.progressive.streaming()


def after_can_run_graph(result, runner, *a, **kw):
    """A decode batch replays its CUDA graph only when no joined request's transfer is still landing: a step may then
    wait for a row, a host wait no graph holds (docs/pd.md, "Progressive PD transfer")."""
    if result and _streaming():
        return False
    return None


def after_decode_graph_vote(result, *a, **kw):
    """Under DP attention the ranks agree on graph or eager by a min-reduce of each rank's vote: a rank with a
    request still landing votes eager, so every rank runs eagerly with it (their collectives stay paired)."""
    if result and _streaming():
        return False
    return None


# -- Mooncake and NIXL, --ess-progressive-pd: ordered sends and progress reports (sglang_ess.pd.sending, .engines) -----
def around_transfer_worker(original, mgr, queue, executor, *a, **kw):
    """Prefill node with ESS (Mooncake): the worker takes its chunks through OrderedQueue, which sends a progressive
    room's last chunk in phases and reports each (a room no decode peer asked that of passes through unchanged)."""
    if state.pd.sender is None:
        return original(mgr, queue, executor, *a, **kw)
    ordered = sending.OrderedQueue(queue, mgr, executor, engines.Mooncake(state.pd), state.pd)
    return original(mgr, ordered, executor, *a, **kw)


def around_nixl_transfer_worker(original, mgr, queue, *a, **kw):
    """around_transfer_worker for NIXL's worker (no executor: its writes are handles it waits on)."""
    if state.pd.sender is None:
        return original(mgr, queue, *a, **kw)
    return original(mgr, sending.OrderedQueue(queue, mgr, None, engines.Nixl(state.pd), state.pd), *a, **kw)


def around_conclude_transfer(original, mgr, *a, **kw):
    """A phase1 part's Success is held back until the room's last part (the decode node hears of phase 1 from ESS);
    any other conclusion ends the hold (sglang_ess.pd.sending.concluded)."""
    room = kw.get("bootstrap_room")
    if sending.hold_conclusion(state.pd, mgr, room, kw.get("status")):
        return None
    result = original(mgr, *a, **kw)
    sending.concluded(state.pd, mgr, room, result)
    return result


def around_send_aux(original, mgr, *a, **kw):
    """The last part of a progressive room sends no metadata: phase 1 did, and the decode node may have reused the
    slot since the request joined."""
    if sending.skip_metadata(state.pd):
        return engines.engine_of(mgr, state.pd).NO_SEND
    return original(mgr, *a, **kw)


def around_await_handles(original, mgr, handles, *a, **kw):
    """NIXL's worker waits on every handle of a chunk, the metadata's among them: a send ESS skipped has none."""
    return original(mgr, [h for h in handles if h is not engines.Nixl.NO_SEND], *a, **kw)


def after_registration_message(result, mgr, *a, **kw):
    """Decode node with --ess-progressive-pd: its Mooncake or NIXL registration asks prefill nodes for progressive
    sends (one frame more, past every field SGLang reads)."""
    if state.runtime is not None and state.runtime.progressive is not None:
        return [*result, engines.REGISTRATION]
    return None


def after_registration_info(result, cls, msg, *a, **kw):
    """Prefill node: whether a decode rank's registration asked for progressive sends."""
    result.ess_progressive = bool(msg) and msg[-1] == engines.REGISTRATION
    return None


def around_abort_notification(original, mgr, msg, *a, **kw):
    """Prefill node: a decode node's NEED (the pages a step waits for) into the notes its transfer workers read; every
    other message goes on to SGLang (its abort notifications, then its bootstrap messages)."""
    try:
        if sending.note_need(state.pd, msg, mgr):
            return True
    except Exception:  # SGLang's bootstrap thread dies on an exception, and with it the node's new transfers
        logger.exception("ESS progressive PD: a NEED message could not be noted")
        return True
    return original(mgr, msg, *a, **kw)


def around_handle_chunk_ready(original, mgr, msg, *a, **kw):
    """Decode node: ESS's progress reports are taken into the inbox (dropped without --ess-progressive-pd); every
    other message goes on to SGLang."""
    if msg and msg[0] == engines.TAG:
        if state.runtime is not None and state.runtime.progressive is not None:
            return engines.take(state.pd, msg, mgr)
        return True
    return original(mgr, msg, *a, **kw)


# -- the transfer engines: ESS's latent layers are pinned host memory --------------------------------------------------
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
    if result != 0 and (state.runtime is not None or state.pd.sender is not None):
        raise RuntimeError(f"--enable-ess: Mooncake could not register the KV buffers (batch_register returned {result}); "
                           "check the transfer engine's memory registration limits")
    return None

