"""Progressive PD over SGLang's real Mooncake and NIXL objects (each test once per engine; the two nodes and the
loopback native libraries are the folder's conftest's): a transfer that ends early, late or badly after its request
joined decode. A request finished mid-transfer frees its pages only after the last write; a prefill abort, a stalled
transfer, another attention-TP rank's failure and a failed write abort the request and leave no state of the room on
either node."""

import time

import pytest
import torch

from sglang_ess.pd import sending as pd_sending

sglang = pytest.importorskip("sglang")
import torch.distributed as dist  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402


def test_pd_a_request_finished_mid_transfer_frees_its_pages_after_the_last_write(plugin, monkeypatch, gloo, pd,
                                                                                 over_engine, pop_until_joined,
                                                                                 until, nothing_left):
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


def test_pd_a_prefill_abort_after_the_join_ends_the_request(plugin, monkeypatch, gloo, pd, over_engine,
                                                            pop_until_joined, drain, nothing_left):
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


def test_pd_a_stalled_transfer_aborts_its_request_and_the_step_goes_on(plugin, monkeypatch, gloo, pd, over_engine,
                                                                       pop_until_joined, until, drain, nothing_left,
                                                                       PAGE, SLOT):
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


def test_pd_another_ranks_failure_aborts_the_request_on_this_rank_too(plugin, monkeypatch, gloo, pd, over_engine,
                                                                      pop_until_joined, drain, nothing_left):
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


def test_pd_failure_after_the_join_aborts_the_request(plugin, monkeypatch, gloo, pd, over_engine, pop_until_joined,
                                                      drain, nothing_left):
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
