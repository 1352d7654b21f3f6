"""Shared helpers of the progressive PD tests over SGLang's real Mooncake and NIXL objects. Both nodes run in this
process, per engine (the `pd` fixture, once per test module and engine): SGLang's bootstrap server (HTTP), a prefill
and a decode KV manager (their ZMQ sockets and threads), its KV sender and receiver (and for Mooncake SGLang's
MooncakeTransferEngine wrapper), with ESS's hooks on them. Only the native library under them is the tests' (the
loopback libraries below): it needs an RDMA NIC (Mooncake) or UCX and its plugins (NIXL), neither installed here.

The decode node's constants and helpers are the parent conftest's fixtures (no test file or conftest imports another,
test/test_repo.py): a helper here that uses them is a fixture returning the helper; the others reach the tests as
session fixtures of the same names (`shared`, at the end)."""

import ctypes
import dataclasses
import os
import socket
import sys
import threading
import time
import types
import unittest.mock

import numpy as np
import pytest
import torch

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.decode import DecodeRequest  # noqa: E402
from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402


HOST_ROWS, IDX_K = 64 * 8 + 1, 132  # the decode node's host pool rows (128 pages of 4), index-K bytes per token


class LoopbackWrites:
    """What both loopback libraries do with one write: a write whose destination `hold` names waits until `go` is set,
    so a test sees a request join while part of its KV is in flight; one `fail` names then fails, as a broken link
    would; `log` keeps every destination in writing order."""

    def __init__(self):
        self.log, self.lock = [], threading.Lock()
        self.hold, self.fail, self.go = (lambda dst: False), (lambda dst: False), threading.Event()

    def _write(self, dst: int, src: int, n: int) -> bool:
        if self.hold(dst):
            self.go.wait(20)
        if self.fail(dst):
            return False
        ctypes.memmove(dst, src, n)
        with self.lock:
            self.log.append(dst)
        return True


class LoopbackEngine(LoopbackWrites):
    """mooncake.engine.TransferEngine, the native RDMA engine (not installed here; it needs an RDMA NIC), for one
    process: a write copies the bytes (ctypes.memmove) between registered regions, refusing one outside them as the
    native engine does (hold, fail and log: LoopbackWrites)."""

    sessions: dict = {}

    def __init__(self):
        super().__init__()
        self.regions = {}

    def initialize(self, hostname, metadata_server, protocol, device_name):
        self.port = 40000 + len(LoopbackEngine.sessions)
        LoopbackEngine.sessions[self.port] = self
        return 0

    def get_rpc_port(self):
        return self.port

    def get_engine(self):
        return self

    def register_memory(self, ptr, length):
        self.regions[int(ptr)] = int(length)
        return 0

    def batch_register_memory(self, ptrs, lengths):
        return min([self.register_memory(p, n) for p, n in zip(ptrs, lengths)] + [0])

    def unregister_memory(self, ptr):
        return 0 if self.regions.pop(int(ptr), None) is not None else -1

    def batch_unregister_memory(self, ptrs):
        return min([self.unregister_memory(p) for p in ptrs] + [0])

    def _inside(self, engine, addr, n):
        return any(b <= addr and addr + n <= b + size for b, size in engine.regions.items())

    def batch_transfer_sync_write(self, session_id, srcs, dsts, lengths):
        peer = LoopbackEngine.sessions.get(int(str(session_id).rsplit(":", 1)[1]))
        if peer is None or not all(self._inside(self, s, n) and self._inside(peer, d, n)
                                   for s, d, n in zip(srcs, dsts, lengths)):
            return -1
        for s, d, n in zip(srcs, dsts, lengths):
            if not self._write(d, s, n):
                return -1
        return 0

    def transfer_sync_write(self, session_id, src, dst, length):
        return self.batch_transfer_sync_write(session_id, [src], [dst], [length])

    def send_probe(self, session_id):
        return 0


