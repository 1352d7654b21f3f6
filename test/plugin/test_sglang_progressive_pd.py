"""Progressive PD transfer on a decode node (--ess-progressive-pd; docs/plugin.md, "Progressive PD transfer"), through
SGLang's real transfer queue (`DecodeTransferQueue.pop_transferred`, its metadata gate and commit), `DecodeRequest`,
`Req`, `MetadataBuffers`, `ReqToMetadataIdxAllocator`, `ReqToTokenPool` and `KVPoll` states, with a loopback transfer
engine that lands a request's chunks in the progressive order with delays."""

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

from ess.core.landing import LandingTracker
from ess.core.send_order import send_order
from sglang_ess.args import EssArgs
from sglang_ess.hooks.shared import state as ess_state
from sglang_ess.pd import engines as pd_engines
from sglang_ess.pd import sending as pd_sending
from sglang_ess.pd.landing import ProgressiveDecode
from sglang_ess.runtime import EssRuntime
from sglang_ess.validate import EssFacts

sglang = pytest.importorskip("sglang")
import torch.distributed as dist  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue  # noqa: E402
from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

L, K, C, CTX, STEPS, PAGE = 2, 8, 12, 40, 6, 4
SLOT, ROOM, FIRST_TOKEN = 3, 4242, 17


def rows_of(loc: torch.Tensor, layer: int) -> torch.Tensor:
    x = (loc.long().unsqueeze(-1) * 7 + layer * 131 + torch.arange(656)) % 251
    return x.to(torch.uint8)


