"""Progressive PD transfer on a decode node (--ess-progressive-pd; docs/pd.md, "Progressive PD transfer"): its
landing tracker and step waits. Through SGLang's real transfer queue, a request joins decode once phase 1 and its
warm-up pages landed; decode, MTP verify and Two-Batch Overlap steps then wait for the pages their top-k reads and read
what a full transfer's node reads; decode graphs wait out a request still landing; a release mid-transfer is held until
the transfer ends. The loopback transfer engine and the decode node are the folder's conftest's."""

import time

import pytest
import torch

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402


def test_a_request_joins_after_the_hot_pages_and_decodes_the_full_transfers_rows(plugin, monkeypatch, gloo,
                                                                                 hot_and_rest, full_and_joining, decode,
                                                                                 FIRST_TOKEN):
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


def test_mtp_verify_steps_wait_and_read_the_full_transfers_rows(plugin, monkeypatch, gloo, full_and_joining, verify,
                                                                steps_wait_and_equal_the_full_transfers):
    """MTP target-verify under progressive PD: the union of a step's S top-k sets waits for its unlanded page as a
    decode step does, and every step reads the rows a full transfer's node reads."""
    full, full_pool, rt, pool, q, _, _, _ = full_and_joining(plugin, monkeypatch, gloo, query_rows=2)
    steps_wait_and_equal_the_full_transfers(verify, full, full_pool, rt, pool, q)


def test_tbo_micro_batches_wait_and_read_the_full_transfers_rows(plugin, monkeypatch, gloo, full_and_joining, land,
                                                                 steps_wait_and_equal_the_full_transfers, topk_of,
                                                                 rows_of, L, CTX, STEPS, SLOT):
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


def test_decode_graphs_wait_out_a_request_still_landing(plugin, monkeypatch, gloo, join):
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


def test_an_untracked_request_never_waits(plugin, monkeypatch, gloo, decode_node, land, decode, CTX, SLOT):
    rt, pool = decode_node(True)
    land(rt, pool.req_to_token[SLOT, :CTX])
    decode(rt, pool, 2)
    assert rt.progressive.waits == 0


def test_a_request_released_mid_transfer_keeps_its_kv_until_the_transfer_ends(plugin, monkeypatch, gloo, join, decode,
                                                                               SLOT):
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
