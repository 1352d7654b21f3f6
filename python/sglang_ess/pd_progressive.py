"""Progressive PD transfer over SGLang's Mooncake and NIXL engines (docs/plugin.md, "Progressive PD transfer"): the
prefill node's ordered sends and progress reports, the decode node's inbox of them.

Prefill node (`--enable-ess`). SGLang queues a request's KV as chunks to one transfer worker per room, FIFO; its last
chunk carries the last pages, then index-K (SGLang's DSA state) and the metadata (first token, ESS's warm-up row),
then concludes the room (status Success to the decode node). Both engines' workers share that shape (SGLang's
CommonKVManager: its status sockets, abort counting, conclusion); what differs, how a peer is named and how one layer's
pages are written, is an `Engine`'s. When every decode peer of the room registered as progressive (a frame ESS
appends to the engine's registration message), `OrderedQueue` hands SGLang's worker that last chunk as a sequence of
parts instead, each an ordinary SGLang chunk the worker sends with its own code:
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
notes them, and `get`, before the next part, sends those pages of that layer alone (a page of one layer, 64 x 656 B
for DeepSeek-V3.2, not all 61) and reports them ("layer"). A step then waits for the part in flight (at most
PROGRESSIVE_SLICE_PAGES pages) and its own blocks, not for the rest of phase 3 (docs/simulator.md: in stream order
the first step waits for nearly all of phase 3).

Decode node (`--ess-progressive-pd`). Its engine's listener thread hands messages it does not know to
`handle_chunk_ready` first; ESS's hook takes the tagged ones into `INBOX` by room, and `events` turns them into the
receiver events of sglang_ess.progressive. A room served by more than one prefill rank (prefill pipeline parallelism)
is not read early: its request waits for the whole transfer.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading

import numpy as np
import torch

from ess.core.send_order import send_order
from ess.core.settings import PROGRESSIVE_SLICE_PAGES

logger = logging.getLogger("sglang_ess")

TAG = b"ESS_PROGRESS"  # a progress message, prefill -> decode
NEED = b"ESS_NEED"  # pages a decode step waits for, decode -> prefill
REGISTRATION = b"ESS_PROGRESSIVE/1"  # the last frame of a progressive decode rank's engine registration
KINDS = ("phase1", "phase2", "phase3", "end")  # the parts; a report's kind may also be "layer" (a step's pages)


# -- which pages go in which part ----------------------------------------------------------------------------------
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
    """The warm-up row's entries [layers, N] (sglang_ess.pd_warmup; None: none sent) -> its pages, hottest first."""
    if entries is None:
        return np.zeros(0, dtype=np.int64)
    from sglang_ess import pd_warmup

    positions, windows = pd_warmup.unpack(entries, entries.shape[1])
    return send_order(positions, windows, prompt_len, page)[0].numpy()


@dataclasses.dataclass
class Part:
    kind: str  # one of KINDS
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


# -- the two engines -----------------------------------------------------------------------------------------------
class Mooncake:
    """SGLang's MooncakeKVManager: peers are Mooncake sessions; a write returns once landed (0) or failed."""

    @staticmethod
    def peer(info) -> str:
        return info.mooncake_session_id

    @staticmethod
    def plain(mgr, reg) -> bool:
        return not reg.requires_dcp_relayout

    @staticmethod
    def send_layer(mgr, info, reg, layer: int, src: np.ndarray, dst: np.ndarray, executor) -> bool:
        return mgr._send_kvcache_generic(
            mooncake_session_id=info.mooncake_session_id, src_data_ptrs=[mgr.kv_args.kv_data_ptrs[layer]],
            dst_data_ptrs=[reg.dst_kv_ptrs[layer]], item_lens=[mgr.kv_args.kv_item_lens[layer]],
            prefill_data_indices=src, dst_data_indices=dst, executor=executor) == 0

    NO_SEND = 0  # what send_aux returns for a send ESS skips (the worker checks for 0)