class LoopbackReceiver:
    """A transfer engine for the tests, in the style of SGLang's fake backend (FakeKVReceiver): one request's transfer
    inside this process. Its chunks land in the progressive order, one every `delay` polls: phase 1 (the
    metadata row, as Mooncake's send_aux writes it, standing for index-K and the warm-up state too), the phase-2
    pages, then the phase-3 pages; a landed page's latent rows are copied into the decode node's host pool. It reports
    what landed through `ess_progress`, which its engine (Loopback) hands to sglang_ess.pd.landing."""

    def __init__(self, host, locs, meta: MetadataBuffers, meta_index: int, hot, rest, delay: float, fail_after=None):
        self.host, self.locs, self.meta, self.meta_index = host, locs, meta, meta_index
        self.chunks = [("phase1", None)] + [("pages", int(p)) for p in hot] + [("phase2", None)] + \
                      [("pages", int(p)) for p in rest]
        self.delay, self.fail_after = delay, fail_after
        self.ticks = 0  # the engine's clock: one tick per poll (deterministic, unlike wall time on a loaded CPU)
        self.landed = 0  # chunks landed
        self.log = []  # every event, in landing order
        self.pending = []  # events not yet reported
        self.aborted = self.cleared = False

    def _land(self) -> list:
        if self.aborted:
            return
        self.ticks += 1
        due = min(len(self.chunks), self.ticks // self.delay)
        if self.fail_after is not None:
            due = min(due, self.fail_after)
        events = []
        for kind, page in self.chunks[self.landed:due]:
            if kind == "phase1":  # the metadata row: SGLang's gate reads bootstrap_room, its commit output_ids
                self.meta.output_ids[self.meta_index][0] = FIRST_TOKEN
                self.meta.bootstrap_room[self.meta_index, 0] = ROOM
                events.append(("phase1",))
            elif kind == "phase2":
                events.append(("phase2",))
            else:
                loc = self.locs[page * PAGE:(page + 1) * PAGE].long()
                for layer in range(L):
                    self.host[layer][loc] = rows_of(loc, layer)
                events.append(("pages", torch.tensor([page]), None))
        self.landed = max(self.landed, due)
        self.log += events
        self.pending += events

    def ess_progress(self) -> list:
        """What landed since the last call (a poll lands chunks too)."""
        self._land()
        out, self.pending = self.pending, []
        return out

    def poll(self):
        self._land()
        if self.aborted or (self.fail_after is not None and self.ticks > (self.fail_after + 1) * self.delay):
            return KVPoll.Failed
        return KVPoll.Success if self.landed == len(self.chunks) else KVPoll.Transferring

    def poll_pp_consensus(self):  # what SGLang's poll_and_all_reduce asks each receiver
        return self.poll()

    def abort(self):
        self.aborted = True

    def clear(self):
        self.cleared = True

    def failure_exception(self):
        raise RuntimeError("loopback transfer failed")


class Loopback(pd_engines.Engine):
    """The loopback receivers' engine (sglang_ess.pd.engines.Engine, the decode node's half): each receiver lands its
    own chunks and reports them; it sends in its fixed order, so a step's ask changes nothing."""

    def reports(self, receiver):
        return isinstance(receiver, LoopbackReceiver)

    def events(self, receiver):
        return receiver.ess_progress()

    def ask(self, receiver, layer, pages):
        pass

    def forget(self, receiver):
        pass


@pytest.fixture(scope="module")
def gloo():
    """SGLang's poll all-reduces over the attention-TP gloo group: a one-rank group here."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def transfer_queue(meta: MetadataBuffers, alloc: ReqToMetadataIdxAllocator, gloo) -> DecodeTransferQueue:
    """SGLang's DecodeTransferQueue, its __init__ skipped: that reads SGLang's initialised parallel state and server
    arguments (get_parallel, get_disagg), which need a launched scheduler. The attributes are the ones __init__ sets,
    with the values a decode node without staging, host receive, HiCache or deferred release has; the scheduler is a
    stand-in for the fields pop_transferred and its commit read."""
    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    q.queue, q.gloo_group, q.req_to_metadata_buffer_idx_allocator, q.tp_rank = [], gloo, alloc, 0
    q.metadata_buffers, q.enable_host_receive, q.tree_cache = meta, False, None
    q.enable_staging, q.staging_handler, q.enable_deferred_kv_release, q._deferred_releases = False, None, False, []
    q.deferred_kv_release_timeout = 30
    q._skipped_checksum_signatures = set()
    q.spec_algorithm = SpeculativeAlgorithm.NONE
    q.scheduler = types.SimpleNamespace(
        enable_decode_hicache=False, kv_checksum_computer=None, enable_hisparse=False,
        batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, tok: None),
        output_streamer=types.SimpleNamespace(stream_output=lambda reqs, logprob: None),
        metrics_reporter=types.SimpleNamespace(enable_metrics=False), disagg_decode_prealloc_queue=None)
    return q


def decode_node(progressive: bool, host=None, query_rows=1, overlap="auto"):
    pool = ReqToTokenPool(5, CTX + STEPS + 1, "cpu", False)
    pool.req_to_token[SLOT] = torch.randperm(64 * 8)[: CTX + STEPS + 1].int()  # scattered, as an allocator's
    buffer = C * query_rows  # MTP verify: the union of S top-k sets in one LRU step
    facts = EssFacts("pd-decode", K, L, CTX + STEPS, buffer, query_rows=query_rows)
    ess = EssArgs(enable=True, buffer_tokens=buffer, warmup_windows=0, progressive_pd=progressive, overlap=overlap)
    if host is None:
        host = torch.zeros(L, 64 * 8 + 1, 656, dtype=torch.uint8)  # nothing landed yet
    host.zero_()
    rt = EssRuntime(ess, facts, pool.req_to_token, host=host, device="cpu", backend="torch", kernel="torch")
    if progressive:
        rt.progressive = ProgressiveDecode(LandingTracker(L, CTX + STEPS, 2, 5, "cpu", page=PAGE),
                                           (Loopback(), *pd_engines.sglang_engines(ess_state.pd)))
    return rt, pool


def topk_of(t: int) -> torch.Tensor:
    """Step t's top-k: the newest rows (in the hot pages) and two old rows the phase-3 tail holds."""
    p = CTX + t
    near = [p - 1 - i for i in range(K - 2)]
    far = [13 + 4 * t, 14 + 4 * t]  # pages 3, 4, 5, ...: the phase-3 tail
    return torch.tensor([near + far], dtype=torch.int32)


def decode(rt, pool, steps=STEPS) -> list:
    """Decode steps of the request as the DSA backend asks the runtime: each step's own row into the host pool,
    then per layer the rows its top-k reads (what FlashMLA attends over: equal rows, equal tokens)."""
    out, req = [], torch.tensor([SLOT])
    for t in range(steps):
        for layer in range(L):
            loc = pool.req_to_token[SLOT, CTX + t].view(1)
            rt.cache.host[layer][loc.long()] = rows_of(loc, layer)
            rt.keep_own_rows(layer, rows_of(loc, layer))
            slots = rt.swap_in_selected_pages(req, torch.tensor([CTX + t + 1]), topk_of(t), layer)
            out.append(rt.latent_buffer(layer)[slots.long(), 0].clone())
    return out


def verify(rt, pool, steps=STEPS // 2) -> list:
    """MTP target-verify steps (S = 2 query rows per request: two new positions per step), as the DSA backend asks
    the runtime: [B, S, K] top-k, the union one LRU step."""
    out, req = [], torch.tensor([SLOT])
    for t in range(steps):
        p = CTX + 2 * t
        top_k = torch.cat([topk_of(2 * t), topk_of(2 * t + 1)]).unsqueeze(0)
        for layer in range(L):
            loc = pool.req_to_token[SLOT, p:p + 2]
            rt.cache.host[layer][loc.long()] = rows_of(loc, layer)
            rt.keep_own_rows(layer, rows_of(loc, layer))
            slots = rt.swap_in_selected_pages(req, torch.tensor([p + 1, p + 2]), top_k, layer)
            out.append(rt.latent_buffer(layer)[slots.long().flatten(), 0].clone())
    return out


def hot_and_rest():
    """The prefill node's order for a warm-up state naming the newest rows (pages 9, 8 hottest)."""
    positions = torch.tensor([[39, 38, 33, 30], [36, 35, 34, 32]])
    windows = torch.tensor([[31, 31, 30, 20], [31, 30, 30, 29]])
    return send_order(positions, windows, CTX, PAGE)


def join(plugin, monkeypatch, gloo, delay=2, fail_after=None, query_rows=1, overlap="auto"):
    rt, pool = decode_node(True, query_rows=query_rows, overlap=overlap)
    monkeypatch.setattr(plugin.state, "runtime", rt)
    meta = MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)
    alloc = ReqToMetadataIdxAllocator(4)
    q = transfer_queue(meta, alloc, gloo)
    req = Req("r", "", [1] * CTX, SamplingParams(max_new_tokens=8), bootstrap_room=ROOM)
    req.kv.req_pool_idx = SLOT
    req.bootstrap_host = "10.0.0.2"  # a prefill node's (SGLang's fake-transfer check reads it)
    idx = alloc.alloc()
    hot, rest = hot_and_rest()
    rcv = LoopbackReceiver(rt.cache.host, pool.req_to_token[SLOT, :CTX], meta, idx, hot, rest, delay, fail_after)
    q.queue.append(DecodeRequest(req=req, kv_receiver=rcv, metadata_buffer_index=idx))
    return rt, pool, q, req, rcv, alloc, hot, rest


def land(rt, loc: torch.Tensor) -> None:
    """A full transfer's rows at these token locations of a node's host pool."""
    loc = loc.long()
    for layer in range(L):
        rt.cache.host[layer][loc] = rows_of(loc, layer)


def full_and_joining(plugin, monkeypatch, gloo, **node):
    """A full transfer's node (its request's prompt rows landed) and a progressive one with the same token locations,
    its request in the transfer queue (join). Returns (full node, its pool, the join's results but hot and rest)."""
    full, full_pool = decode_node(False, **node)
    land(full, full_pool.req_to_token[SLOT, :CTX])
    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo, **node)
    pool.req_to_token[SLOT] = full_pool.req_to_token[SLOT]
    rcv.locs = pool.req_to_token[SLOT, :CTX]
    return full, full_pool, rt, pool, q, req, rcv, alloc


