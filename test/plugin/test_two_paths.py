"""Two paths per forward (docs/plugin.md, "Two paths"), on the runtime over SGLang's real request table and Reqs: a
forward with no offloaded request live takes the resident path (stock's step over the regions, the new rows written
into them, nothing backed up), any other the general path; a resident request's rows reach the host pool once, when
they must (a demotion, a release SGLang keeps, a PD backup). The real CPU server's tokens: test_server.py."""

import random
import types

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang_ess.hooks import graphs  # noqa: E402
from sglang_ess.hooks.shared import state  # noqa: E402

L, K, C, CTX, STEPS = 2, 8, 12, 40, 12  # the runtime kit's shape (conftest.py)
SLOTS = [3, 1]  # SGLang request-pool slots of the two requests (slot 0 is SGLang's padding row)
REQUESTS = 9  # SGLang request-table rows (+ its padding row): 10 x C device rows hold the two requests' regions (60 rows each) and no more


def _never(name):
    def fail(*a, **kw):
        raise AssertionError(f"{name} ran")
    return fail


def _admit(rt, sglang_req, slots, allocated=CTX):
    """The scheduler gives rows to real Reqs (their reach hook), the next forward admits them."""
    reqs = {}
    for slot in slots:
        reqs[slot] = sglang_req(slot, prompt=CTX)
        reqs[slot].kv.kv_allocated_len = allocated
        rt.plan_positions(slot, CTX + STEPS + 1, reqs[slot])
    rt.reset_rows(slots)
    return reqs


def _prefill(rt, pool, rows_of, slots):
    """What the pool's prefill write does for resident requests (their prompts' host rows are the kit's)."""
    req = torch.tensor(slots)
    owner, pos = req.repeat_interleave(CTX), torch.arange(CTX).repeat(len(slots))
    for layer in range(L):
        rt.fill_resident(layer, rows_of(pool.req_to_token[owner, pos], layer), owner, pos)


def _step(rt, pool, rows_of, store, rng, random_topk, slots, t):
    """Decode step t of `slots` as SGLang's DSA backend drives it: the pool writes each layer's new rows (the resident
    path: into their regions; else to the host pool and the step's own rows), then the backend translates the top-k;
    every selected row is the right one."""
    req = torch.tensor(slots)
    pos = torch.full((len(slots),), CTX + t)
    rt.set_batch(req, pos)
    topk = torch.tensor(random_topk(rng, [CTX + t] * len(slots)), dtype=torch.int32)
    own_loc = pool.req_to_token[req, CTX + t]
    for layer in range(L):
        if rt.resident_forward:  # what EssDSATokenToKVPool.set_mla_kv_buffer does on the resident path
            rt.latent_buffer(layer)[rt.own_region_rows(layer, len(slots)), 0] = rows_of(own_loc, layer)
        else:
            store(rt, layer, own_loc, rows_of(own_loc, layer), True)
        got = rt.swap_in_selected_pages(req, pos + 1, topk, layer)
        want = rows_of(pool.req_to_token[req.unsqueeze(1), topk.long()], layer)
        assert torch.equal(rt.latent_buffer(layer)[got.long(), 0], want), (t, layer)
    rt.end_forward()


def _host_holds(rt, pool, rows_of, slot, lo, hi) -> bool:
    loc = pool.req_to_token[slot, lo:hi].long()
    return all(torch.equal(rt.cache.host[layer][loc], rows_of(loc, layer)) for layer in range(L))