class LoopbackAgent(LoopbackWrites):
    """nixl._api.nixl_agent for one process: a descriptor list is (address, length) rows of one memory kind, a transfer
    copies them (ctypes.memmove) between this agent's registered regions and its peer's, refusing one outside them or
    of another memory kind, as NIXL's backends do (hold, fail and log: LoopbackWrites). A posted
    transfer is in progress (PROC) until its state has been read once; the copy runs at the next read."""

    agents: dict = {}

    def __init__(self, name, config=None):
        super().__init__()
        self.name, self.regions, self.peers = name, {}, set()
        LoopbackAgent.agents[name] = self

    def create_backend(self, backend, params):
        return None

    def get_plugin_list(self):
        return ["UCX"]

    def register_memory(self, addrs, mem_kind):
        for addr, length, *_ in addrs:
            self.regions[int(addr)] = (int(length), mem_kind)
        return list(addrs)

    def get_agent_metadata(self):
        return self.name.encode()

    def add_remote_agent(self, metadata):
        self.peers.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name):
        self.peers.discard(name)

    def check_remote_metadata(self, name):
        return name in self.peers

    @staticmethod
    def _rows(descs):
        """(address, length) rows of descriptors: (addr, len, dev) rows, a list made here, or (addr, len, dev, stride,
        count) runs."""
        if isinstance(descs, types.SimpleNamespace):
            return descs.rows
        a = np.asarray([tuple(d)[:3] for d in descs] if isinstance(descs, list) else descs, dtype=np.uint64)
        a = a.reshape(len(a), -1)
        if a.shape[1] == 5:
            return np.concatenate([np.stack([addr + np.arange(n, dtype=np.uint64) * stride,
                                             np.full(n, length, dtype=np.uint64)], 1)
                                   for addr, length, _, stride, n in a.tolist()])
        return a[:, :2]

    def get_xfer_descs(self, descs, mem_kind):
        return types.SimpleNamespace(agent=self.name, rows=self._rows(descs), kind=mem_kind)

    def prep_xfer_dlist(self, agent_name, descs, mem_kind):
        return types.SimpleNamespace(agent=agent_name or self.name, rows=self._rows(descs), kind=mem_kind)

    def _xfer(self, src, s_rows, dst, d_rows, peer):
        return types.SimpleNamespace(peer=peer, kinds=(src.kind, dst.kind), state="PROC",
                                     pairs=list(zip(s_rows[:, 0], d_rows[:, 0], s_rows[:, 1])))

    def make_prepped_xfer(self, op, src, src_indices, dst, dst_indices, *a, **kw):
        return self._xfer(src, src.rows[np.asarray(src_indices)], dst, dst.rows[np.asarray(dst_indices)], dst.agent)

    def initialize_xfer(self, op, src, dst, peer_name, *a, **kw):
        return self._xfer(src, src.rows, dst, dst.rows, peer_name)

    @staticmethod
    def _inside(agent, addr, n, kind):
        return any(b <= addr and addr + n <= b + size and k == kind for b, (size, k) in agent.regions.items())

    def transfer(self, handle, *a, **kw):
        handle.checks = 0
        return "PROC"

    def check_xfer_state(self, handle):
        """PROC at the first check, then the bytes land (or fail): a sender that does not wait never sees them
        written."""
        handle.checks += 1
        if handle.state == "PROC" and handle.checks > 1:
            self._copy(handle)
        return handle.state

    def _copy(self, handle):
        peer = LoopbackAgent.agents.get(handle.peer)
        handle.state = "DONE"
        for s, d, n in ((int(s), int(d), int(n)) for s, d, n in handle.pairs):
            if peer is None or handle.peer not in self.peers or not (self._inside(self, s, n, handle.kinds[0])
                                                                     and self._inside(peer, d, n, handle.kinds[1])):
                handle.state = "ERR"
                break
            if not self._write(d, s, n):
                handle.state = "ERR"
                break