def steps_wait_and_equal_the_full_transfers(run, full, full_pool, rt, pool, q) -> None:
    """run(node, pool) -> the rows its steps read: on the full transfer's node, then on the progressive one once its
    request joined; a step waited there, and every row is the full transfer's."""
    want = run(full, full_pool)
    while not q.pop_transferred():
        pass
    got = run(rt, pool)
    assert rt.progressive.waits >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_request_joins_after_the_hot_pages_and_decodes_the_full_transfers_rows(plugin, monkeypatch, gloo):
    """SGLang's poll admits the request once phase 1 and the warm-up pages landed (before the rest), its commit
    takes the first token from the metadata row; every decode step then reads the rows a full transfer's would,
    waiting where its top-k needs a page still in flight."""
    hot, rest = hot_and_rest()
    assert hot.tolist() == [9, 8, 7] and rest.tolist() == list(range(7))  # 39, 38 newest; 33, 34, 35, 36 page 8
    full, full_pool, rt, pool, q, req, rcv, alloc = full_and_joining(plugin, monkeypatch, gloo)
    want = decode(full, full_pool)
    deadline = time.monotonic() + 5
    joined = []
    while not joined and time.monotonic() < deadline:
        joined = q.pop_transferred()
    assert joined == [req] and list(req.output_ids) == [FIRST_TOKEN] and q.queue == []
    kinds = [e[0] for e in rcv.log]
    assert kinds[0] == "phase1" and "phase2" in kinds  # joined once phases 1 and 2 landed
    assert rcv.landed < len(rcv.chunks)  # ... with phase-3 pages still in flight
    assert not rcv.cleared and alloc.available_size() == 4  # the metadata slot is SGLang's again; the transfer goes on
    landed_then = {int(e[1]) for e in rcv.log if e[0] == "pages"}
    assert {7, 8, 9} <= landed_then and 3 not in landed_then  # top-k of step 0 reads rows 13, 14: page 3, not landed

    got = decode(rt, pool)
    assert rt.progressive.waits >= 1  # step 0 waited for page 3
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    deadline = time.monotonic() + 5
    while rt.progressive.streams and time.monotonic() < deadline:  # between forwards, as SGLang's loop polls
        rt.progressive.pump(q)
    assert rcv.poll() == KVPoll.Success and rcv.cleared  # the whole transfer landed: the request is no longer tracked
    assert rt.progressive.tracker.open_rows() == [] and rt.progressive.streams == {}
    order = [int(e[1]) for e in rcv.log if e[0] == "pages"]
    assert order == [9, 8, 7, 0, 1, 2, 3, 4, 5, 6]  # the priority order, as the engine landed it


def test_mtp_verify_steps_wait_and_read_the_full_transfers_rows(plugin, monkeypatch, gloo):
    """MTP target-verify under progressive PD: the union of a step's S top-k sets waits for its unlanded page as a
    decode step does, and every step reads the rows a full transfer's node reads."""
    full, full_pool, rt, pool, q, _, _, _ = full_and_joining(plugin, monkeypatch, gloo, query_rows=2)
    steps_wait_and_equal_the_full_transfers(verify, full, full_pool, rt, pool, q)


