"""Progressive PD over SGLang's real Mooncake and NIXL objects (each test once per engine; the two nodes and the
loopback native libraries are the folder's conftest's): the prefill node's ordered sends. A progressive decode node
registers as such; the prefill node sends index-K and the metadata, the warm-up pages, then the rest; the request joins
decode early and decodes the rows a full transfer's node would; a step waiting for a page gets it next; a decode node
without --ess-progressive-pd gets SGLang's own transfer."""

import threading

import pytest
import torch

from sglang_ess.pd import sending as pd_sending

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402


@pytest.mark.parametrize("prefix", [0, 1], ids=["no-prefix", "decode-radix-prefix"])
def test_pd_sends_in_the_progressive_order_and_the_request_joins_early(plugin, monkeypatch, gloo, pd, prefix,
                                                                       decode_node, over_engine, pop_until_joined,
                                                                       land, decode, drain, page_of, warmup_entries,
                                                                       L, CTX, PAGE, SLOT, FIRST_TOKEN,
                                                                       PROMPT_PAGES):
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
def test_pd_a_waiting_step_gets_its_pages_next(plugin, monkeypatch, gloo, pd, kinds, layer, over_engine,
                                               pop_until_joined, drain, page_of, L, PAGE, SLOT):
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


def test_pd_without_progressive_decode_sends_as_sglang_does(plugin, monkeypatch, gloo, pd, over_engine,
                                                            pop_until_joined, rows_of, L, CTX, SLOT,
                                                            FIRST_TOKEN):
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