@pytest.fixture(scope="session")
def kv_args(L, PAGE):
    """kv_args(kv, index_k, meta, prefill): a node's KVArgs (the helper inside)."""

    def kv_args(kv: torch.Tensor, index_k: torch.Tensor, meta: MetadataBuffers, prefill: bool):
        """KVArgs as SGLang's bootstrap and prealloc queues fill them for a DSA model's paged MLA pool (no draft
        model)."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.mooncake.conn import KVArgs
        from sglang.srt.disaggregation.utils import append_state_component

        a = KVArgs()
        a.engine_rank = a.pp_rank = a.system_dp_rank = 0
        a.kv_cache_dtype_str, a.kv_layout, a.page_size, a.ib_device, a.gpu_id = "fp8_e4m3", None, PAGE, None, 0
        if prefill:
            a.rust_http_port, a.prefill_start_layer, a.prefill_end_layer = None, 0, L
        a.kv_data_ptrs = [t.data_ptr() for t in kv]
        a.kv_data_lens = [t.nbytes for t in kv]
        a.kv_item_lens = [kv[0][0].nbytes * PAGE] * L
        a.num_draft_entries, a.kv_layer_ids = 0, []
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_dim_per_tensor, a.state_slice_outer_counts = [], []
        a.state_layer_ids, a.state_conv_shard_groups = [], []
        a.is_hybrid_mla_backend, a.swa_kv_cache_layout, a.mla_compression_ratios = False, None, None
        append_state_component(a, StateType.DSA, [t.data_ptr() for t in index_k], [t.nbytes for t in index_k],
                               [IDX_K * PAGE] * L)
        return a

    return kv_args


class DaemonThread(threading.Thread):
    def __init__(self, *a, **kw):
        super().__init__(*a, **{**kw, "daemon": True})


def engine_library(backend: str) -> dict:
    """The native modules SGLang's engine imports, as the tests' loopback library."""
    if backend == "mooncake":
        native = types.ModuleType("mooncake.engine")
        native.TransferEngine = LoopbackEngine
        return {"mooncake": types.ModuleType("mooncake"), "mooncake.engine": native}
    api = types.ModuleType("nixl._api")
    api.nixl_agent, api.nixl_agent_config = LoopbackAgent, lambda **kw: kw
    api.nixl_thread_sync_t = types.SimpleNamespace(NIXL_THREAD_SYNC_STRICT="strict")
    return {"nixl": types.ModuleType("nixl"), "nixl._api": api}


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pd(request, plugin, gloo, kv_args, L, K, CTX):
    """The two nodes (see the module docstring) over one engine. ESS's process state holds both roles' parts: a
    prefill node's sender and warm-up rows, a decode node's runtime (each test's)."""
    import importlib

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs
    from sglang_ess.pd import warmup as pd_warmup

    backend = request.param
    library = engine_library(backend)
    # the loopback agent stands for a GPU machine's NIXL, which keeps VRAM and DRAM apart: the CPU path's agent asks
    # for host memory kinds (sglang_ess.cpu.patches), which would hide a send of the wrong kind from its check
    kinds = pytest.MonkeyPatch()
    kinds.setattr("sglang_ess.cpu.patches.HOST_MEMORY_KINDS", {})
    env, modules = dict(os.environ), {m: sys.modules.get(m) for m in library}
    saved, saved_pd = dataclasses.replace(plugin.state), dataclasses.replace(plugin.state.pd)
    os.environ.update(SGLANG_HOST_IP="127.0.0.1", SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="30",
                      SGLANG_DISAGGREGATION_WAITING_TIMEOUT="30")
    sys.modules.update(library)
    conn = importlib.import_module(f"sglang.srt.disaggregation.{backend}.conn")
    names = {"mooncake": "Mooncake", "nixl": "Nixl"}[backend]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sa = ServerArgs(model_path="dummy", device="cpu", host="127.0.0.1", disaggregation_mode="prefill",
                    disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=port)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(pp_group=None)  # no torch.distributed groups here; read only when pp > 1
    if backend == "mooncake":
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

        mte._mooncake_transfer_engine = None  # the process's one engine, as SGLang's shared-engine start makes it
        mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    getattr(conn, f"{names}KVBootstrapServer")(host="127.0.0.1", port=port)
    addr = f"127.0.0.1:{port}"
    plugin.state.pd.wire = (L, K)
    d_meta = meta_buffers()
    p_meta = meta_buffers()  # the prefill node's warm-up rows (state.pd.warmup_rows: the last built)
    plugin.state.pd.sender = pd_warmup.WarmupSender(L, K, 4, torch.zeros(5, CTX, dtype=torch.int32), CTX)
    host = torch.zeros(L, HOST_ROWS, 656, dtype=torch.uint8)
    p_kv = torch.zeros(L, HOST_ROWS - 1, 656, dtype=torch.uint8)
    p_idx, d_idx = (torch.zeros(L, HOST_ROWS - 1, IDX_K, dtype=torch.uint8) for _ in range(2))
    manager = getattr(conn, f"{names}KVManager")
    # SGLang's NIXL prefill bootstrap thread is no daemon (a server exits through its own shutdown): here it would keep
    # pytest's process from exiting, so the managers' threads start as daemons
    with unittest.mock.patch.object(threading, "Thread", DaemonThread):
        p_mgr = manager(kv_args(p_kv, p_idx, p_meta, True), DisaggregationMode.PREFILL, sa, is_mla_backend=True)
        d_mgr = manager(kv_args(host, d_idx, d_meta, False), DisaggregationMode.DECODE, sa, is_mla_backend=True)
    until(lambda: d_mgr.try_ensure_parallel_info(addr), "the bootstrap server did not answer", step=0.05)
    # the writer: the process's one Mooncake engine, or the prefill node's NIXL agent
    engine = mte._mooncake_transfer_engine.engine if backend == "mooncake" else p_mgr.agent
    yield types.SimpleNamespace(addr=addr, p_mgr=p_mgr, d_mgr=d_mgr, p_meta=p_meta, d_meta=d_meta, host=host,
                                p_kv=p_kv, p_idx=p_idx, d_idx=d_idx, engine=engine, backend=backend,
                                sender=getattr(conn, f"{names}KVSender"), receiver=getattr(conn, f"{names}KVReceiver"),
                                peer=d_mgr.get_session_id() if backend == "mooncake" else d_mgr.agent.name)
    for f in dataclasses.fields(saved):
        setattr(plugin.state, f.name, getattr(saved, f.name))
    for f in dataclasses.fields(saved_pd):
        setattr(plugin.state.pd, f.name, getattr(saved_pd, f.name))
    os.environ.clear()
    os.environ.update(env)
    for m, mod in modules.items():
        sys.modules.pop(m) if mod is None else sys.modules.__setitem__(m, mod)
    kinds.undo()


def meta_buffers() -> MetadataBuffers:
    return MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)


