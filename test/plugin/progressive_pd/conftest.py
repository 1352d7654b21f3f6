"""Shared helpers of the progressive PD tests (--ess-progressive-pd; docs/pd.md, "Progressive PD transfer"): a
decode node's runtime over SGLang's real transfer queue (`DecodeTransferQueue.pop_transferred`, its metadata gate and
commit), `DecodeRequest`, `Req`, `MetadataBuffers`, `ReqToMetadataIdxAllocator`, `ReqToTokenPool` and `KVPoll` states,
with a loopback transfer engine that lands a request's chunks in the progressive order with delays.

Tests may import no test module (test/test_repo.py), so the constants and helpers below reach them as session fixtures
of the same names (`shared`, at the end), as they reach the engines' conftest (engines/conftest.py)."""

import types

import pytest
import torch

from ess.core.landed_rows import LandingTracker
from ess.core.send_order import send_order
from sglang_ess.args import EssArgs, EssFacts
from sglang_ess.hooks.shared import state as ess_state
from sglang_ess.pd import engines as pd_engines
from sglang_ess.pd.landing import ProgressiveDecode
from sglang_ess.runtime import EssRuntime

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


# each constant and helper above, as a session fixture of its name (tests import no test module: test/test_repo.py;
# rows_of is the plugin tests' own fixture, the same rows); the default argument binds the value (pytest takes no
# fixture for an argument with a default)
for _name in ("L", "K", "CTX", "STEPS", "PAGE", "SLOT", "FIRST_TOKEN", "transfer_queue", "decode_node",
              "topk_of", "decode", "verify", "hot_and_rest", "join", "land", "full_and_joining",
              "steps_wait_and_equal_the_full_transfers"):
    globals()[f"shared_{_name}"] = pytest.fixture(name=_name, scope="session")(lambda _v=globals()[_name]: _v)
