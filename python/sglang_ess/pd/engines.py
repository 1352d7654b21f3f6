"""The PD transfer engines as progressive PD transfer uses them (docs/pd.md, "Progressive PD transfer"): one
interface, `Engine`, with a half for each node; SGLang's Mooncake and NIXL managers behind it (`Mooncake`, `Nixl`);
and the messages ESS sends over their sockets.

SGLang 0.5.23 gives both managers one shape (CommonKVManager, CommonKVReceiver: one transfer worker per room, status
sockets, abort counting, conclusion), so their decode halves are one (`SglangEngine`): the prefill node's progress
reports come over SGLang's ZMQ path to the decode endpoints, which the engine's listener thread hands to ESS first
(`take`, into the process's inbox: sglang_ess.pd.state); a decode step's NEED goes back over the sockets SGLang's
receiver opened to its bootstrap servers. What differs is the prefill half: how a peer is named, which peers take
the plain page path, how one layer's pages are written.

Messages, prefill -> decode: [TAG, room, kind, payload], kind one of KINDS or "layer" (sglang_ess.pd.sending says
what each carries); decode -> prefill: [NEED, room, layer, pages int32]; a progressive decode rank appends
REGISTRATION to its engine registration.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from sglang_ess.pd.state import PdState

logger = logging.getLogger("sglang_ess")

TAG = b"ESS_PROGRESS"  # a progress message, prefill -> decode
NEED = b"ESS_NEED"  # pages a decode step waits for, decode -> prefill
REGISTRATION = b"ESS_PROGRESSIVE/1"  # the last frame of a progressive decode rank's engine registration
KINDS = ("phase1", "phase2", "phase3", "end")  # the parts; a report's kind may also be "layer" (a step's pages)


class Engine:
    """A transfer engine, as ESS's progressive PD code asks it.

    Decode node (sglang_ess.pd.landing.ProgressiveDecode asks it of each receiver in SGLang's transfer queue):
        reports(receiver)            the receiver is this engine's and its progress is read (otherwise its request
                                     joins after its whole transfer)
        events(receiver)             its progress since the last call: ("phase1",), ("pages", request pages [n],
                                     layers [m] or None: all), ("phase2",)
        ask(receiver, layer, pages)  name the pages a step waits for at `layer` to their sender, ahead of the rest
        forget(receiver)             drop what it reported and was not read
    Prefill node (sglang_ess.pd.sending.OrderedQueue sends through it):
        peer(info)                   the decode peer of one of a room's transfer infos
        plain(mgr, reg)              that peer's layout takes the plain page path (pages paired by index)
        send_layer(...)              write one layer's pages to the peer, waiting until they landed; False if not
        NO_SEND                      what the manager's send_aux returns for a send ESS skips
    An engine that only receives (the tests' loopback) implements the decode node's half."""

    NO_SEND: object = None

    def reports(self, receiver) -> bool:
        raise NotImplementedError

    def events(self, receiver) -> list:
        raise NotImplementedError

    def ask(self, receiver, layer: int, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def forget(self, receiver) -> None:
        raise NotImplementedError

    def peer(self, info) -> str:
        raise NotImplementedError

    def plain(self, mgr, reg) -> bool:
        raise NotImplementedError

    def send_layer(self, mgr, info, reg, layer: int, src: np.ndarray, dst: np.ndarray, executor) -> bool:
        raise NotImplementedError


class SglangEngine(Engine):
    """The decode half SGLang's Mooncake and NIXL share. `pd` is the process's state (its inbox)."""

    def __init__(self, pd: PdState):
        self.pd = pd

    @staticmethod
    def receiver_type() -> type:
        raise NotImplementedError

    def reports(self, receiver) -> bool:
        """A receiver of this engine whose room is served by one prefill rank (a room several ranks serve, prefill
        pipeline parallelism, is not read early)."""
        if not isinstance(receiver, self.receiver_type()):
            return False
        table = getattr(getattr(receiver, "kv_mgr", None), "required_prefill_response_num_table", None)
        return table is not None and table.get(receiver.bootstrap_room) == 1

    def events(self, receiver) -> list:
        return self.pd.events(receiver.bootstrap_room)

    def forget(self, receiver) -> None:
        self.pd.forget(getattr(receiver, "bootstrap_room", None))

    def ask(self, receiver, layer: int, pages: torch.Tensor) -> None:
        """Through the sockets SGLang's receiver opened to its prefill node(s). A send that fails costs only the
        priority: the pages still come."""
        frames = [NEED, str(receiver.bootstrap_room).encode(), str(layer).encode(),
                  pages.to(torch.int32).numpy().tobytes()]
        for info in receiver.bootstrap_infos or []:
            if info.get("is_dummy"):
                continue
            try:
                sock, lock = receiver._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart(frames)
            except Exception as e:
                logger.warning("ESS progressive PD: could not ask for the pages of room %s: %s",
                               receiver.bootstrap_room, e)


class Mooncake(SglangEngine):
    """SGLang's MooncakeKVManager: peers are Mooncake sessions; a write returns once landed (0) or failed."""

    NO_SEND = 0  # what send_aux returns for a send ESS skips (the worker checks for 0)

    @staticmethod
    def receiver_type() -> type:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

        return MooncakeKVReceiver

    def peer(self, info) -> str:
        return info.mooncake_session_id

    def plain(self, mgr, reg) -> bool:
        return not reg.requires_dcp_relayout

    def send_layer(self, mgr, info, reg, layer: int, src: np.ndarray, dst: np.ndarray, executor) -> bool:
        return mgr._send_kvcache_generic(
            mooncake_session_id=info.mooncake_session_id, src_data_ptrs=[mgr.kv_args.kv_data_ptrs[layer]],
            dst_data_ptrs=[reg.dst_kv_ptrs[layer]], item_lens=[mgr.kv_args.kv_item_lens[layer]],
            prefill_data_indices=src, dst_data_indices=dst, executor=executor) == 0


class Nixl(SglangEngine):
    """SGLang's NixlKVManager: peers are NIXL agents; a write is a posted handle, waited on as the worker waits."""

    NO_SEND = object()  # what send_aux returns for a send ESS skips: a handle `_await_handles` drops (hooks.pd)

    @staticmethod
    def receiver_type() -> type:
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

        return NixlKVReceiver

    def peer(self, info) -> str:
        return info.agent_name

    def plain(self, mgr, reg) -> bool:
        """The peer's layers pair with ours by position, with our page stride: a layer's pages then go through
        SGLang's flat (non-prepared) path, which strides the destination by the source's item length. Memory kinds
        may differ by layer (ESS's host layers DRAM, an MTP draft layer in GPU memory): each layer is sent with its
        own."""
        n = len(mgr.kv_args.kv_item_lens)
        return not reg.requires_dcp_relayout and list(reg.dst_kv_item_lens[:n]) == list(mgr.kv_args.kv_item_lens) \
            and list(reg.dst_kv_layer_ids[:len(mgr.kv_args.kv_layer_ids)]) == list(mgr.kv_args.kv_layer_ids)

    def send_layer(self, mgr, info, reg, layer: int, src: np.ndarray, dst: np.ndarray, executor) -> bool:
        handle = mgr._send_kvcache_generic(
            peer_name=info.agent_name, src_data_ptrs=[mgr.kv_args.kv_data_ptrs[layer]],
            dst_data_ptrs=[reg.dst_kv_ptrs[layer]], item_lens=[mgr.kv_args.kv_item_lens[layer]],
            prefill_data_indices=src, dst_data_indices=dst, dst_gpu_id=reg.gpu_id,
            src_mem_kind=mgr.kv_args.kv_data_mem_kinds[layer], dst_mem_kind=reg.dst_kv_mem_kinds[layer])
        settled, failed = mgr._await_handles([handle], failure_seen=False)
        return settled and not failed


def sglang_engines(pd: PdState) -> tuple[Engine, ...]:
    """SGLang's two engines, over this process's state."""
    return Mooncake(pd), Nixl(pd)


def engine_of(mgr, pd: PdState) -> Engine | None:
    """The Engine of an SGLang KV manager, or None (an engine ESS does not order)."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    return Mooncake(pd) if isinstance(mgr, MooncakeKVManager) else Nixl(pd) if isinstance(mgr, NixlKVManager) else None


def take(pd: PdState, msg: list, mgr) -> bool:
    """A message of the decode node's listener thread: a progress report into the inbox (True), or not one (False).
    Kept only for a room still open and served by one prefill rank (the rooms SglangEngine.reports reads)."""
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
    pd.file(room, got, lambda: room in mgr.request_status and mgr.required_prefill_response_num_table.get(room) == 1)
    return True
