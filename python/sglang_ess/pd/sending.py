"""Progressive PD transfer, the prefill node (`--enable-ess`; docs/pd.md, "Progressive PD transfer"): its ordered
sends and progress reports over SGLang's Mooncake and NIXL engines (sglang_ess.pd.engines).

SGLang queues a request's KV as chunks to one transfer worker per room, FIFO; its last chunk carries the last pages,
then index-K (SGLang's DSA state) and the metadata (first token, ESS's warm-up row), then concludes the room (status
Success to the decode node). Both engines' workers share that shape; what differs, how a peer is named and how one
layer's pages are written, is the `Engine`'s. When every decode peer of the room registered as progressive (a frame
ESS appends to the engine's registration message), `OrderedQueue` hands SGLang's worker that last chunk as a sequence
of parts instead, each an ordinary SGLang chunk the worker sends with its own code:
    phase1   no page; index-K and the metadata (the worker's last-chunk path; ESS holds back its conclusion)
    phase2   the chunk's pages that hold a warm-up row (ess.core.send_order), hottest first
    phase3   the other pages, ascending, in slices of PROGRESSIVE_SLICE_PAGES
    end      no page; the worker's last-chunk path concludes the room (metadata not sent again: the decode node may
             have handed that slot to another request once this one joined)
The worker asks its queue for the next chunk only when it has finished the one before (a Mooncake batch transfer
returns once the bytes have landed; NIXL's worker waits for every handle of the chunk to be DONE), so `get` reports
the part before, over SGLang's own ZMQ path to the decode endpoints, unless the room failed: [TAG, room, kind,
payload], payload the request's first page not sent in this chunk (phase1: every page before it has landed: the
decode node's cached prefix and the earlier chunks, sent FIFO by the same worker) or the request's page numbers of the
part (int32).
What a decode step waits for goes first: the decode node names the pages at the layer waiting ([NEED, room, layer,
pages]) over the ZMQ socket its receiver registered and sent metadata through; the prefill node's bootstrap thread
notes them (`note_need`), and `get`, before the next part, sends those pages of that layer alone (a page of one layer,
64 x 656 B for DeepSeek-V3.2, not all 61) and reports them ("layer"). A step then waits for the part in flight (at
most PROGRESSIVE_SLICE_PAGES pages) and its own blocks, not for the rest of phase 3 (docs/simulator.md: in stream
order the first step waits for nearly all of phase 3).
What the worker threads and the bootstrap thread share (held conclusions, noted pages) is the process's PdState
(sglang_ess.pd.state), handed in by the hooks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np
import torch

from ess.core.send_order import send_order
from ess.core.settings import PROGRESSIVE_SLICE_PAGES
from sglang_ess.pd import warmup
from sglang_ess.pd.engines import NEED, TAG, Engine
from sglang_ess.pd.state import PdState

logger = logging.getLogger("sglang_ess")


# -- which pages go in which part --------------------------------------------------------------------------------------
SLICE_PAGES = PROGRESSIVE_SLICE_PAGES


def parts(first: int, count: int, hot: np.ndarray, slice_pages: int) -> list:
    """A request's last chunk, its pages first .. first + count - 1, as [(kind, request page numbers int64)] in
    sending order; `hot` the pages of the warm-up set, hottest first (pages outside the chunk are skipped). The
    prompt's last page goes in phase 2 too: the decode node writes its first own rows into it, which a later write of
    the whole page would overwrite."""
    hot = np.asarray(hot, dtype=np.int64)
    last = first + count - 1
    warm = hot[(hot >= first) & (hot <= last)]
    if last not in warm:
        warm = np.append(warm, last)
    rest = np.setdiff1d(np.arange(first, first + count, dtype=np.int64), warm)  # ascending
    none = np.zeros(0, dtype=np.int64)
    slices = [("phase3", rest[i:i + slice_pages]) for i in range(0, len(rest), slice_pages)]
    return [("phase1", none), ("phase2", warm), *slices, ("end", none)]


def hot_pages(entries: torch.Tensor | None, prompt_len: int, page: int) -> np.ndarray:
    """The warm-up row's entries [layers, N] (sglang_ess.pd.warmup; None: none sent) -> its pages, hottest first."""
    if entries is None:
        return np.zeros(0, dtype=np.int64)
    positions, windows = warmup.unpack(entries, entries.shape[1])
    return send_order(positions, windows, prompt_len, page)[0].numpy()