def test_tbo_micro_batches_wait_and_read_the_full_transfers_rows(plugin, monkeypatch, gloo):
    """Two-Batch Overlap under progressive PD, DA layers (each micro-batch's LRU step, and its wait, start at its
    indexer; both indexers run before either attention): micro-batch A holds a request whose KV landed whole, B the
    request still landing. B waits for its page; both read the rows a full transfer's node reads."""
    other = SLOT - 1

    def tbo(rt, pool) -> list:
        out, halves = [], (torch.tensor([other]), torch.tensor([SLOT]))
        for t in range(STEPS):
            top_k, pos = topk_of(t), torch.tensor([CTX + t])
            for layer in range(L):
                for half in halves:  # op_prepare of A, then of B: the indexer's step
                    loc = pool.req_to_token[half, CTX + t]
                    rt.cache.host[layer][loc.long()] = rows_of(loc, layer)
                    assert rt.begin(layer, half, pos, top_k)
                for half in halves:  # op_core of A, then of B: the attention call
                    loc = pool.req_to_token[half, CTX + t]
                    rt.keep_own_rows(layer, rows_of(loc, layer))
                    slots = rt.swap_in_selected_pages(half, pos + 1, top_k, layer)
                    out.append(rt.latent_buffer(layer)[slots.long(), 0].clone())
        return out

    full, full_pool, rt, pool, q, _, _, _ = full_and_joining(plugin, monkeypatch, gloo, overlap="da")
    free = torch.tensor([x for x in range(1, 64 * 8) if x not in set(full_pool.req_to_token[SLOT].tolist())])
    other_table = free[torch.randperm(len(free))[: CTX + STEPS + 1]].int()
    for node, node_pool in ((full, full_pool), (rt, pool)):  # A's request: its whole transfer landed on both
        node_pool.req_to_token[other] = other_table
        land(node, other_table[:CTX])
    steps_wait_and_equal_the_full_transfers(tbo, full, full_pool, rt, pool, q)


def test_decode_graphs_wait_out_a_request_still_landing(plugin, monkeypatch, gloo):
    """While a joined request's transfer is still landing, decode batches run eagerly (their steps may wait on the
    host): SGLang's own DP-attention vote (`_local_decode_cuda_graph_vote`, min-reduced across ranks) says eager, and
    so does the decode graph runner's `can_run_graph` (the hook alone: a DecodeCudaGraphRunner needs CUDA to build).
    Graphs come back once the transfer has landed whole."""
    from sglang.srt.managers.scheduler_components import dp_attn

    def graphs() -> tuple:
        return (dp_attn._local_decode_cuda_graph_vote(local_batch=None, disable_cuda_graph=False),
                plugin.pd.after_can_run_graph(True, None, None) is not False)

    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo)
    assert graphs() == (True, True)  # tracked, not joined yet: not in a batch
    while not q.pop_transferred():
        pass
    assert graphs() == (False, False)
    deadline = time.monotonic() + 5
    while rt.progressive.streams and time.monotonic() < deadline:
        rt.progressive.pump(q)
    assert graphs() == (True, True)


def test_an_untracked_request_never_waits(plugin, monkeypatch, gloo):
    rt, pool = decode_node(True)
    land(rt, pool.req_to_token[SLOT, :CTX])
    decode(rt, pool, 2)
    assert rt.progressive.waits == 0