class Nixl:
    """SGLang's NixlKVManager: peers are NIXL agents; a write is a posted handle, waited on as the worker waits."""

    @staticmethod
    def peer(info) -> str:
        return info.agent_name

    @staticmethod
    def plain(mgr, reg) -> bool:
        """The peer's layers pair with ours by position, with our page stride: a layer's pages then go through
        SGLang's flat (non-prepared) path, which strides the destination by the source's item length. Memory kinds
        may differ by layer (ESS's host layers DRAM, an MTP draft layer in GPU memory): each layer is sent with its
        own."""
        n = len(mgr.kv_args.kv_item_lens)
        return not reg.requires_dcp_relayout and list(reg.dst_kv_item_lens[:n]) == list(mgr.kv_args.kv_item_lens) \
            and list(reg.dst_kv_layer_ids[:len(mgr.kv_args.kv_layer_ids)]) == list(mgr.kv_args.kv_layer_ids)

    @staticmethod
    def send_layer(mgr, info, reg, layer: int, src: np.ndarray, dst: np.ndarray, executor) -> bool:
        handle = mgr._send_kvcache_generic(
            peer_name=info.agent_name, src_data_ptrs=[mgr.kv_args.kv_data_ptrs[layer]],
            dst_data_ptrs=[reg.dst_kv_ptrs[layer]], item_lens=[mgr.kv_args.kv_item_lens[layer]],
            prefill_data_indices=src, dst_data_indices=dst, dst_gpu_id=reg.gpu_id,
            src_mem_kind=mgr.kv_args.kv_data_mem_kinds[layer], dst_mem_kind=reg.dst_kv_mem_kinds[layer])
        settled, failed = mgr._await_handles([handle], failure_seen=False)
        return settled and not failed

    NO_SEND = object()  # what send_aux returns for a send ESS skips: a handle `_await_handles` drops (sglang_ess.hooks.pd)


