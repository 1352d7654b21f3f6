"""The plugin's runtime logic on the CPU against the ESS core: index translation in SGLang's coordinates (request-pool
slots, token locations from a real ReqToTokenPool), MTP verify shapes, own rows, warm-up, release, trace recording,
pool sizing."""

import random

import numpy as np
import pytest
import torch

from ess.cache import EssLatentCache
from ess.config import EssConfig
from ess.trace import load_trace
from sglang_ess.args import EssArgs
from sglang_ess.runtime import EssRuntime, layer_modes
from sglang_ess.sizing import ess_pool_sizes

sglang = pytest.importorskip("sglang")
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402

L, K, C, CTX, STEPS = 2, 8, 12, 40, 12
SLOTS = [3, 1]  # SGLang request-pool slots of the two requests (slot 0 is SGLang's padding row)


def rows_of(loc: torch.Tensor, layer: int) -> torch.Tensor:
    """A distinct, recognisable 656-byte row per (layer, token location)."""
    x = (loc.long().unsqueeze(-1) * 7 + layer * 131 + torch.arange(656)) % 251
    return x.to(torch.uint8)


def setup_runtime(tmp_path=None, rows=1):
    pool = ReqToTokenPool(4, CTX + STEPS * rows + 1, "cpu", False)
    locs = torch.randperm(200 * 64)[: len(SLOTS) * pool.req_to_token.shape[1]].int()  # as scattered as an allocator's
    pool.req_to_token[SLOTS] = locs.view(len(SLOTS), -1)
    facts = {"topk": K, "layers": L, "buffer": C if rows == 1 else rows * (K + 1) + 2, "query_rows": rows, "plan": None}
    ess = EssArgs(enable=True, buffer_tokens=C, record_trace=str(tmp_path) if tmp_path else None)
    host = torch.zeros(L, 200 * 64 + 1, 656, dtype=torch.uint8)
    rt = EssRuntime(ess, facts, pool.req_to_token, host=host, device="cpu", backend="torch")
    for layer in range(L):  # prefill: every prompt token's row lands in the host pool
        loc = pool.req_to_token[SLOTS, :CTX].flatten()
        store(rt, layer, loc, rows_of(loc, layer), decode=False)
    return rt, pool


def store(rt, layer, loc, rows, decode):
    """What the ESS KV pool does with a forward's new rows (test_sglang_pool checks the pool itself)."""
    rt.cache.host[layer][loc.long()] = rows
    if decode:
        rt.keep_own_rows(layer, rows)


def random_topk(rng, pos):
    return [rng.sample(range(p + 1), K) for p in pos]


def test_translation_gives_the_right_rows_and_the_core_misses():
    """swap_in_selected_pages (SGLang coordinates) = EssLatentCache (the core, its own coordinates), step by step."""
    rng = random.Random(0)
    rt, pool = setup_runtime()
    core = EssLatentCache(EssConfig(topk=K, buffer_tokens=C, warmup_windows=0), L, [CTX, CTX], CTX + STEPS + 1, "cpu", "torch")
    req = torch.tensor(SLOTS)
    for t in range(STEPS):
        seq_lens = torch.full((2,), CTX + t + 1)
        topk = torch.tensor(random_topk(rng, [CTX + t] * 2), dtype=torch.int32)
        for layer in range(L):
            own_loc = pool.req_to_token[SLOTS, CTX + t]
            store(rt, layer, own_loc, rows_of(own_loc, layer), True)
            slots = rt.swap_in_selected_pages(req, seq_lens, topk, layer)
            assert slots.dtype == torch.int32 and slots.shape == (2, K)
            got = rt.latent_buffer(layer)[slots.long(), 0]
            want = rows_of(pool.req_to_token[req.unsqueeze(1), topk.long()], layer)
            assert torch.equal(got, want), (t, layer)
    # the same trace through the core gives the same misses
    rng = random.Random(0)
    rt2, _ = setup_runtime()
    for t in range(STEPS):
        topk = torch.tensor(random_topk(rng, [CTX + t] * 2), dtype=torch.int32)
        rt2.cache.next_step()  # one stamp per forward pass, as swap_in_selected_pages does at layer 0
        for layer in range(L):
            core.set_step(t)
            a = core.update(layer, topk, torch.full((2,), CTX + t))
            b = rt2.cache.update(layer, req, topk, torch.full((2,), CTX + t))
            assert torch.equal(a.n_miss, b.n_miss) and torch.equal(a.hit, b.hit)