def test_a_request_released_mid_transfer_keeps_its_kv_until_the_transfer_ends(plugin, monkeypatch, gloo):
    """A request that finishes or is aborted after joining, its transfer still landing: SGLang's release_kv_cache
    (through the plugin's hook on it) is held, SGLang's queue reports a pending release, and the release runs once
    the transfer has landed whole: then the tracker slot and GPU rows are let go. A transfer that fails after
    joining aborts its request."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo)
    while not q.pop_transferred():
        pass
    assert rt.progressive.tracker.open_rows() == [SLOT] and SLOT in rt.progressive.streams
    released = []
    plugin.forward.around_release_kv_cache(lambda r, *a, **kw: released.append(rcv.landed), req)
    assert released == [] and DecodeTransferQueue.has_pending_deferred_releases(q)  # held: pages still landing
    q.resolve_deferred_releases()  # SGLang's every-iteration call, the hook pumping the streams
    deadline = time.monotonic() + 5
    while not released and time.monotonic() < deadline:
        q.resolve_deferred_releases()
    assert released == [len(rcv.chunks)] and rcv.cleared and not rcv.aborted  # after the last chunk landed
    assert not DecodeTransferQueue.has_pending_deferred_releases(q)
    assert rt.progressive.tracker.open_rows() == [] and rt.progressive.streams == {}
    assert int((rt.progressive.tracker.slot_of >= 0).sum()) == 0 and not rt.progressive.tracker.landed.any()
    rt.start_forward()  # the release takes effect at the next forward
    assert rt.cache.sparse.resident(0, SLOT) == set() and alloc.available_size() == 4

    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo, fail_after=6)
    while not q.pop_transferred():
        pass
    deadline = time.monotonic() + 5
    while SLOT in rt.progressive.streams and time.monotonic() < deadline:
        rt.progressive.pump(q)
    assert req.to_finish is not None and "transfer failed" in req.to_finish.message
    assert rt.progressive.tracker.open_rows() == []  # a step that would wait on it goes on (its output is dropped)
    decode(rt, pool, 1)


# -- over SGLang's real Mooncake and NIXL objects ---------------------------------------------------------------------
# Both nodes in this process, per engine: SGLang's bootstrap server (HTTP), a prefill and a decode KV manager (their ZMQ
# sockets and threads), its KV sender and receiver (and for Mooncake SGLang's MooncakeTransferEngine wrapper), with
# ESS's hooks on them. Only the native library under them is the tests' (below): it needs an RDMA NIC (Mooncake) or
# UCX and its plugins (NIXL), neither installed here.
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


def kv_args(kv: torch.Tensor, index_k: torch.Tensor, meta: MetadataBuffers, prefill: bool):
    """KVArgs as SGLang's bootstrap and prealloc queues fill them for a DSA model's paged MLA pool (no draft model)."""
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
    a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_layer_ids, a.state_conv_shard_groups = [], [], [], []
    a.is_hybrid_mla_backend, a.swa_kv_cache_layout, a.mla_compression_ratios = False, None, None
    append_state_component(a, StateType.DSA, [t.data_ptr() for t in index_k], [t.nbytes for t in index_k],
                           [IDX_K * PAGE] * L)
    return a


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
def pd(request, plugin, gloo):
    """The two nodes (see above) over one engine. ESS's process state holds both roles' parts: a prefill node's
    sender and warm-up rows, a decode node's runtime (each test's)."""
    import importlib

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs
    from sglang_ess.pd import warmup as pd_warmup

    backend = request.param
    library = engine_library(backend)
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


def meta_buffers() -> MetadataBuffers:
    return MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)


ROOMS = iter(range(7000, 8000))
PROMPT_PAGES = CTX // PAGE  # 10: pages 0, 1 go in an earlier chunk, 2 .. 9 in the last


def warmup_entries() -> torch.Tensor:
    """The warm-up state of hot_and_rest: its rows are on pages 9, 8, 7."""
    from sglang_ess.pd import warmup as pd_warmup

    positions = torch.tensor([[39, 38, 33, 30], [36, 35, 34, 32]])
    windows = torch.tensor([[31, 31, 30, 20], [31, 30, 30, 29]])
    return pd_warmup.compact((positions << pd_warmup.WINDOW_BITS) | windows, pd_warmup.entries_per_layer(K))


def send_over_engine(mc, rt, pool, gloo, hold=frozenset(), prefix=0, fail=False, kinds=("DRAM",) * L):
    """A request's prefill-to-decode transfer through SGLang's sender and receiver: its decode pages and token table
    rows, the prefill node's rows of its prompt (each row the one a full transfer's node holds), the receiver's
    metadata, then SGLang's two sends (2 pages, then the rest with index-K and the metadata), the engine holding back
    the request's pages in `hold`. The decode node's radix cache holds the first `prefix` pages already (SGLang's
    decode_prefix_len): they are not sent. NIXL: the decode node registers its KV layers as `kinds` (ESS's host
    layers are DRAM). Returns the transfer queue, the request, its receiver and sender, its decode pages and the
    metadata allocator."""
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
    q.enable_deferred_kv_release = True  # SGLang's default, as the managers': a failed room's KV waits for drain acks
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
    until(lambda: sender.poll() == KVPoll.WaitingForInput, "the prefill node never heard of the decode node's metadata",
          step=0.01)
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


def page_of(mc, dst: int, d_pages) -> int | None:
    """The request's page a decode-node KV write went to, or None (metadata, index-K)."""
    for layer in range(L):
        off = dst - mc.host[layer].data_ptr()
        if 0 <= off < mc.host[layer].nbytes:
            hit = (d_pages == off // (656 * PAGE)).nonzero()
            return int(hit[0]) if len(hit) else None
    return None


def hold_pages(mc, d_pages, pages, fail=False):
    """The engine holds every write to these request pages (any layer) until mc.engine.go is set; fail: the write
    then fails."""
    mc.engine.go.clear()
    mc.engine.hold = lambda dst: page_of(mc, dst, d_pages) in pages
    mc.engine.fail = lambda dst: fail and page_of(mc, dst, d_pages) in pages


def over_engine(plugin, monkeypatch, mc, gloo, progressive=True, **send):
    """A decode node's runtime over the module's host pool, and a request sent to it (send_over_engine)."""
    rt, pool = decode_node(progressive, host=mc.host)
    monkeypatch.setattr(plugin.state, "runtime", rt)
    return (rt, pool, *send_over_engine(mc, rt, pool, gloo, **send))


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


@pytest.mark.parametrize("prefix", [0, 1], ids=["no-prefix", "decode-radix-prefix"])
def test_pd_sends_in_the_progressive_order_and_the_request_joins_early(plugin, monkeypatch, gloo, pd,
                                                                             prefix):
    """A progressive decode node registers as such; the prefill node's worker then sends index-K and the metadata,
    the warm-up pages, then the rest, reporting each. SGLang's poll admits the request once the warm-up pages
    have landed (the rest held back by the engine), with the first token and index-K of every page sent; its decode
    steps wait for the held pages and read what a full transfer's node reads; the room then concludes and leaves the
    tracker. With a prefix in the decode node's radix cache, the pages before it count as landed."""
    mc = pd
    full, full_pool = decode_node(False)
    last = prefix + 2  # the last chunk's first page; the warm-up pages are 9, 8, 7
    rt, pool, q, req, receiver, sender, d_pages, alloc = over_engine(plugin, monkeypatch, mc, gloo,
                                                                       hold=set(range(last, 7)), prefix=prefix)
    pop_until_joined(q, req)
    landed = rt.progressive.tracker.pages_landed(SLOT)
    assert landed.all(dim=0).tolist() == [p < last or p in (7, 8, 9) for p in range(PROMPT_PAGES)]
    assert list(req.output_ids) == [FIRST_TOKEN] and alloc.available_size() == 4
    assert receiver.poll() not in (KVPoll.Success, KVPoll.Failed)  # SGLang's own state: the room has not concluded
    sent = torch.arange(prefix * PAGE, CTX)
    for layer in range(L):  # index-K of every page sent landed with phase 1
        got = mc.d_idx[layer][pool.req_to_token[SLOT, sent].long()]
        assert torch.equal(got, (sent[:, None] + layer + req.bootstrap_room).to(torch.uint8).expand_as(got))

    full_pool.req_to_token[SLOT] = pool.req_to_token[SLOT]
    land(full, full_pool.req_to_token[SLOT, :CTX])
    for node in (full, rt):  # the warm-up state the prefill node sent, loaded at the next forward
        node.admit_transferred(SLOT, warmup_entries())
        node.start_forward()
    want = decode(full, full_pool)
    threading.Timer(0.3, mc.engine.go.set).start()
    got = decode(rt, pool)
    assert rt.progressive.waits >= 1  # step 0 reads page 3, held back
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    drain(rt, q)
    assert rt.progressive.streams == {} and rt.progressive.tracker.open_rows() == []
    assert sender.poll() == KVPoll.Success
    order = [page_of(mc, d, d_pages) for d in mc.engine.log]
    order = [p for p in order if p is not None]
    phase = [0 if p < last else 1 if p in (7, 8, 9) else 2 for p in order]  # earlier chunk, phase 2, phase 3
    assert sorted(set(order)) == list(range(prefix, PROMPT_PAGES)) and phase == sorted(phase)
    assert plugin.state.pd.inbox == {}


@pytest.mark.parametrize("kinds, layer", [(("DRAM", "DRAM"), 0), (("DRAM", "VRAM"), 1)],
                         ids=["host-layers", "mixed-memory-kinds"])
def test_pd_a_waiting_step_gets_its_pages_next(plugin, monkeypatch, gloo, pd, kinds, layer):
    """A step that waits for a phase-3 page names it to the prefill node, whose worker sends that page of the waiting
    layer alone right after the part in flight (phase 3 in slices of one page here), ahead of the pages before it;
    the page's part later sends it whole. NIXL: also with the decode node's layers in two memory kinds (SGLang's
    segmented sends), the step waiting at the layer whose kind differs from the first's."""
    mc = pd
    if mc.backend == "mooncake" and layer:
        pytest.skip("memory kinds are NIXL's")
    monkeypatch.setattr(pd_sending, "SLICE_PAGES", 1)
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, hold={2},
                                                                 kinds=kinds)
    pop_until_joined(q, req)
    threading.Timer(0.3, mc.engine.go.set).start()
    rt.progressive.wait(layer, torch.tensor([SLOT]), torch.tensor([[6 * PAGE + 1, 39, -1]]))  # page 6 (9 landed)
    assert rt.progressive.waits == 1
    drain(rt, q)
    pages = [p for p in (page_of(mc, d, d_pages) for d in mc.engine.log) if p is not None]  # a write per layer
    assert list(dict.fromkeys(pages))[-5:] == [2, 6, 3, 4, 5]  # page 2 was in flight; 6 went before 3, 4, 5
    assert pages[:pages.index(3)].count(6) == 1 and pages.count(6) == 1 + L  # one layer alone, then the whole page
    first = next(d for d in mc.engine.log if page_of(mc, d, d_pages) == 6)
    assert mc.host[layer].data_ptr() <= first < mc.host[layer].data_ptr() + mc.host[layer].nbytes  # the waiting one
    assert sender.poll() == KVPoll.Success


