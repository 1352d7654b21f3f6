"""The runtime's DA / DBA overlap on the CPU (sglang_ess.overlap_steps): steps started at the indexer give mode
none's slots and rows, in decode and MTP verify; TBO's micro-batches keep one batch's LRU; CUDA-graph padding rows
take no step and steps never taken are dropped. The runtime kit (setup_runtime, rows_of, ...) is conftest.py's."""

import random
import types

import pytest
import torch

from ess.core.kernels import flashtrans

pytest.importorskip("sglang")

L, K, C, CTX, STEPS = 2, 8, 12, 40, 12  # the runtime kit's shape (conftest.py)
SLOTS = [3, 1]  # SGLang request-pool slots of the two requests (slot 0 is SGLang's padding row)
NEEDS_INTERPRETER = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8")  # fused, on a CPU


@pytest.mark.parametrize("overlap", ["none", "da"])
def test_mtp_verify_rows_translate_as_one_step(overlap, setup_runtime, store, rows_of, random_topk):
    """Verify: S query rows per request; with DA the step starts at the indexer's [B*S, K] output."""
    rng = random.Random(1)
    S = 3
    rt, pool = setup_runtime(rows=S, overlap=overlap)
    req = torch.tensor(SLOTS)
    for t in range(4):
        first = CTX + S * t
        positions = torch.tensor([first + j for j in range(S)] * 2)  # the indexer's query rows, request-major
        topk = torch.tensor([random_topk(rng, [first + j for j in range(S)]) for _ in SLOTS], dtype=torch.int32)
        for layer in range(L):
            assert rt.begin(layer, req, positions, topk.view(2 * S, K)) == (overlap == "da")
            own_loc = pool.req_to_token[req.unsqueeze(1), torch.arange(first, first + S)].flatten()
            store(rt, layer, own_loc, rows_of(own_loc, layer), True)
            slots = rt.swap_in_selected_pages(req, positions + 1, topk, layer)  # seq_lens expanded per verify row
            assert slots.shape == (2, S, K)
            want = rows_of(pool.req_to_token[req.view(2, 1, 1), topk.long()], layer)
            assert torch.equal(rt.latent_buffer(layer)[slots.long(), 0], want)
    assert not rt.overlap.pending


@pytest.fixture
def decode_steps(random_topk, rows_of):
    def steps(rng, pool, steps, run_layer):
        """`steps` decode steps of both requests; run_layer(layer, positions, topk, own_loc) returns the slots."""
        req = torch.tensor(SLOTS)
        for t in range(steps):
            pos = torch.full((2,), CTX + t)
            topk = torch.tensor(random_topk(rng, pos.tolist()), dtype=torch.int32)
            for layer in range(L):
                got = run_layer(layer, pos, topk, pool.req_to_token[SLOTS, CTX + t])
                yield layer, got, rows_of(pool.req_to_token[req.unsqueeze(1), topk.long()], layer)

    return steps


@pytest.mark.parametrize("mode,kernel,attn1", [("da", "torch", "calls"), ("dba", "torch", "calls"),
                                               ("da", "torch", "fused"),
                                               pytest.param("da", "fused", "calls", marks=NEEDS_INTERPRETER)])
def test_overlap_layers_start_at_the_indexer_and_equal_none(mode, kernel, attn1, setup_runtime, store, rows_of,
                                                            decode_steps):
    """DA/DBA layers: the LRU step and the H2D start in `begin` (the indexer hook); the KV write then hands over
    the own rows and the attention call waits. Same slots and rows as mode none, step by step (with the torch ops
    in both, or the fused kernel in the DA runtime). With --ess-da-attn1 fused the copy waits for the attention's
    fused miss kernel; a call that attends in one piece (no FlashMLA split here) copies first."""
    ref, pool = setup_runtime(overlap="none")
    rt, _ = setup_runtime(overlap=mode, pool=pool, kernel=kernel)
    rt.overlap.attn1 = attn1
    req = torch.tensor(SLOTS)

    def both(layer, pos, topk, own_loc):
        assert rt.begin(layer, req, pos, topk) and not ref.begin(layer, req, pos, topk)
        for r in (ref, rt):
            store(r, layer, own_loc, rows_of(own_loc, layer), True)
        want = ref.swap_in_selected_pages(req, pos + 1, topk, layer)
        got = rt.swap_in_selected_pages(req, pos + 1, topk, layer)
        assert torch.equal(got, want)
        return rt.latent_buffer(layer)[got.long(), 0]

    for layer, got, want in decode_steps(random.Random(3), pool, STEPS, both):
        assert torch.equal(got, want)
    assert not rt.overlap.pending