def warmup_pages(pd: PdState, mgr, chunk, prefix_pages: int) -> np.ndarray:
    """The warm-up pages of a chunk's request, hottest first, from its metadata row (none without one)."""
    rows, page = pd.warmup_rows, mgr.kv_args.page_size
    if rows is None or pd.wire is None or chunk.prefill_aux_index is None:
        return hot_pages(None, 0, page)
    entries = warmup.read_row(rows[chunk.prefill_aux_index], chunk.room, *pd.wire)
    return hot_pages(entries, (prefix_pages + chunk.index_slice.stop) * page, page)


@dataclasses.dataclass
class Part:
    kind: str  # one of sglang_ess.pd.engines.KINDS
    pages: np.ndarray  # the request's page numbers this part sends
    first: int  # the request's first page in this chunk
    held: bool = False  # phase1: its Success conclusion held back (the worker sent index-K and the metadata)


def split(chunk, prefix_pages: int, hot: np.ndarray) -> list:
    """SGLang's last TransferKVChunk of a request -> its parts, each a TransferKVChunk with `.ess` (a Part). Its
    index_slice becomes an index array into the decode's page list (the worker indexes with it)."""
    start, stop = chunk.index_slice.start or 0, chunk.index_slice.stop
    kv = np.asarray(chunk.prefill_kv_indices)
    first = prefix_pages + start
    out = []
    for kind, pages in parts(first, stop - start, hot, SLICE_PAGES):
        local = pages - first
        last = kind in ("phase1", "end")
        part = dataclasses.replace(
            chunk, prefill_kv_indices=kv[local], index_slice=start + local, is_last_chunk=last,
            prefill_aux_index=chunk.prefill_aux_index if last else None,
            state_indices=chunk.state_indices if kind == "phase1" else None,
            wait_event=chunk.wait_event if kind == "phase1" else None, indices_event=None, staging_counted=False)
        part.ess = Part(kind, pages, first)
        out.append(part)
    return out


# -- the transfer worker's queue ---------------------------------------------------------------------------------------
def current(pd: PdState) -> Part | None:
    """The Part the calling transfer worker thread is sending, if any."""
    return getattr(pd.worker, "part", None)


def progressive_room(pd: PdState, engine: Engine, mgr, chunk) -> bool:
    """Whether SGLang's chunk is a request's last and every decode peer of its room asked for progressive sends over
    the plain MLA page path (no DCP relayout, staging or KV sharding, which index pages otherwise; one pipeline stage,
    whose layers are the decode node's)."""
    if chunk is None or not chunk.is_last_chunk or not isinstance(chunk.index_slice, slice):
        return False
    if getattr(mgr, "enable_staging", False) or getattr(mgr, "kv_shard_size", 1) != 1 or not mgr.is_mla_backend \
            or getattr(mgr, "pp_size", 1) != 1 or getattr(mgr, "enable_all_cp_ranks_for_transfer", False):
        return False
    infos = list(mgr.transfer_infos.get(chunk.room, {}).values())
    if not infos or any(i.is_dummy or chunk.index_slice.stop > len(i.dst_kv_indices) for i in infos):
        return False  # (a destination list shorter than the chunk: SGLang's worker trims a slice, not an index array)
    regs = [mgr.decode_kv_args_table.get(engine.peer(i)) for i in infos]
    if not all(r is not None and getattr(r, "ess_progressive", False) for r in regs):
        return False
    odd = [engine.peer(i) for i, r in zip(infos, regs) if not engine.plain(mgr, r)]
    for peer in pd.first_warning(set(odd)):
        logger.warning("ESS progressive PD: decode peer %s asked for progressive sends, but its KV layout is not the "
                       "plain page path (DCP relayout, another page stride or layer pairing): its rooms go whole", peer)
    return not odd