def test_pd_a_request_finished_mid_transfer_frees_its_pages_after_the_last_write(plugin, monkeypatch, gloo, pd):
    """A request that finishes (or is aborted) while its phase 3 still lands: its KV release waits for the room to
    conclude, so no prefill write lands in a page after SGLang has freed it; the transfer ends as a success."""
    mc = pd
    monkeypatch.setattr(pd_sending, "SLICE_PAGES", 2)
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, hold={2})
    pop_until_joined(q, req)
    released = []
    plugin.forward.around_release_kv_cache(lambda r, *a, **kw: released.append(len(mc.engine.log)), req)
    assert released == [] and q.has_pending_deferred_releases()
    mc.engine.go.set()
    until(lambda: q.resolve_deferred_releases() or released, "the held release never ran")
    time.sleep(0.2)
    assert released == [len(mc.engine.log)]  # nothing was written after the release
    assert sender.poll() == KVPoll.Success and not q.has_pending_deferred_releases()
    nothing_left(plugin, mc, rt, sender)


def test_pd_a_prefill_abort_after_the_join_ends_the_request(plugin, monkeypatch, gloo, pd):
    """SGLang's prefill node aborts a room (AbortReq: CommonKVSender.abort, then its scheduler clears the sender)
    while the joined request's phase 3 is in flight: its worker skips the rest, SGLang concludes nothing, and ESS
    tells the decode node Failed, so the request is aborted there at once, not stalled until the waiting timeout."""
    mc = pd
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, hold={3})
    pop_until_joined(q, req)
    sender.abort()
    sender.clear()
    mc.engine.go.set()
    drain(rt, q)
    assert req.to_finish is not None and "transfer failed" in req.to_finish.message
    assert receiver.conclude_state == KVPoll.Failed
    nothing_left(plugin, mc, rt, sender)