ROOMS = iter(range(7000, 8000))


@pytest.fixture(scope="session")
def PROMPT_PAGES(CTX, PAGE):
    """The prompt's pages, 10: pages 0, 1 go in an earlier chunk, 2 .. 9 in the last."""
    return CTX // PAGE


@pytest.fixture(scope="session")
def warmup_entries(K):
    """warmup_entries(): the warm-up state the prefill node sends (the helper inside)."""

    def warmup_entries() -> torch.Tensor:
        """The warm-up state of hot_and_rest: its rows are on pages 9, 8, 7."""
        from sglang_ess.pd import warmup as pd_warmup

        positions = torch.tensor([[39, 38, 33, 30], [36, 35, 34, 32]])
        windows = torch.tensor([[31, 31, 30, 20], [31, 30, 30, 29]])
        return pd_warmup.compact((positions << pd_warmup.WINDOW_BITS) | windows, pd_warmup.entries_per_layer(K))

    return warmup_entries


@pytest.fixture(scope="session")
def send_over_engine(L, K, CTX, STEPS, PAGE, SLOT, FIRST_TOKEN, PROMPT_PAGES, rows_of, transfer_queue,
                     warmup_entries, hold_pages):
    """send_over_engine(mc, rt, pool, gloo, ...): a request's transfer over the engine (the helper inside)."""

    def send_over_engine(mc, rt, pool, gloo, hold=frozenset(), prefix=0, fail=False, kinds=("DRAM",) * L):
        """A request's prefill-to-decode transfer through SGLang's sender and receiver: its decode pages and token table
        rows, the prefill node's rows of its prompt (each row the one a full transfer's node holds), the receiver's
        metadata, then SGLang's two sends (2 pages, then the rest with index-K and the metadata), the engine holding
        back the request's pages in `hold`. The decode node's radix cache holds the first `prefix` pages already
        (SGLang's decode_prefix_len): they are not sent. NIXL: the decode node registers its KV layers as `kinds` (ESS's
        host layers are DRAM). Returns the transfer queue, the request, its receiver and sender, its decode pages and
        the metadata allocator."""
        from sglang_ess.pd import warmup as pd_warmup

        room = next(ROOMS)
        g = torch.Generator().manual_seed(room)
        d_pages = torch.randperm(HOST_ROWS // PAGE - 1, generator=g)[:-(-(CTX + STEPS + 1) // PAGE)] + 1
        s_pages = torch.randperm(HOST_ROWS // PAGE - 1, generator=g)[:PROMPT_PAGES] + 1
        t = torch.arange(CTX + STEPS + 1)
        pool.req_to_token[SLOT] = (d_pages[t // PAGE] * PAGE + t % PAGE).int()
        s_loc, d_loc = s_pages[t[:CTX] // PAGE] * PAGE + t[:CTX] % PAGE, pool.req_to_token[SLOT, :CTX].long()
        for layer in range(L):
            mc.p_kv[layer][s_loc] = rows_of(d_loc, layer)
            mc.p_idx[layer][s_loc] = (t[:CTX, None] + layer + room).to(torch.uint8)
            mc.host[layer][d_loc[:prefix * PAGE]] = rows_of(d_loc[:prefix * PAGE], layer)  # the decode node's cache
        meta = mc.d_meta
        meta.bootstrap_room.zero_()
        alloc = ReqToMetadataIdxAllocator(4)
        q = transfer_queue(meta, alloc, gloo)
        # SGLang's default, as the managers': a failed room's KV waits for drain acks
        q.enable_deferred_kv_release = True
        sender = mc.sender(mc.p_mgr, mc.addr, room)
        with mc.d_mgr.connection_lock:  # the decode node registers anew, as a newly launched one would (its flags)
            mc.d_mgr.connection_pool.clear()
        if mc.backend == "nixl":  # SGLang's NIXL keeps a known agent's first registration; a new node is a new agent
            mc.p_mgr.decode_kv_args_table.pop(mc.peer, None)
            mc.d_mgr.kv_args.kv_data_mem_kinds = list(kinds)
            mc.d_mgr.register_buffer_to_engine()
        receiver = mc.receiver(mc.d_mgr, mc.addr, room)
        receiver.init(prefill_dp_rank=0)
        d_slot = alloc.alloc()
        dst = d_pages[prefix:PROMPT_PAGES].numpy().astype("int32")
        receiver.send_metadata(dst, aux_index=d_slot, state_indices=[dst], decode_prefix_len=prefix * PAGE)
        until(lambda: sender.poll() == KVPoll.WaitingForInput,
              "the prefill node never heard of the decode node's metadata", step=0.01)
        p_slot = 1
        mc.p_meta.output_ids[p_slot][0] = FIRST_TOKEN  # what SGLang's set_buf writes for the request
        mc.p_meta.bootstrap_room[p_slot, 0] = room
        pd_warmup.write_row(mc.p_meta.ess_warmup[p_slot], L, pd_warmup.entries_per_layer(K), warmup_entries(), 4, room)
        req = Req("r", "", [1] * CTX, SamplingParams(max_new_tokens=8), bootstrap_room=room)
        req.kv.req_pool_idx = SLOT
        req.bootstrap_host = "127.0.0.1"
        q.queue.append(DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=d_slot))
        src = s_pages[prefix:].numpy().astype("int32")
        hold_pages(mc, d_pages, hold, fail)
        mc.engine.log.clear()
        sender.init(len(src), aux_index=p_slot)
        sender.send(src[:2])
        sender.send(src[2:], state_indices=[src])
        return q, req, receiver, sender, d_pages, alloc

    return send_over_engine


@pytest.fixture(scope="session")
def page_of(L, PAGE):
    """page_of(mc, dst, d_pages): the request's page a write went to (the helper inside)."""

    def page_of(mc, dst: int, d_pages) -> int | None:
        """The request's page a decode-node KV write went to, or None (metadata, index-K)."""
        for layer in range(L):
            off = dst - mc.host[layer].data_ptr()
            if 0 <= off < mc.host[layer].nbytes:
                hit = (d_pages == off // (656 * PAGE)).nonzero()
                return int(hit[0]) if len(hit) else None
        return None

    return page_of


@pytest.fixture(scope="session")
def hold_pages(page_of):
    """hold_pages(mc, d_pages, pages, fail): the engine holds these pages' writes (the helper inside)."""

    def hold_pages(mc, d_pages, pages, fail=False):
        """The engine holds every write to these request pages (any layer) until mc.engine.go is set; fail: the write
        then fails."""
        mc.engine.go.clear()
        mc.engine.hold = lambda dst: page_of(mc, dst, d_pages) in pages
        mc.engine.fail = lambda dst: fail and page_of(mc, dst, d_pages) in pages

    return hold_pages


@pytest.fixture(scope="session")
def over_engine(decode_node, send_over_engine):
    """over_engine(plugin, monkeypatch, mc, gloo, ...): a decode node, a request sent to it (the helper inside)."""

    def over_engine(plugin, monkeypatch, mc, gloo, progressive=True, **send):
        """A decode node's runtime over the module's host pool, and a request sent to it (send_over_engine)."""
        rt, pool = decode_node(progressive, host=mc.host)
        monkeypatch.setattr(plugin.state, "runtime", rt)
        return (rt, pool, *send_over_engine(mc, rt, pool, gloo, **send))

    return over_engine


def until(done, what: str, step=0.005, seconds=20) -> None:
    """Poll `done()` every `step` s until it holds; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(step)


def drain(rt, q, seconds=20) -> None:
    """Pump the joined requests' transfers, as SGLang's loop does between forwards, until none is landing."""
    deadline = time.monotonic() + seconds
    while rt.progressive.streams and time.monotonic() < deadline:
        rt.progressive.pump(q)
        time.sleep(0.005)


def pop_until_joined(q, req) -> None:
    until(lambda: q.pop_transferred() == [req], "the request never joined decode")


def nothing_left(plugin, mc, rt, sender) -> None:
    """Once a room has ended and the prefill node's scheduler cleared its sender (as SGLang's does on Success or
    Failed): no state of it on either node, SGLang's or ESS's."""
    room = sender.bootstrap_room
    sender.clear()
    # the worker skips the parts left of a failed room
    until(lambda: not mc.p_mgr._staging_outstanding.get(room, 0), "the prefill worker still counts a chunk of the room")
    assert room not in mc.p_mgr.request_status and room not in mc.p_mgr.transfer_infos
    assert plugin.state.pd.take_need(room) is None and room not in plugin.state.pd.held
    assert room not in mc.d_mgr.request_status and room not in plugin.state.pd.inbox
    assert room not in mc.d_mgr.failure_records and room not in mc.d_mgr._deferred_abort_ack_tracker
    assert rt.progressive.streams == {} and rt.progressive.held == {} and rt.progressive.tracker.open_rows() == []
    assert int((rt.progressive.tracker.slot_of >= 0).sum()) == 0


# each constant and helper above, as a session fixture of its name (tests import no test module: test/test_repo.py);
# the default argument binds the value (pytest takes no fixture for an argument with a default)
for _name in ("until", "drain", "pop_until_joined", "nothing_left"):
    globals()[f"shared_{_name}"] = pytest.fixture(name=_name, scope="session")(lambda _v=globals()[_name]: _v)