class OrderedQueue:
    """Stands for a transfer worker's queue (`MooncakeKVManager.transfer_worker`, `NixlKVManager.transfer_worker`):
    SGLang's chunks as they come, a progressive request's last chunk as its parts, and a progress report for each part
    once sent. `engine` is the manager's (sglang_ess.pd.engines), `executor` Mooncake's worker's (None for NIXL),
    `pd` the process's state."""

    def __init__(self, queue, mgr, executor, engine: Engine, pd: PdState):
        self.queue, self.mgr, self.executor, self.engine, self.pd = queue, mgr, executor, engine, pd
        self.pending: collections.deque = collections.deque()
        self.sent = None  # the chunk handed out last

    def get(self):
        # An error of ESS's own costs the order or a report, never the worker: SGLang's worker dies on an exception
        # (and with it every transfer of the prefill node), so each step here logs and falls back instead.
        try:
            self._report(self.sent)
        except Exception:
            logger.exception("ESS progressive PD: a progress report failed; the decode node waits for the room's end")
        if getattr(self.sent, "ess", None) is not None:
            if self.sent.ess.kind == "end":
                self.pd.take_need(self.sent.room)  # the room has concluded: a NEED that came late is dropped
            if not live(self.mgr, self.sent.room):  # aborted or cleared: the worker skips the room's parts left
                fail_held(self.pd, self.mgr, self.sent.room,
                          "the prefill node ended the transfer (aborted or cleared)")
        if self.pending:
            try:
                self._urgent(self.pending[0].room)
            except Exception:
                logger.exception("ESS progressive PD: pages a decode step waits for could not be sent ahead")
            chunk = self.pending.popleft()
        else:
            chunk = self.queue.get()
            try:
                if progressive_room(self.pd, self.engine, self.mgr, chunk):
                    chunk = self._split(chunk)
            except Exception:
                logger.exception("ESS progressive PD: the last chunk of room %s goes unsplit", chunk.room)
        self.sent = chunk
        self.pd.worker.part = getattr(chunk, "ess", None)
        return chunk

    def _split(self, chunk):
        if chunk.indices_event is not None:  # the indices were copied to the host asynchronously
            chunk.indices_event.synchronize()
        if isinstance(chunk.prefill_kv_indices, torch.Tensor):
            chunk.prefill_kv_indices = chunk.prefill_kv_indices.numpy()
        infos = self.mgr.transfer_infos.get(chunk.room, {}).values()
        prefix = next((i.decode_prefix_len for i in infos if i.decode_prefix_len), 0)
        prefix_pages = prefix // self.mgr.kv_args.page_size
        head, *rest = split(chunk, prefix_pages, warmup_pages(self.pd, self.mgr, chunk, prefix_pages))
        self.pending.extend(rest)
        return head

    def _urgent(self, room: int) -> None:
        """The (layer, page) blocks a decode step waits for, sent now through SGLang's own transfer of KV blocks,
        one layer at a time, and reported; they are among the phase-3 parts not sent yet (a page sent already has
        landed or is the part just sent, reported before this). The part still sends them with their page later."""
        needs = self.pd.take_need(room)
        later = [c for c in self.pending if c.room == room and c.ess.kind == "phase3"]
        if not needs or not later:
            return
        pages = np.concatenate([c.ess.pages for c in later])
        kv = np.concatenate([c.prefill_kv_indices for c in later])
        idx = np.concatenate([c.index_slice for c in later])
        mgr = self.mgr
        # counted before the status check, as SGLang counts a chunk: an abort's deferred ack waits for these writes
        mgr._staging_outstanding[room] += 1
        try:
            if live(self.mgr, room):
                self._send_blocks(room, needs, pages, kv, idx)
        finally:
            mgr._staging_outstanding[room] -= 1
            if mgr.enable_deferred_decode_kv_release:
                mgr._maybe_ack_drained_abort(room)

    def _send_blocks(self, room: int, needs: dict, pages: np.ndarray, kv: np.ndarray, idx: np.ndarray) -> None:
        mgr = self.mgr
        for layer, want in sorted(needs.items()):
            pick = np.isin(pages, want)
            if not pick.any() or not 0 <= layer < len(mgr.kv_args.kv_data_ptrs) or not live(mgr, room):
                continue
            ok, eng = True, self.engine
            for info in mgr.transfer_infos.get(room, {}).values():
                reg = mgr.decode_kv_args_table[eng.peer(info)]
                try:
                    ok &= eng.send_layer(mgr, info, reg, layer, kv[pick], info.dst_kv_indices[idx[pick]], self.executor)
                except Exception:
                    logger.exception("ESS progressive PD: pages of layer %d of room %s not sent ahead", layer, room)
                    ok = False
            if not ok:  # a failed write may still be landing: no drain ack (SGLang's rule); the part sends them again
                mgr.poison_deferred_ack_room(room)
            elif live(mgr, room):
                self._send(room, b"layer", np.concatenate([[layer], pages[pick]]).astype(np.int32).tobytes())

    def _report(self, chunk) -> None:
        part = getattr(chunk, "ess", None)
        if part is None or part.kind == "end" or (part.kind == "phase1" and not part.held) \
                or not live(self.mgr, chunk.room):
            return
        payload = str(part.first).encode() if part.kind == "phase1" else part.pages.astype(np.int32).tobytes()
        self._send(chunk.room, part.kind.encode(), payload)

    def _send(self, room: int, kind: bytes, payload: bytes) -> None:
        from sglang.srt.utils.network import NetworkAddress

        mgr, frames = self.mgr, [TAG, str(room).encode(), kind, payload]
        for endpoint, port in mgr._room_notify_targets(room):
            na = NetworkAddress(endpoint, port)
            try:
                mgr._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
            except Exception as e:  # the decode node then waits for the room's conclusion, as without progress
                logger.warning("ESS progressive PD: no %s report of room %s to %s: %s", kind.decode(), room,
                               na.to_host_port_str(), e)

    def __getattr__(self, name):
        return getattr(self.queue, name)


