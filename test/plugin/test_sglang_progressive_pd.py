"""Progressive PD transfer on a decode node (--ess-progressive-pd; docs/plugin.md, "Progressive PD transfer"), through
SGLang's real transfer queue (`DecodeTransferQueue.pop_transferred`, its metadata gate and commit), `DecodeRequest`,
`Req`, `MetadataBuffers`, `ReqToMetadataIdxAllocator`, `ReqToTokenPool` and `KVPoll` states, with a loopback transfer
engine that lands a request's chunks in the progressive order with delays."""

import time
import types

import pytest
import torch

from ess.core.landing import LandingTracker
from ess.core.send_order import send_order
from sglang_ess.args import EssArgs
from sglang_ess.progressive import ProgressiveDecode
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
    what landed through `ess_progress`, the protocol sglang_ess.progressive reads."""

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
    q._skipped_checksum_signatures = set()
    q.spec_algorithm = SpeculativeAlgorithm.NONE
    q.scheduler = types.SimpleNamespace(
        enable_decode_hicache=False, kv_checksum_computer=None, enable_hisparse=False,
        batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, tok: None),
        output_streamer=types.SimpleNamespace(stream_output=lambda reqs, logprob: None),
        metrics_reporter=types.SimpleNamespace(enable_metrics=False), disagg_decode_prealloc_queue=None)
    return q


def decode_node(progressive: bool):
    pool = ReqToTokenPool(5, CTX + STEPS + 1, "cpu", False)
    pool.req_to_token[SLOT] = torch.randperm(64 * 8)[: CTX + STEPS + 1].int()  # scattered, as an allocator's
    facts = EssFacts("pd-decode", K, L, CTX + STEPS, C)
    ess = EssArgs(enable=True, buffer_tokens=C, warmup_windows=0, progressive_pd=progressive)
    host = torch.zeros(L, 64 * 8 + 1, 656, dtype=torch.uint8)  # nothing landed yet
    rt = EssRuntime(ess, facts, pool.req_to_token, host=host, device="cpu", backend="torch", kernel="torch")
    if progressive:
        rt.progressive = ProgressiveDecode(LandingTracker(L, CTX + STEPS, 2, 5, "cpu", page=PAGE))
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


def hot_and_rest():
    """The prefill node's order for a warm-up state naming the newest rows (pages 9, 8 hottest)."""
    positions = torch.tensor([[39, 38, 33, 30], [36, 35, 34, 32]])
    windows = torch.tensor([[31, 31, 30, 20], [31, 30, 30, 29]])
    return send_order(positions, windows, CTX, PAGE)


def join(plugin, monkeypatch, gloo, delay=2, fail_after=None):
    rt, pool = decode_node(True)
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


def test_a_request_joins_after_the_hot_pages_and_decodes_the_full_transfers_rows(plugin, monkeypatch, gloo):
    """SGLang's poll admits the request once phase 1 and the warm-up pages landed (before the rest), its commit
    takes the first token from the metadata row; every decode step then reads the rows a full transfer's would,
    waiting where its top-k needs a page still in flight."""
    full, full_pool = decode_node(False)
    hot, rest = hot_and_rest()
    assert hot.tolist() == [9, 8, 7] and rest.tolist() == list(range(7))  # 39, 38 newest; 33, 34, 35, 36 page 8
    loc = full_pool.req_to_token[SLOT, :CTX].long()
    for layer in range(L):
        full.cache.host[layer][loc] = rows_of(loc, layer)
    want = decode(full, full_pool)

    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo)
    pool.req_to_token[SLOT] = full_pool.req_to_token[SLOT]  # the same locations as the full transfer's node
    rcv.locs = pool.req_to_token[SLOT, :CTX]
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
        rt.progressive.pump()
    assert rcv.poll() == KVPoll.Success and rcv.cleared  # the whole transfer landed: the request is no longer tracked
    assert rt.progressive.tracker.open_rows() == [] and rt.progressive.streams == {}
    order = [int(e[1]) for e in rcv.log if e[0] == "pages"]
    assert order == [9, 8, 7, 0, 1, 2, 3, 4, 5, 6]  # the priority order, as the engine landed it


def test_an_untracked_request_never_waits(plugin, monkeypatch, gloo):
    rt, pool = decode_node(True)
    loc = pool.req_to_token[SLOT, :CTX].long()
    for layer in range(L):
        rt.cache.host[layer][loc] = rows_of(loc, layer)
    decode(rt, pool, 2)
    assert rt.progressive.waits == 0


def test_abort_mid_transfer_frees_everything(plugin, monkeypatch, gloo):
    """A request aborted after joining (SGLang's release_kv_cache, through the plugin's hook on it): its transfer
    stops, its tracker slot and GPU rows are let go. A transfer that fails after joining aborts its request."""
    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo)
    while not q.pop_transferred():
        pass
    assert rt.progressive.tracker.open_rows() == [SLOT] and SLOT in rt.progressive.streams
    plugin.before_release_kv_cache(req)
    assert rcv.aborted and rcv.cleared
    assert rt.progressive.tracker.open_rows() == [] and rt.progressive.streams == {}
    assert int((rt.progressive.tracker.slot_of >= 0).sum()) == 0 and not rt.progressive.tracker.landed.any()
    rt.start_forward()  # the release takes effect at the next forward
    assert rt.cache.sparse.resident(0, SLOT) == set() and alloc.available_size() == 4

    rt, pool, q, req, rcv, alloc, _, _ = join(plugin, monkeypatch, gloo, fail_after=6)
    while not q.pop_transferred():
        pass
    deadline = time.monotonic() + 5
    while SLOT in rt.progressive.streams and time.monotonic() < deadline:
        rt.progressive.pump()
    assert req.to_finish is not None and "transfer failed" in req.to_finish.message
    assert rt.progressive.tracker.open_rows() == []  # a step that would wait on it goes on (its output is dropped)
    decode(rt, pool, 1)