def test_a_resident_batch_takes_the_resident_path_and_a_demotion_flushes_its_rows_first(
        setup_runtime, sglang_req, rows_of, store, random_topk, monkeypatch):
    """Both requests resident: every forward takes the resident path (the LRU step never runs; the host pool gets no
    decode row). A third request needs room: the next forward demotes one, whose decode rows go to the host pool first,
    and takes the general path (the resident step never runs); every row served stays the right one."""
    rng = random.Random(0)
    rt, pool = setup_runtime(residency=True, requests=REQUESTS)
    reqs = _admit(rt, sglang_req, SLOTS)
    rt.start_forward(decode=False)  # the prefill forward
    _prefill(rt, pool, rows_of, SLOTS)
    assert rt.cache.resident_requests() == sorted(SLOTS)
    with monkeypatch.context() as m:
        m.setattr(rt.cache, "update", _never("the LRU step"))
        m.setattr(rt.cache, "fetch", _never("the fetch"))
        for t in range(STEPS // 2):
            rt.start_forward()
            assert rt.resident_forward
            _step(rt, pool, rows_of, store, rng, random_topk, SLOTS, t)
            for r in reqs.values():
                r.kv.kv_allocated_len = CTX + t + 1
    assert rt.paths == {"resident": STEPS // 2, "general": 0}
    assert rt.counts()["layer_steps"] == 0  # no counters on the resident path
    assert not any(_host_holds(rt, pool, rows_of, s, CTX, CTX + STEPS // 2) for s in SLOTS)  # no D2H backup
    _admit(rt, sglang_req, [2])  # a third request: no free C rows, so a resident one is demoted
    rt.start_forward()
    [victim] = rt.cache.offloaded - {2}
    assert not rt.resident_forward and rt.residency.demoted == 1
    assert _host_holds(rt, pool, rows_of, victim, CTX, CTX + STEPS // 2)  # flushed before the demotion
    with monkeypatch.context() as m:
        m.setattr(rt, "_resident_step", _never("the resident step"))
        for t in range(STEPS // 2, STEPS):
            if t > STEPS // 2:
                rt.start_forward()
            _step(rt, pool, rows_of, store, rng, random_topk, SLOTS, t)
    assert rt.paths == {"resident": STEPS // 2, "general": STEPS - STEPS // 2}
    assert rt.counts()["missed_rows"] > 0  # the demoted request fetched rows from the host pool


def test_a_release_flushes_only_what_sglang_keeps(setup_runtime, sglang_req, rows_of, store, random_topk):
    """A finished resident request whose KV SGLang keeps (its radix cache: keep_upto) has its decode rows in the host
    pool before its row is freed; one SGLang keeps nothing of costs no copy."""
    rng = random.Random(1)
    rt, pool = setup_runtime(residency=True, requests=REQUESTS)
    _admit(rt, sglang_req, SLOTS)
    rt.start_forward(decode=False)
    _prefill(rt, pool, rows_of, SLOTS)
    for t in range(4):
        rt.start_forward()
        _step(rt, pool, rows_of, store, rng, random_topk, SLOTS, t)
    kept, dropped = SLOTS
    rt.release(kept, keep_upto=CTX + 4)
    rt.release(dropped)
    assert _host_holds(rt, pool, rows_of, kept, CTX, CTX + 4)
    assert not _host_holds(rt, pool, rows_of, dropped, CTX, CTX + 1)


def test_a_row_without_a_known_request_keeps_the_general_path(setup_runtime, sglang_req):
    """A resident row given by SGLang's alloc_rows alone (no Req seen): the host cannot bound its flush, so its
    forwards back every row up (the general path)."""
    rt, _ = setup_runtime(residency=True, requests=REQUESTS)
    rt.plan_positions(SLOTS[0], CTX + STEPS + 1)  # no Req
    rt.reset_rows(SLOTS[:1])
    rt.start_forward()
    assert rt.cache.resident_requests() == [SLOTS[0]] and not rt.resident_forward


def test_each_decode_graph_captures_the_path_its_label_names(setup_runtime, sglang_req, monkeypatch):
    """The decode graph runner's hooks (sglang_ess.hooks.graphs) on a stand-in runner: SGLang's DecodeCudaGraphRunner
    captures CUDA graphs, which a CPU cannot, so its two calls ESS wraps are driven here with the runner's attributes
    those hooks read. Both labels are captured, each with its path, and a replay selects the forward's path."""
    rt, _ = setup_runtime(residency=True, requests=REQUESTS)
    monkeypatch.setattr(state, "runtime", rt)
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(ess_runtime=rt), attention_graph_variants=None,
                                   capture_bs=[1, 2])
    graphs.before_capture(runner)
    variants = runner.attention_graph_variants
    assert variants.capture_labels == (graphs.GENERAL, graphs.RESIDENT)
    seen = []
    for bs in runner.capture_bs:
        for label in variants.capture_labels:
            graphs.around_capture_one_shape(lambda *a: seen.append((a[1], a[5], rt.resident_forward)), runner, bs,
                                            None, None, None, label)
    assert seen == [(1, graphs.GENERAL, False), (1, graphs.RESIDENT, True), (2, graphs.GENERAL, False),
                    (2, graphs.RESIDENT, True)]
    assert rt.graphs_captured == {graphs.GENERAL: 2, graphs.RESIDENT: 2} and not rt.resident_forward
    rt.resident_forward = True
    assert variants.select(None) == graphs.RESIDENT
    rt.resident_forward = False
    assert variants.select(None) == graphs.GENERAL
    # the MTP draft model's runner (no runtime) and a runtime without regions capture as SGLang does
    other = types.SimpleNamespace(model_runner=types.SimpleNamespace(), attention_graph_variants=None)
    graphs.before_capture(other)
    assert other.attention_graph_variants is None