def test_tbo_micro_batches_keep_the_lru_of_one_batch(setup_runtime, store, rows_of, decode_steps):
    """Two-Batch Overlap: A's and B's indexers (begin) both run before either attention call, per layer. Each
    micro-batch's call must take its own step, and the LRU state must end as one batch's would."""
    ref, pool = setup_runtime(overlap="none")
    rt, _ = setup_runtime(overlap="da", pool=pool)
    parent = torch.tensor(SLOTS)
    halves = [slice(0, 1), slice(1, 2)]

    def tbo(layer, pos, topk, own_loc):
        store(ref, layer, own_loc, rows_of(own_loc, layer), True)
        ref.swap_in_selected_pages(parent, pos + 1, topk, layer)
        for h in halves:  # op_prepare of A, then of B
            assert rt.begin(layer, parent[h], pos[h], topk[h])
        rows = []
        for h in halves:  # op_core of A, then of B
            store(rt, layer, own_loc[h], rows_of(own_loc[h], layer), True)
            slots = rt.swap_in_selected_pages(parent[h], pos[h] + 1, topk[h], layer)
            rows.append(rt.latent_buffer(layer)[slots.long(), 0])
        return torch.cat(rows)

    for layer, got, want in decode_steps(random.Random(4), pool, STEPS, tbo):
        assert torch.equal(got, want)
    for layer in range(L):
        for slot in SLOTS:
            assert rt.cache.sparse.resident(layer, slot) == ref.cache.sparse.resident(layer, slot)


def test_cuda_graph_padding_rows_take_no_step_and_stale_overlap_steps_are_dropped(caplog, plugin, setup_runtime, store,
                                                                                  rows_of):
    rt, pool = setup_runtime(overlap="da")
    req = torch.tensor([SLOTS[0], 0, 0])  # a graph's batch of 3 holding one request: rows 2 and 3 are padding (slot 0)
    pos = torch.tensor([CTX, 1, 1])
    topk = torch.tensor([list(range(K))] * 3, dtype=torch.int32)
    for layer in range(L):
        own_loc = pool.req_to_token[req, pos]
        store(rt, layer, own_loc, rows_of(own_loc, layer), True)
        slots = rt.swap_in_selected_pages(req, pos + 1, topk, layer)
        assert (slots[1:] == -1).all() and (slots[0] >= 0).all()
        assert torch.equal(rt.latent_buffer(layer)[slots[0].long(), 0], rows_of(pool.req_to_token[SLOTS[0], :K], layer))
        assert not rt.cache.sparse.resident(layer, 0)  # SGLang's padding row holds nothing
    assert rt.begin(0, req, pos, topk)  # an indexer whose attention call never comes (an aborted forward)
    with caplog.at_level("WARNING", logger="sglang_ess"):  # the next forward (SGLang's ModelRunner.forward)
        plugin.forward.around_model_forward(lambda runner: None, types.SimpleNamespace(ess_runtime=rt))
    assert not rt.overlap.pending and "never consumed" in caplog.text
    rt.overlap.attn1 = "fused"  # a dropped step whose misses the fused miss kernel was to copy: they land all the same
    step = 5
    topk = torch.tensor([list(range(step, step + K))] * 3, dtype=torch.int32)
    assert rt.begin(0, req, pos, topk) and rt.overlap.pending[next(iter(rt.overlap.pending))][1] is None
    plugin.forward.around_model_forward(lambda runner: None, types.SimpleNamespace(ess_runtime=rt))
    held = rt.cache.sparse.pos_slot[0, SLOTS[0], step : step + K].long()
    assert bool((held >= 0).all())
    slots = held + SLOTS[0] * rt.cache.capacity
    assert torch.equal(rt.latent_buffer(0)[slots, 0], rows_of(pool.req_to_token[SLOTS[0], step : step + K], 0))