def live(mgr, room: int) -> bool:
    """Whether the prefill node still sends `room` (SGLang's worker skips the chunks of a room cleared or failed)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    status = mgr.request_status.get(room)  # one read: SGLang's scheduler thread may clear the room meanwhile
    return status is not None and status != KVPoll.Failed and room not in mgr.failure_records


# -- the room's conclusion ---------------------------------------------------------------------------------------------
def hold_conclusion(pd: PdState, mgr, room: int, status) -> bool:
    """Inside a transfer worker: whether SGLang's conclusion of `room` is a phase1 part's Success, to hold back until
    the part `end` (the decode node learns of phase 1 from ESS's report instead). A room failed already is not held:
    SGLang concludes it Failed and tells the decode node."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    part = current(pd)
    if part is None or part.kind != "phase1" or status != KVPoll.Success or not live(mgr, room):
        return False
    part.held = True
    pd.hold(room, list(mgr._room_notify_targets(room)))  # captured now: SGLang's clear() of the sender drops them
    return True


def concluded(pd: PdState, mgr, room: int, result) -> None:
    """After SGLang concluded `room` (not held): it is held no more. SGLang concludes nothing for a room its sender
    has cleared (`conclude_transfer` returns None); if that room's Success was held, its request may be decoding, so
    the decode node hears Failed from ESS."""
    targets = pd.unhold(room)
    pd.take_need(room)
    if targets is not None and result is None:
        _tell_failed(mgr, room, targets, "the prefill node cleared the room before its transfer ended")


def fail_held(pd: PdState, mgr, room: int, reason: str) -> None:
    """A held room the prefill node no longer sends (SGLang's AbortReq, or its sender cleared) ends without a
    conclusion of SGLang's (it skips the rest of the room's chunks): the decode node, whose request may be decoding and
    waiting for a row, hears Failed now, not at its waiting timeout. Not when SGLang poisoned the room (a write of it
    may still be landing, so it leaves the room to the decode node's timeout rather than free its pages)."""
    targets = pd.unhold(room)
    pd.take_need(room)
    if targets is not None and room not in mgr._deferred_ack_poisoned_rooms:
        _tell_failed(mgr, room, targets, reason)


def _tell_failed(mgr, room: int, targets: list, reason: str) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    logger.warning("ESS progressive PD: room %s: %s; the decode node is told it failed", room, reason)
    mgr.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)


def skip_metadata(pd: PdState) -> bool:
    """Inside a transfer worker: the part `end` sends no metadata (phase 1 did)."""
    part = current(pd)
    return part is not None and part.kind == "end"


# -- the pages decode steps wait for -----------------------------------------------------------------------------------
def note_need(pd: PdState, msg: list, mgr) -> bool:
    """A message of the prefill node's bootstrap thread: a decode node's NEED into the notes (True), or not one. A
    room the node no longer sends is dropped."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if not msg or msg[0] != NEED:
        return False
    try:
        room, layer, pages = int(msg[1]), int(msg[2]), np.frombuffer(msg[3], dtype=np.int32).tolist()
    except (IndexError, ValueError):
        logger.warning("ESS progressive PD: a malformed NEED message dropped")
        return True
    pd.note_need(room, layer, pages, lambda: room in mgr.transfer_infos and live(mgr, room)
                 and mgr.request_status.get(room) != KVPoll.Success)
    return True