def test_mtp_verify_rows_translate_as_one_step():
    rng = random.Random(1)
    S = 3
    rt, pool = setup_runtime(rows=S)
    req = torch.tensor(SLOTS)
    for t in range(4):
        first = CTX + S * t
        seq_lens = torch.tensor([[first + j + 1 for j in range(S)]] * 2).flatten()  # expanded per verify row
        topk = torch.tensor([random_topk(rng, [first + j for j in range(S)]) for _ in SLOTS], dtype=torch.int32)
        for layer in range(L):
            own_loc = pool.req_to_token[req.unsqueeze(1), torch.arange(first, first + S)].flatten()
            store(rt, layer, own_loc, rows_of(own_loc, layer), True)
            slots = rt.swap_in_selected_pages(req, seq_lens, topk, layer)
            assert slots.shape == (2, S, K)
            want = rows_of(pool.req_to_token[req.view(2, 1, 1), topk.long()], layer)
            assert torch.equal(rt.latent_buffer(layer)[slots.long(), 0], want)


def test_release_forgets_the_request_and_warmup_prefetches():
    rt, pool = setup_runtime()
    req = torch.tensor(SLOTS)
    warm = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7]] * 4] * L, dtype=torch.int32)  # [layers, W, K]
    rt.start_request(SLOTS[0], CTX, warm)
    assert rt.cache.sparse.resident(0, SLOTS[0]) == set(range(8))
    topk = torch.tensor([list(range(8))] * 2, dtype=torch.int32)
    r = rt.cache.update(0, req, topk, torch.full((2,), CTX))
    assert r.n_miss.tolist() == [0, 8]  # the warmed request hits; the other does not
    rt.release(SLOTS[0])
    assert rt.cache.sparse.resident(0, SLOTS[0]) == set()
    r = rt.cache.update(0, req, topk, torch.full((2,), CTX + 1))
    assert r.n_miss.tolist() == [8, 0]


def test_record_trace_writes_profileable_files(tmp_path):
    rng = random.Random(2)
    rt, _ = setup_runtime(tmp_path)
    req = torch.tensor(SLOTS)  # no start_request: the first decode step starts each request's trace
    sent = []
    for t in range(3):
        topk = torch.tensor(random_topk(rng, [CTX + t] * 2), dtype=torch.int32)
        sent.append(topk)
        for layer in range(L):
            rt.swap_in_selected_pages(req, torch.full((2,), CTX + t + 1), topk, layer)
    path = rt.release(SLOTS[1], rid="req/1")
    tr = load_trace(path)
    assert tr.topk.shape == (1, 3, L, K) and tr.context_len.tolist() == [CTX]
    assert np.array_equal(tr.topk[0, :, 0], torch.stack([s[1] for s in sent]).numpy())
    assert tr.meta["rid"] == "req/1"


def test_pool_sizing_matches_the_memory_arithmetic():
    from ess.memory import cache_bytes

    budget = 90 << 30
    s = ess_pool_sizes(61, budget, None, max_requests=160, context_len=32768, capacity=6554)
    assert s.tokens == 160 * 32768 and s.limited_by == "requests"  # every request's context fits the device
    assert s.device_bytes == 160 * cache_bytes(61, 32768, 656, 132, 6554) <= budget
    assert s.host_bytes == 160 * 32768 * 61 * 656
    s = ess_pool_sizes(61, 60 << 30, None, max_requests=160, context_len=32768, capacity=6554)
    assert s.limited_by == "device" and s.device_bytes <= 60 << 30 < s.device_bytes + 61 * 132
    s = ess_pool_sizes(61, budget, 100, max_requests=160, context_len=32768, capacity=6554)
    assert s.tokens == int(100 * (1 << 30)) // (61 * 656) and s.limited_by == "host"
    with pytest.raises(ValueError, match="--ess-host-pool-gib"):
        ess_pool_sizes(61, budget, 0.5, max_requests=160, context_len=32768, capacity=6554)
    with pytest.raises(ValueError, match="do not fit"):
        ess_pool_sizes(61, 1 << 30, None, max_requests=160, context_len=32768, capacity=6554)


def test_layer_modes_come_from_the_plan_or_the_flag():
    assert layer_modes(EssArgs(enable=True), 3, None) == ["da"] * 3
    assert layer_modes(EssArgs(enable=True, overlap="none"), 3, None) == ["none"] * 3
    assert layer_modes(EssArgs(enable=True), 3, ["none", "da", "dba", "da"]) == ["none", "da", "dba"]  # MTP entry dropped