def engine(mgr):
    """The Engine of an SGLang KV manager, or None (an engine ESS does not order)."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    return Mooncake if isinstance(mgr, MooncakeKVManager) else Nixl if isinstance(mgr, NixlKVManager) else None


# -- the prefill node ----------------------------------------------------------------------------------------------
_worker = threading.local()  # .part: the Part a transfer worker thread is sending


def current() -> Part | None:
    return getattr(_worker, "part", None)


def progressive_room(mgr, chunk) -> bool:
    """Whether SGLang's chunk is a request's last and every decode peer of its room asked for progressive sends over
    the plain MLA page path (no DCP relayout, staging or KV sharding, which index pages otherwise; one pipeline stage,
    whose layers are the decode node's)."""
    if chunk is None or not chunk.is_last_chunk or not isinstance(chunk.index_slice, slice):
        return False
    if getattr(mgr, "enable_staging", False) or getattr(mgr, "kv_shard_size", 1) != 1 or not mgr.is_mla_backend \
            or getattr(mgr, "pp_size", 1) != 1 or getattr(mgr, "enable_all_cp_ranks_for_transfer", False):
        return False
    eng = engine(mgr)
    infos = list(mgr.transfer_infos.get(chunk.room, {}).values())
    if eng is None or not infos or any(i.is_dummy or chunk.index_slice.stop > len(i.dst_kv_indices) for i in infos):
        return False  # (a destination list shorter than the chunk: SGLang's worker trims a slice, not an index array)
    regs = [mgr.decode_kv_args_table.get(eng.peer(i)) for i in infos]
    if not all(r is not None and getattr(r, "ess_progressive", False) for r in regs):
        return False
    odd = [eng.peer(i) for i, r in zip(infos, regs) if not eng.plain(mgr, r)]
    for peer in set(odd) - _warned:
        _warned.add(peer)
        logger.warning("ESS progressive PD: decode peer %s asked for progressive sends, but its KV layout is not the "
                       "plain page path (DCP relayout, another page stride or layer pairing): its rooms go whole", peer)
    return not odd


_warned: set = set()  # decode peers told of above


class OrderedQueue:
    """Stands for a transfer worker's queue (`MooncakeKVManager.transfer_worker`, `NixlKVManager.transfer_worker`):
    SGLang's chunks as they come, a progressive request's last chunk as its parts, and a progress report for each part
    once sent. `hot(mgr, chunk, prefix_pages)` gives the warm-up pages of a chunk's request, hottest first; `executor`
    is Mooncake's worker's (None for NIXL)."""

    def __init__(self, queue, mgr, executor, hot):
        self.queue, self.mgr, self.executor, self.hot = queue, mgr, executor, hot
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
                take_need(self.sent.room)  # the room has concluded: a NEED that came late is dropped
            if not live(self.mgr, self.sent.room):  # aborted or cleared: the worker skips the room's parts left
                fail_held(self.mgr, self.sent.room, "the prefill node ended the transfer (aborted or cleared)")
        if self.pending:
            try:
                self._urgent(self.pending[0].room)
            except Exception:
                logger.exception("ESS progressive PD: pages a decode step waits for could not be sent ahead")
            chunk = self.pending.popleft()
        else:
            chunk = self.queue.get()
            try:
                if progressive_room(self.mgr, chunk):
                    chunk = self._split(chunk)
            except Exception:
                logger.exception("ESS progressive PD: the last chunk of room %s goes unsplit", chunk.room)
        self.sent = chunk
        _worker.part = getattr(chunk, "ess", None)
        return chunk

    def _split(self, chunk):
        if chunk.indices_event is not None:  # the indices were copied to the host asynchronously
            chunk.indices_event.synchronize()
        if isinstance(chunk.prefill_kv_indices, torch.Tensor):
            chunk.prefill_kv_indices = chunk.prefill_kv_indices.numpy()
        infos = self.mgr.transfer_infos.get(chunk.room, {}).values()
        prefix = next((i.decode_prefix_len for i in infos if i.decode_prefix_len), 0)
        prefix_pages = prefix // self.mgr.kv_args.page_size
        head, *rest = split(chunk, prefix_pages, self.hot(self.mgr, chunk, prefix_pages))
        self.pending.extend(rest)
        return head

    def _urgent(self, room: int) -> None:
        """The (layer, page) blocks a decode step waits for, sent now through SGLang's own transfer of KV blocks,
        one layer at a time, and reported; they are among the phase-3 parts not sent yet (a page sent already has
        landed or is the part just sent, reported before this). The part still sends them with their page later."""
        needs = take_need(room)
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
            ok, eng = True, engine(mgr)
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


# Rooms whose phase-1 Success is held back, -> their decode endpoints (captured then: SGLang's clear() of the sender
# drops them). A room leaves on its conclusion; until then its request may be decoding on the decode node, which must
# hear of an end.
_held: dict[int, list] = {}
_held_lock = threading.Lock()


def hold_conclusion(mgr, room: int, status) -> bool:
    """Inside a transfer worker: whether SGLang's conclusion of `room` is a phase1 part's Success, to hold back until
    the part `end` (the decode node learns of phase 1 from ESS's report instead). A room failed already is not held:
    SGLang concludes it Failed and tells the decode node."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    part = current()
    if part is None or part.kind != "phase1" or status != KVPoll.Success or not live(mgr, room):
        return False
    part.held = True
    with _held_lock:
        _held[room] = list(mgr._room_notify_targets(room))
    return True


def concluded(mgr, room: int, result) -> None:
    """After SGLang concluded `room` (not held): it is held no more. SGLang concludes nothing for a room its sender
    has cleared (`conclude_transfer` returns None); if that room's Success was held, its request may be decoding, so
    the decode node hears Failed from ESS."""
    with _held_lock:
        targets = _held.pop(room, None)
    take_need(room)
    if targets is not None and result is None:
        _tell_failed(mgr, room, targets, "the prefill node cleared the room before its transfer ended")


def fail_held(mgr, room: int, reason: str) -> None:
    """A held room the prefill node no longer sends (SGLang's AbortReq, or its sender cleared) ends without a
    conclusion of SGLang's (it skips the rest of the room's chunks): the decode node, whose request may be decoding and
    waiting for a row, hears Failed now, not at its waiting timeout. Not when SGLang poisoned the room (a write of it
    may still be landing, so it leaves the room to the decode node's timeout rather than free its pages)."""
    with _held_lock:
        targets = _held.pop(room, None)
    take_need(room)
    if targets is not None and room not in mgr._deferred_ack_poisoned_rooms:
        _tell_failed(mgr, room, targets, reason)


def _tell_failed(mgr, room: int, targets: list, reason: str) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    logger.warning("ESS progressive PD: room %s: %s; the decode node is told it failed", room, reason)
    mgr.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)


def skip_metadata() -> bool:
    """Inside a transfer worker: the part `end` sends no metadata (phase 1 did)."""
    part = current()
    return part is not None and part.kind == "end"


_needs: dict[int, dict] = {}  # bootstrap room -> {layer: pages} decode steps wait for (the bootstrap thread writes)
_needs_lock = threading.Lock()


def note_need(msg: list, mgr) -> bool:
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
    with _needs_lock:
        if room in mgr.transfer_infos and live(mgr, room) and mgr.request_status.get(room) != KVPoll.Success:
            _needs.setdefault(room, {}).setdefault(layer, set()).update(pages)
    return True


def take_need(room: int) -> dict | None:
    """{layer: pages int64, ascending} asked for `room` since the last call, or None."""
    with _needs_lock:
        got = _needs.pop(room, None)
    return None if not got else {layer: np.fromiter(sorted(p), dtype=np.int64) for layer, p in got.items()}


# -- the decode node -----------------------------------------------------------------------------------------------
INBOX: dict[int, list] = {}  # bootstrap room -> its progress events not yet read
_inbox_lock = threading.Lock()


def take(msg: list, mgr) -> bool:
    """A message of the decode node's listener thread: a progress report into INBOX (True), or not one (False). Kept
    only for a room still open and served by one prefill rank (the rooms `reports` reads)."""
    if not msg or msg[0] != TAG:
        return False
    try:
        room, kind, payload = int(msg[1]), msg[2].decode(), msg[3]
        if kind not in (*KINDS, "layer"):
            raise ValueError(kind)
        if kind == "phase1":
            got = [("pages", torch.arange(int(payload)), None), ("phase1",)]
        elif kind == "layer":  # one layer of some pages: [layer, pages...]
            v = torch.from_numpy(np.frombuffer(payload, dtype=np.int32).astype(np.int64))
            got = [("pages", v[1:], v[:1])]
        else:
            got = [("pages", torch.from_numpy(np.frombuffer(payload, dtype=np.int32).astype(np.int64)), None)]
            if kind == "phase2":
                got.append(("phase2",))
    except (IndexError, ValueError, UnicodeDecodeError):
        logger.warning("ESS progressive PD: a malformed progress message dropped")
        return True
    with _inbox_lock:  # checked under the lock: forget() runs after SGLang's clear()
        if room in mgr.request_status and mgr.required_prefill_response_num_table.get(room) == 1:
            INBOX.setdefault(room, []).extend(got)
    return True


def reports(receiver) -> bool:
    """Whether a Mooncake or NIXL receiver's progress is read: its room is served by one prefill rank."""
    mgr = getattr(receiver, "kv_mgr", None)
    table = getattr(mgr, "required_prefill_response_num_table", None)
    return table is not None and table.get(receiver.bootstrap_room) == 1


def events(receiver) -> list:
    """The progress events of a receiver's room since the last call (sglang_ess.progressive's format)."""
    with _inbox_lock:
        return INBOX.pop(receiver.bootstrap_room, [])


def forget(room) -> None:
    with _inbox_lock:
        INBOX.pop(room, None)


def ask(receiver, layer: int, pages: torch.Tensor) -> None:
    """Decode node: name the request pages [n] a step waits for at `layer` to the prefill node(s) sending them,
    through the sockets SGLang's receiver opened to them. A send that fails costs only the priority: they still come."""
    frames = [NEED, str(receiver.bootstrap_room).encode(), str(layer).encode(), pages.to(torch.int32).numpy().tobytes()]
    for info in receiver.bootstrap_infos or []:
        if info.get("is_dummy"):
            continue
        try:
            sock, lock = receiver._connect_to_bootstrap_server(info)
            with lock:
                sock.send_multipart(frames)
        except Exception as e:
            logger.warning("ESS progressive PD: could not ask for the pages of room %s: %s", receiver.bootstrap_room, e)