def test_pd_a_stalled_transfer_aborts_its_request_and_the_step_goes_on(plugin, monkeypatch, gloo, pd):
    """A step that waits longer than PROGRESSIVE_WAIT_S for a row (here the engine holds the page's writes): the
    request is aborted and untracked, so the step goes on; its KV release is held until the transfer ends, which
    then leaves nothing behind."""
    from ess.core import settings

    mc = pd
    monkeypatch.setattr(settings, "PROGRESSIVE_WAIT_S", 0.3)
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, hold={3})
    pop_until_joined(q, req)
    t0 = time.monotonic()
    rt.progressive.wait(0, torch.tensor([SLOT]), torch.tensor([[3 * PAGE + 1, 39, -1]]))
    assert 0.3 < time.monotonic() - t0 < 5 and rt.progressive.tracker.open_rows() == []
    rt.progressive.pump(q)  # between forwards: aborted (on every rank), its transfer too
    assert "KV transfer stalled" in req.to_finish.message and SLOT in rt.progressive.streams
    released = []
    plugin.forward.around_release_kv_cache(lambda r, *a, **kw: released.append(len(mc.engine.log)), req)
    # the prefill node took the abort, its write still in flight
    until(lambda: sender.poll() == KVPoll.Failed, "the prefill node never heard of the abort")
    rt.progressive.pump(q)
    assert released == []  # the prefill node has not acked its drain
    mc.engine.go.set()
    drain(rt, q)
    assert released == [len(mc.engine.log)]  # after the last write
    nothing_left(plugin, mc, rt, sender)


def test_pd_another_ranks_failure_aborts_the_request_on_this_rank_too(plugin, monkeypatch, gloo, pd):
    """Attention-TP ranks decide together, as SGLang's queue does (all_reduce_flags over its gloo group; one rank
    here, so the other rank's flags are the test's): another rank's transfer failed while this rank's still lands,
    so this rank aborts the request and its transfer too, and frees its KV only once its prefill rank has acked the
    drain (after the write in flight)."""
    from sglang.srt.disaggregation import utils

    mc = pd
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, hold={3})
    pop_until_joined(q, req)
    real = utils.all_reduce_flags
    other = lambda flags, group, op: [1] * len(flags) if op == dist.ReduceOp.MAX else real(flags, group, op)
    with monkeypatch.context() as m:
        m.setattr(utils, "all_reduce_flags", other)  # the other rank reports its transfer failed
        rt.progressive.pump(q)
    assert "KV transfer failed" in req.to_finish.message and receiver.abort_notified
    released = []
    plugin.forward.around_release_kv_cache(lambda r, *a, **kw: released.append(len(mc.engine.log)), req)
    rt.progressive.pump(q)
    assert released == []  # the write in flight has not drained
    mc.engine.go.set()
    drain(rt, q)
    assert released == [len(mc.engine.log)]
    nothing_left(plugin, mc, rt, sender)


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


def test_pd_failure_after_the_join_aborts_the_request(plugin, monkeypatch, gloo, pd):
    """A phase-3 write that fails after the request joined: the prefill node concludes the room Failed, SGLang's
    decode thread records it, and the next pump aborts the request and frees its tracker slot; its KV is freed as
    SGLang frees a failed transfer's (deferred release: no drain ack from a poisoned room, so at the timeout)."""
    mc = pd
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, hold={3}, fail=True)
    q.deferred_kv_release_timeout = 0.5  # SGLang poisons a room whose write failed: no drain ack, its timeout decides
    pop_until_joined(q, req)
    mc.engine.go.set()
    drain(rt, q)
    assert req.to_finish is not None and "transfer failed" in req.to_finish.message
    assert sender.poll() == KVPoll.Failed
    mc.engine.fail = lambda dst: False
    nothing_left(plugin, mc, rt, sender)


def test_pd_without_progressive_decode_sends_as_sglang_does(plugin, monkeypatch, gloo, pd):
    """A decode node without --ess-progressive-pd registers as SGLang does: the prefill node sends the last chunk
    whole, reports nothing, and the request joins after its whole transfer."""
    mc = pd
    rt, pool, q, req, receiver, sender, d_pages, _ = over_engine(plugin, monkeypatch, mc, gloo, progressive=False)
    assert not mc.p_mgr.decode_kv_args_table[mc.peer].ess_progressive
    pop_until_joined(q, req)
    assert receiver.poll() == KVPoll.Success and list(req.output_ids) == [FIRST_TOKEN]
    loc = pool.req_to_token[SLOT, :CTX].long()
    assert all(torch.equal(mc.host[layer][loc], rows_of(loc, layer)) for layer in range(L))
    assert plugin.state.pd.inbox == {}


def test_parts_send_each_page_of_the_last_chunk_once_in_the_progressive_order(plugin):
    """The parts of a last chunk against brute force: phase 1 and end carry no page; phase 2 the chunk's warm-up
    pages in heat order; phase 3 the rest ascending in slices; every page once. SGLang's chunk fields follow."""
    import random

    import numpy as np
    from sglang.srt.disaggregation.common.utils import TransferKVChunk

    mp = pd_sending
    rng = random.Random(3)
    for _ in range(200):
        first, count, step = rng.randrange(0, 9), rng.randrange(1, 30), rng.randrange(1, 6)
        hot = np.array(rng.sample(range(40), rng.randrange(0, 12)))
        got = mp.parts(first, count, hot, step)
        kinds = [k for k, _ in got]
        assert kinds[0] == "phase1" and kinds[1] == "phase2" and kinds[-1] == "end" and not len(got[0][1] + got[-1][1])
        warm = [p for p in hot.tolist() if first <= p < first + count]
        warm += [first + count - 1] if first + count - 1 not in warm else []  # the prompt's last page: before decode
        rest = [p for p in range(first, first + count) if p not in warm]
        assert got[1][1].tolist() == warm
        assert [p for _, pages in got[2:-1] for p in pages.tolist()] == rest
        assert all(k == "phase3" and 0 < len(p) <= step for k, p in got[2:-1])
    kv = np.arange(100, 110, dtype=np.int32)  # the prefill pages of send indices 4 .. 13
    chunk = TransferKVChunk(room=5, prefill_kv_indices=kv, index_slice=slice(4, 14), is_last_chunk=True,
                            prefill_aux_index=2, state_indices=[[1, 2]])
    parts = mp.split(chunk, prefix_pages=1, hot=np.array([12, 9, 3]))  # the chunk is pages 5 .. 14
    slices = -(-7 // mp.SLICE_PAGES)  # phase 3: the chunk's 7 other pages
    assert [p.ess.kind for p in parts] == ["phase1", "phase2", *["phase3"] * slices, "end"]
    assert parts[1].ess.pages.tolist() == [12, 9, 14] and parts[1].prefill_kv_indices.tolist() == [107, 104, 109]
    assert parts[1].index_slice.tolist() == [11, 8, 13]
    assert [p.is_last_chunk for p in parts] == [True, *[False] * (1 + slices), True]
    assert [p.prefill_aux_index for p in parts] == [2, *[None] * (1 + slices), 2]
    assert parts[0].state_indices == [[1, 2]] and all(p.state_indices is None for p in parts[1:])


def test_malformed_progress_and_need_messages_are_dropped(plugin):
    """A bad message costs nothing but itself: the threads that read them go on, nothing is recorded."""
    mp, note, pd = pd_engines, pd_sending.note_need, plugin.state.pd
    mgr = types.SimpleNamespace(request_status={1: None}, required_prefill_response_num_table={1: 1})
    assert mp.take(pd, [mp.TAG, b"not a room", b"phase1", b"3"], mgr) is True
    assert mp.take(pd, [mp.TAG, b"1", b"phase9", b""], mgr) is True
    assert mp.take(pd, [mp.TAG, b"1"], mgr) is True and pd.inbox == {}
    assert mp.take(pd, [b"other"], mgr) is False
    mgr.required_prefill_response_num_table[1] = 2  # a room several prefill ranks serve: its reports are not read
    assert mp.take(pd, [mp.TAG, b"1", b"phase3", b""], mgr) is True and pd.inbox == {}
    sending = types.SimpleNamespace(transfer_infos={7: {}}, request_status={7: KVPoll.Transferring}, failure_records={},
                                    check_status=lambda room: KVPoll.Transferring)
    assert note(pd, [mp.NEED, b"7", b"x", b""], sending) is True and pd.take_need(7) is None
    assert note(pd, [mp.NEED, b"8", b"0", b""], sending) is True and pd.take_need(8) is None  # not sent here
    assert note(pd, [b"ROOM"], sending) is False
