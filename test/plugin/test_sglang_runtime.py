"""The plugin's runtime logic on the CPU against the ESS core: index translation in SGLang's coordinates (request-pool
slots, token locations from a real ReqToTokenPool), MTP verify shapes, own rows, warm-up, release, trace recording,
pool sizing."""

import ctypes
import random
import types

import numpy as np
import pytest
import torch

from ess.core import flashtrans
from ess.reference.ess_cache import EssLatentCache
from ess.core.settings import EssConfig
from ess.core.trace import load_trace
from ess.reference.lru_oracle import OracleLRU
from sglang_ess.args import EssArgs
from sglang_ess.runtime import EssRuntime, layer_modes
from sglang_ess.sizing import ess_pool_sizes
from sglang_ess.validate import EssFacts

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.utils import MetadataBuffers  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_ess import hooks  # noqa: E402
from sglang_ess.pd import warmup as pd_warmup  # noqa: E402

L, K, C, CTX, STEPS = 2, 8, 12, 40, 12
NEEDS_INTERPRETER = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8")  # fused, on a CPU
SLOTS = [3, 1]  # SGLang request-pool slots of the two requests (slot 0 is SGLang's padding row)


def rows_of(loc: torch.Tensor, layer: int) -> torch.Tensor:
    """A distinct, recognisable 656-byte row per (layer, token location)."""
    x = (loc.long().unsqueeze(-1) * 7 + layer * 131 + torch.arange(656)) % 251
    return x.to(torch.uint8)


def setup_runtime(tmp_path=None, rows=1, overlap="auto", warmup=32, pool=None, kernel="torch", residency=False,
                  fixed=False, requests=4, backend="torch"):
    """A runtime over SGLang's request-to-token table (pool: share another runtime's table; requests: its rows)."""
    if pool is None:
        pool = ReqToTokenPool(requests, CTX + STEPS * rows + 1, "cpu", False)
        locs = torch.randperm(200 * 64)[: len(SLOTS) * pool.req_to_token.shape[1]].int()  # as scattered as an allocator's
        pool.req_to_token[SLOTS] = locs.view(len(SLOTS), -1)
    facts = EssFacts("co-located", K, L, CTX + STEPS, C if rows == 1 else rows * (K + 1) + 2, rows,
                     residency=residency, fixed_step=fixed)
    ess = EssArgs(enable=True, buffer_tokens=C, record_trace=str(tmp_path) if tmp_path else None, overlap=overlap,
                  warmup_windows=warmup)
    host = torch.zeros(L, 200 * 64 + 1, 656, dtype=torch.uint8)
    rt = EssRuntime(ess, facts, pool.req_to_token, host=host, device="cpu", backend=backend, kernel=kernel)
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


def decode_and_check(rt, pool, rng):
    """STEPS decode steps of the two requests through swap_in_selected_pages (random top-k, each step's own rows
    stored as the pool stores them): every selected row is the right one."""
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
            assert torch.equal(got, rows_of(pool.req_to_token[req.unsqueeze(1), topk.long()], layer)), (t, layer)


@pytest.mark.parametrize("kernel", ["torch", pytest.param("fused", marks=NEEDS_INTERPRETER)])
def test_translation_gives_the_right_rows_and_the_core_misses(kernel):
    """swap_in_selected_pages (SGLang coordinates) = EssLatentCache (the core, its own coordinates), step by step;
    also with the fused LRU kernel (the default on a GPU; Triton's interpreter here), host rows from req_to_token."""
    rng = random.Random(0)
    rt, pool = setup_runtime(kernel=kernel)
    core = EssLatentCache(EssConfig(topk=K, buffer_tokens=C, warmup_windows=0), L, [CTX, CTX], CTX + STEPS + 1, "cpu", "torch")
    req = torch.tensor(SLOTS)
    decode_and_check(rt, pool, rng)
    # the same trace through the core gives the same misses
    rng = random.Random(0)
    rt2, _ = setup_runtime(kernel=kernel)
    for t in range(STEPS):
        topk = torch.tensor(random_topk(rng, [CTX + t] * 2), dtype=torch.int32)
        rt2.cache.next_step()  # one stamp per forward pass, as swap_in_selected_pages does at layer 0
        for layer in range(L):
            core.set_step(t)
            a = core.update(layer, topk, torch.full((2,), CTX + t))
            b = rt2.cache.update(layer, req, topk, torch.full((2,), CTX + t))
            assert torch.equal(a.n_miss, b.n_miss) and torch.equal(a.hit, b.hit)


@pytest.mark.parametrize("fixed,backend", [(False, "torch"), (True, "torch"),
                                           pytest.param(True, "interpret", marks=NEEDS_INTERPRETER),
                                           pytest.param(False, "interpret", marks=NEEDS_INTERPRETER)])
def test_residency_steps_resident_and_offloaded_requests_together(fixed, backend):
    """Residency first in SGLang's coordinates: request slot 3 fits whole (its region filled as a prefill writes its
    rows), slot 1 is offloaded; one step serves both the right rows, only slot 1 misses. fixed: the one path a CUDA
    graph replays for any batch (no host-known skips), with the same rows. interpret: the GPU's kernels (the region
    map, FlashTrans) in Triton's interpreter."""
    rng = random.Random(1)
    rt, pool = setup_runtime(residency=True, fixed=fixed, requests=8, backend=backend)
    for slot in SLOTS:
        rt.plan_positions(slot, CTX + STEPS + 1)
    rt.reset_rows(SLOTS)
    rt.apply_admissions()
    assert rt.cache.resident_requests() == [3] and rt.cache.offloaded == {1} and rt.cache.fixed_path == fixed
    req = torch.tensor(SLOTS)
    owner, pos = req.repeat_interleave(CTX), torch.arange(CTX).repeat(len(SLOTS))
    for layer in range(L):  # what the pool's prefill write does
        rt.fill_resident(layer, rows_of(pool.req_to_token[owner, pos], layer), owner, pos)
    decode_and_check(rt, pool, rng)
    # only the offloaded request missed: the resident one's LRU tables were never written
    assert rt.counts()["missed_rows"] > 0 and int((rt.cache.sparse.slot_pos[:, 3] >= 0).sum()) == 0
    assert rt.cache.all_resident() is False
    # the offloaded request leaves: the resident one's step skips the LRU policy (unless the path is fixed)
    rt.release(1)
    rt.apply_admissions()
    assert rt.cache.offloaded == set() and rt.cache.all_resident() is not fixed
    req, topk = torch.tensor([3]), torch.tensor([random_topk(rng, [CTX + STEPS - 1])[0]], dtype=torch.int32)
    for layer in range(L):  # its step alone still serves the right rows
        slots = rt.swap_in_selected_pages(req, torch.tensor([CTX + STEPS]), topk, layer)
        assert torch.equal(rt.latent_buffer(layer)[slots.long(), 0], rows_of(pool.req_to_token[3, topk.long()], layer))


def test_residency_on_a_pd_decode_node_fills_a_resident_request_once_its_kv_lands():
    """A PD decode node: both requests' KV lands in the host pool (the transfer writes it by token location); at the
    next forward the resident request's region is filled from there, the offloaded one loads its warm-up state; every
    row served is the right one, and the resident request never touches the LRU tables."""
    rng = random.Random(2)
    rt, pool = setup_runtime(residency=True, requests=8)  # its prompt rows sit in the host pool, as landed
    rt.plan_positions(3, CTX + STEPS + 1)
    rt.plan_positions(1, 1000)  # too long to fit beside it: offloaded
    rt.reset_rows(SLOTS)
    rt.apply_admissions()
    assert rt.cache.resident_requests() == [3] and rt.cache.offloaded == {1}
    entries = pd_warmup.compact(pd_warmup.encode(torch.arange(CTX - 8, CTX).expand(L, 1, 8)), 8)  # [L, 8]
    for slot in SLOTS:  # SGLang's transfer commit (sglang_ess.hooks.pd.after_commit_transfer)
        rt.kv_landed(slot, CTX)
        rt.admit_transferred(slot, entries)
    rt.apply_admissions()
    assert int((rt.cache.sparse.slot_pos[:, 1] >= 0).sum()) > 0  # the offloaded one's warm-up, loaded
    decode_and_check(rt, pool, rng)
    assert int((rt.cache.sparse.slot_pos[:, 3] >= 0).sum()) == 0


@pytest.mark.parametrize("overlap", ["none", "da"])
def test_mtp_verify_rows_translate_as_one_step(overlap):
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
    assert not rt._pending


def decode_steps(rng, pool, steps, run_layer):
    """`steps` decode steps of both requests; run_layer(layer, positions, topk, own_loc) returns the slots."""
    req = torch.tensor(SLOTS)
    for t in range(steps):
        pos = torch.full((2,), CTX + t)
        topk = torch.tensor(random_topk(rng, pos.tolist()), dtype=torch.int32)
        for layer in range(L):
            got = run_layer(layer, pos, topk, pool.req_to_token[SLOTS, CTX + t])
            yield layer, got, rows_of(pool.req_to_token[req.unsqueeze(1), topk.long()], layer)


@pytest.mark.parametrize("mode,kernel,attn1", [("da", "torch", "calls"), ("dba", "torch", "calls"),
                                               ("da", "torch", "fused"),
                                               pytest.param("da", "fused", "calls", marks=NEEDS_INTERPRETER)])
def test_overlap_layers_start_at_the_indexer_and_equal_none(mode, kernel, attn1):
    """DA/DBA layers: the LRU step and the H2D start in `begin` (the indexer hook); the KV write then hands over
    the own rows and the attention call waits. Same slots and rows as mode none, step by step (with the torch ops
    in both, or the fused kernel in the DA runtime). With --ess-da-attn1 fused the copy waits for the attention's
    fused miss kernel; a call that attends in one piece (no FlashMLA split here) copies first."""
    ref, pool = setup_runtime(overlap="none")
    rt, _ = setup_runtime(overlap=mode, pool=pool, kernel=kernel)
    rt.attn1 = attn1
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
    assert not rt._pending


def test_tbo_micro_batches_keep_the_lru_of_one_batch():
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


def prefill_rows(rng, pool, ext):
    """An extend forward of both requests by ext tokens each (ending at CTX): per query row, its top-k positions
    among [0, p] (-1 padded) and the same as token locations (SGLang's fused top-k)."""
    topk, loc = [], []
    for slot, n in zip(SLOTS, ext):
        for p in range(CTX - n, CTX):
            pos = rng.sample(range(p + 1), min(K, p + 1)) + [-1] * max(0, K - p - 1)
            topk.append(pos)
            loc.append([int(pool.req_to_token[slot, q]) if q >= 0 else -1 for q in pos])
    return torch.tensor(topk), torch.tensor(loc)


def prefill_setup(seed, W):
    """A runtime with W warm-up windows, and the prefill forward of both requests (request 0 all CTX tokens, request
    1 its last 3): (runtime, token pool, request slots, extend lengths, top-k positions, top-k locations)."""
    rt, pool = setup_runtime(warmup=W)
    ext = [CTX, 3]
    topk, topk_loc = prefill_rows(random.Random(seed), pool, ext)
    return rt, pool, torch.tensor(SLOTS), ext, topk, topk_loc


def test_prefill_top_k_warms_decode_up():
    """LRU-Warmup from the last W prefill query rows, against the oracle LRU: request 0 prefills CTX tokens, request
    1 only its last 3 (a cached prefix), fewer than W. Planning forgets earlier GPU rows. Then the same with SGLang's
    fused top-k (locations) split between two TBO micro-batches inside request 0's windows: same tables."""
    W = 4
    rt, pool, req, ext, topk, topk_loc = prefill_setup(5, W)
    rt.swap_in_selected_pages(req, torch.full((2,), CTX + 1), topk[:2], 0)  # earlier GPU rows, to be forgotten
    rt.plan_prefill(req, ext)
    for layer in range(L):
        rt.warm_from_prefill(layer, topk)
    ends = [CTX, CTX + 3]
    for i, slot in enumerate(SLOTS):
        oracle = OracleLRU(C)
        for w in range(W):
            row = ends[i] - W + w
            oracle.step(topk[row].tolist() if row >= ends[i] - ext[i] else [], -1, w - W)
        for layer in range(L):
            assert rt.cache.sparse.resident(layer, slot) == set(oracle.stamp), (slot, layer)
            pos, slots = rt.cache.sparse.resident_slots(layer, torch.tensor([slot]))
            held = pos >= 0
            want = rows_of(pool.req_to_token[slot, pos[held]], layer)
            assert torch.equal(rt.cache.gpu[layer][slots[held]], want)

    tbo, _ = setup_runtime(warmup=W, pool=pool)
    tbo.swap_in_selected_pages(req, torch.full((2,), CTX + 1), topk[:2], 0)  # the same stamp as rt
    inverse = torch.full((200 * 64,), -1, dtype=torch.int64)
    for slot in SLOTS:
        inverse[pool.req_to_token[slot, :CTX].long()] = torch.arange(CTX)
    to_positions = lambda loc: torch.where(loc >= 0, inverse[loc.clamp(min=0)], -1)  # noqa: E731
    tbo.plan_prefill(req, ext)
    split, total = CTX - 2, CTX + 3
    for layer in range(L):
        tbo.warm_from_prefill(layer, topk_loc[:split], to_positions, (0, split))
        tbo.warm_from_prefill(layer, topk_loc[split:], to_positions, (split, total))
    def state(runtime, layer, slot):  # position -> stamp, and each position's GPU row (the slot holding it may differ)
        sp = runtime.cache.sparse
        held = {int(p): (int(s), j) for j, (p, s) in enumerate(zip(sp.slot_pos[layer, slot], sp.slot_stamp[layer, slot]))
                if p >= 0 and j < sp.capacity}
        rows = {p: runtime.cache.gpu[layer][slot * sp.capacity + j] for p, (_, j) in held.items()}
        return {p: s for p, (s, _) in held.items()}, rows

    for layer in range(L):
        for slot in SLOTS:
            (a, rows_a), (b, rows_b) = state(tbo, layer, slot), state(rt, layer, slot)
            assert a == b and a and all(torch.equal(rows_a[p], rows_b[p]) for p in a), (layer, slot)
    rt.release(SLOTS[0])
    rt.start_forward()  # the release takes effect in the next forward's order
    assert rt.cache.sparse.resident(0, SLOTS[0]) == set() and rt.cache.sparse.resident(0, SLOTS[1])


class NoHostCopies:
    """Inside: a tensor's .cpu(), .numpy(), .tolist() or .item() raises (a host sync on a GPU)."""

    NAMES = ("cpu", "numpy", "tolist", "item")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(*a, **kw):
            raise AssertionError("a host copy inside the decode step")

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def test_record_trace_writes_profileable_files(tmp_path, plugin):
    rng = random.Random(2)
    rt, pool = setup_runtime(tmp_path)
    req = torch.tensor([*SLOTS, 0])  # a CUDA graph's padding row (slot 0) is not recorded
    sent = []
    runner = types.SimpleNamespace(ess_runtime=rt)  # SGLang's ModelRunner needs a GPU; the hook reads this only

    def forward(runner, batch):
        for layer in range(L):
            with NoHostCopies():  # the step appends to the device ring only
                rt.swap_in_selected_pages(req, batch, topk, layer)

    for t in range(3):
        topk = torch.tensor(random_topk(rng, [CTX + t] * 3), dtype=torch.int32)
        sent.append(topk)
        plugin.forward.around_model_forward(forward, runner, torch.tensor([CTX + t + 1] * 2 + [1]))
    path = rt.release(SLOTS[1], rid="req/1")
    tr = load_trace(path)
    assert tr.topk.shape == (1, 3, L, K) and tr.context_len.tolist() == [CTX]
    assert np.array_equal(tr.topk[0, :, 0], torch.stack([s[1] for s in sent]).numpy())
    assert tr.meta["rid"] == "req/1"
    assert rt.release(0) is None  # the padding row has no trace


def test_a_trace_folder_that_goes_away_costs_the_traces_not_the_server(tmp_path, plugin, caplog):
    """--ess-record-trace: files already in the folder are never overwritten; if the folder becomes unusable while
    serving, the release hook logs the trace it could not write and the runtime serves on."""
    import shutil

    rng = random.Random(3)
    rt, pool = setup_runtime(tmp_path)
    (tmp_path / "000000-r3.npz").write_bytes(b"an earlier run's trace")
    runner = types.SimpleNamespace(ess_runtime=rt)
    req = torch.tensor(SLOTS)

    def forward(runner, t):
        topk = torch.tensor(random_topk(rng, [CTX + t] * 2), dtype=torch.int32)
        for layer in range(L):
            rt.swap_in_selected_pages(req, torch.tensor([CTX + t + 1] * 2), topk, layer)

    for t in range(2):
        plugin.forward.around_model_forward(forward, runner, t)
    path = rt.release(SLOTS[0], rid="r3")
    assert path.endswith("000001-r3.npz") and (tmp_path / "000000-r3.npz").read_bytes() == b"an earlier run's trace"
    shutil.rmtree(tmp_path)
    tmp_path.write_text("the folder is a file now")
    with caplog.at_level("ERROR", logger="sglang_ess"):
        assert rt.release(SLOTS[1], rid="r1") is None
    assert "trace of request 'r1' not written (--ess-record-trace" in caplog.text
    plugin.forward.around_model_forward(forward, runner, 2)  # the runtime serves on
    tmp_path.unlink()
    tmp_path.mkdir()


def test_a_malformed_pd_warmup_record_ends_its_own_request_only(plugin, monkeypatch, caplog):
    """The wire is input: a decode node that receives a warm-up row it cannot load (a position past the request, a
    position twice in a layer, a stray negative entry) aborts that request with the reason (SGLang's transfer queue
    then streams the abort and releases it), loads nothing of it, and serves the others; the runtime's own entry
    refuses such entries too, before anything reads them."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    L_, K_ = L, K
    n = pd_warmup.entries_per_layer(K_)
    good = torch.full((L_, n), -1, dtype=torch.int32)
    good[:, :3] = torch.tensor([5 * 32 + 31, 3 * 32 + 30, 1 * 32 + 2], dtype=torch.int32)
    assert pd_warmup.check_entries(good, CTX) is None
    past, twice, stray = good.clone(), good.clone(), good.clone()
    past[1, 0] = (CTX + 7) * 32 + 31
    twice[0, 1] = 5 * 32 + 3
    stray[0, 5] = -9
    assert pd_warmup.check_entries(past, CTX) == f"position {CTX + 7} beyond the request's {CTX} tokens"
    assert pd_warmup.check_entries(twice, CTX) == "a position twice in one layer"
    assert pd_warmup.check_entries(stray, CTX) == "a negative entry other than -1"

    rt, _ = setup_runtime(warmup=4)
    monkeypatch.setattr(hooks.state, "runtime", rt)
    monkeypatch.setattr(hooks.state.pd, "wire", (L_, K_))
    meta = metadata_buffers(4)
    for i, entries in enumerate([past, good]):
        pd_warmup.write_row(meta.ess_warmup[i], L_, n, entries, 4, 1000 + i)
        req = sglang_req(SLOTS[i], 1000 + i, prompt=CTX)
        with caplog.at_level("WARNING", logger="sglang_ess"):
            hooks.pd.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=meta), decode_request(req, i))
        reqs = reqs + [req] if i else [req]
    rt.start_forward()
    assert "PD warm-up metadata of request 1000 is malformed (position" in caplog.text
    assert isinstance(reqs[0].finished_reason, FINISH_ABORT) and "malformed" in reqs[0].finished_reason.message
    assert reqs[1].finished_reason is None
    assert rt.cache.sparse.resident(0, SLOTS[0]) == set()  # nothing of it loaded
    assert rt.cache.sparse.resident(0, SLOTS[1]) == {5, 3, 1}  # the other request's warm-up loaded
    for bad, why in ((past, "beyond the request's"), (twice, "twice"), (stray, "negative"), (good[:1], "shape")):
        with pytest.raises(ValueError, match=why):
            rt.admit_transferred(SLOTS[0], bad, positions=CTX)


def test_pool_sizing_matches_the_memory_arithmetic():
    from ess.core.memory import cache_bytes

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


def test_top_k_past_a_request_is_masked_and_an_empty_batch_is_empty():
    """Entries at or past seq_len are -1 (no slot, no stale row, no index past the tables); B = 0 gives nothing."""
    rt, pool = setup_runtime()
    req = torch.tensor(SLOTS[:1])
    own_loc = pool.req_to_token[SLOTS[:1], 30]
    for layer in range(L):
        store(rt, layer, own_loc, rows_of(own_loc, layer), True)
        slots = rt.swap_in_selected_pages(req, torch.tensor([31]), torch.tensor([[1, 2, 3, 50, 31, 30, 10**6, -1]]), layer)
        assert slots[0, 3:5].tolist() == [-1, -1] and slots[0, 6:].tolist() == [-1, -1]  # 50, 31, 10^6: future
        assert (slots[0, :3] >= 0).all() and slots[0, 5] >= 0  # 1, 2, 3 and the own position 30
        assert torch.equal(rt.latent_buffer(layer)[slots[0, :3].long(), 0], rows_of(pool.req_to_token[SLOTS[0], 1:4], layer))
    empty = rt.swap_in_selected_pages(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                      torch.zeros(0, K, dtype=torch.int32), 0)
    assert empty.shape == (0, K) and empty.dtype == torch.int32


def test_release_through_the_scheduler_hook_reads_sglangs_req(plugin, monkeypatch):
    """SGLang 0.5.23 keeps a request's table row in req.kv: the release hook frees that row's GPU state."""
    rt, pool = setup_runtime()
    monkeypatch.setattr(plugin.state, "runtime", rt)
    for layer in range(L):
        own_loc = pool.req_to_token[SLOTS, CTX]
        store(rt, layer, own_loc, rows_of(own_loc, layer), True)
        rt.swap_in_selected_pages(torch.tensor(SLOTS), torch.full((2,), CTX + 1), torch.arange(K).repeat(2, 1).int(), layer)
    assert rt.cache.sparse.resident(0, SLOTS[0])
    released = []
    plugin.forward.around_release_kv_cache(lambda req, *a, **kw: released.append(req), sglang_req(SLOTS[0]))
    rt.start_forward()
    assert not rt.cache.sparse.resident(0, SLOTS[0]) and rt.cache.sparse.resident(0, SLOTS[1])
    plugin.forward.around_release_kv_cache(lambda req, *a, **kw: released.append(req), sglang_req(None))  # never held a row
    assert len(released) == 2  # SGLang's own release follows


def test_a_row_handed_to_a_new_request_starts_empty(plugin):
    """SGLang frees request rows outside release_kv_cache too; admission (its on-alloc-rows callback) resets them."""
    rt, pool = setup_runtime()
    for layer in range(L):
        own_loc = pool.req_to_token[SLOTS, CTX]
        store(rt, layer, own_loc, rows_of(own_loc, layer), True)
        rt.swap_in_selected_pages(torch.tensor(SLOTS), torch.full((2,), CTX + 1), torch.arange(K).repeat(2, 1).int(), layer)
    seen = []
    pool.register_on_alloc_rows(seen.append)  # a callback SGLang registered first keeps running, ahead of ESS's
    plugin.startup.reset_on_admit(pool, rt)
    assert pool.alloc([sglang_req(None)]) == [4]  # SGLang hands out its free rows from the tail: 4, then 3
    assert pool.alloc([sglang_req(None)]) == [SLOTS[0]]
    assert seen == [[4], [SLOTS[0]]]
    # a forward still in flight under the overlap scheduler may hold the row's previous request: its step writes the
    # row after the scheduler handed the row out, so the reset waits for the next forward, in the stream's order
    assert rt.cache.sparse.resident(0, SLOTS[0])
    plugin.forward.around_model_forward(lambda runner: None, types.SimpleNamespace(ess_runtime=rt))  # SGLang's next forward
    assert all(not rt.cache.sparse.resident(layer, SLOTS[0]) for layer in range(L))
    assert rt.cache.sparse.resident(0, SLOTS[1])  # the other request keeps its rows


def test_cuda_graph_padding_rows_take_no_step_and_stale_overlap_steps_are_dropped(caplog, plugin):
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
    assert not rt._pending and "never consumed" in caplog.text
    rt.attn1 = "fused"  # a dropped step whose misses the fused miss kernel was to copy: they land all the same
    step = 5
    topk = torch.tensor([list(range(step, step + K))] * 3, dtype=torch.int32)
    assert rt.begin(0, req, pos, topk) and rt._pending[next(iter(rt._pending))][1] is None
    plugin.forward.around_model_forward(lambda runner: None, types.SimpleNamespace(ess_runtime=rt))
    held = rt.cache.sparse.pos_slot[0, SLOTS[0], step : step + K].long()
    assert bool((held >= 0).all())
    slots = held + SLOTS[0] * rt.cache.capacity
    assert torch.equal(rt.latent_buffer(0)[slots, 0], rows_of(pool.req_to_token[SLOTS[0], step : step + K], 0))


def test_pd_transfer_engines_see_the_host_pool_as_host_memory(plugin, monkeypatch):
    """NIXL: the decode node's latent layers (ESS's pinned host pool) are registered as DRAM, index-K stays VRAM
    (SGLang's KVArgs, as its decode queue fills them). Mooncake: a failed registration stops the node."""
    from sglang.srt.disaggregation.base import KVArgs

    rt, _ = setup_runtime()
    monkeypatch.setattr(plugin.state, "runtime", rt)
    index_k = torch.zeros(4, 132, dtype=torch.uint8)  # stands for a device buffer
    args = KVArgs()
    args.kv_data_ptrs = [rt.cache.host[0].data_ptr(), rt.cache.host[1].data_ptr(), index_k.data_ptr()]
    args.kv_data_mem_kinds = ["VRAM"] * 3  # what SGLang 0.5.23 states without HiSparse
    plugin.pd.before_nixl_manager(None, args)
    assert args.kv_data_mem_kinds == ["DRAM", "DRAM", "VRAM"]
    assert plugin.pd.after_mooncake_register(0, None, [1], [1]) is None
    with pytest.raises(RuntimeError, match="Mooncake could not register"):
        plugin.pd.after_mooncake_register(-1, None, [1], [1])
    monkeypatch.setattr(plugin.state, "runtime", None)  # a node without ESS: SGLang's own behaviour
    assert plugin.pd.after_mooncake_register(-1, None, [1], [1]) is None


# -- LRU-Warmup across PD disaggregation, through SGLang's metadata buffers -----------------------------------------
def sglang_req(slot: int | None, room: int = 0, metadata_index: int = -1, prompt: int = 3):
    """A real SGLang Req holding request-table row `slot` (0.5.23 keeps it in req.kv), as the scheduler leaves it,
    with a prompt of `prompt` tokens."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"r{slot}-{room}", "", [1] * prompt, SamplingParams(max_new_tokens=4), bootstrap_room=room)
    req.kv.req_pool_idx = slot
    req.metadata_buffer_index = metadata_index
    return req


def decode_request(req, metadata_index: int):
    """SGLang's DecodeRequest of a PD decode node for `req` (no receiver: the transfer is over when the hook runs)."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    return DecodeRequest(req=req, kv_receiver=None, metadata_buffer_index=metadata_index)


def metadata_buffers(size):
    return MetadataBuffers(size, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)


def send_aux(src: MetadataBuffers, src_index: int, dst: MetadataBuffers, dst_index: int) -> None:
    """What Mooncake's send_aux does: buffer i's item src_index to the peer's buffer i, item dst_index, for the buffers
    both nodes registered."""
    sp, _, lens = src.get_buf_infos()
    dp, _, _ = dst.get_buf_infos()
    for i in range(min(len(sp), len(dp))):
        ctypes.memmove(dp[i] + lens[i] * dst_index, sp[i] + lens[i] * src_index, lens[i])


def test_warmup_state_travels_in_the_metadata_buffers(plugin, monkeypatch):
    """Prefill node: the hooks plan and record through a prefill forward split into two TBO micro-batches, from
    SGLang's fused top-k (token locations), and write the request's metadata row. The row travels as Mooncake sends
    it. Decode node: the commit hook loads it, and the GPU slots hold what a co-located warm-up from the same top-k
    holds (the same rows and stamps, byte-identical row contents). A stale row (another request's, or a prefill
    node without ESS) is ignored."""
    W = 4
    colocated, pool, req, ext, topk, topk_loc = prefill_setup(6, W)
    colocated.plan_prefill(req, ext)
    for layer in range(L):
        colocated.warm_from_prefill(layer, topk)

    # the prefill node (its pool: a stand-in object; its req_to_token: the same table)
    target_pool = object()
    sender = pd_warmup.WarmupSender(L, K, W, pool.req_to_token, 200 * 64 + 1)
    monkeypatch.setattr(hooks.state.pd, "sender", sender)
    monkeypatch.setattr(hooks.state.pd, "sender_pool", target_pool)
    monkeypatch.setattr(hooks.state.pd, "wire", (L, K))
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    backend = types.SimpleNamespace(token_to_kv_pool=target_pool, req_to_token=pool.req_to_token, use_fused_topk=True,
                                    get_topk_transform_method=lambda mode: TopkTransformMethod.PAGED)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=req,
                                  seq_lens_cpu=torch.tensor([CTX, CTX]), extend_prefix_lens_cpu=[0, CTX - 3])
    hooks.forward.after_init_forward_metadata(None, backend, batch)
    split, total = CTX - 1, CTX + 3  # the second micro-batch holds request 0's newest window only
    for layer in range(L):
        for rows, rng_ in [(slice(0, split), (0, split)), (slice(split, total), (split, total))]:
            child = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, tbo_parent_token_range=rng_)
            hooks.forward.around_forward_extend(lambda *a, **kw: None, backend, None, None, None,
                                        types.SimpleNamespace(layer_id=layer), child, topk_indices=topk_loc[rows])
    prefill_meta = metadata_buffers(4)  # SGLang's class, through the plugin's hook on its constructor
    reqs = [sglang_req(s, 2**63 + 1000 if i else 1000, metadata_index=i + 1)  # bootstrap rooms: unsigned 64-bit ids
            for i, s in enumerate(SLOTS)]
    for r in reqs:
        hooks.pd.after_set_buf(None, prefill_meta, r)

    # the decode node: the same slots, an empty cache; the KV already in its host pool
    decode_rt, _ = setup_runtime(warmup=W, pool=pool)
    monkeypatch.setattr(hooks.state, "runtime", decode_rt)
    decode_meta = metadata_buffers(8)
    assert decode_meta.get_buf_infos()[0][-1] == decode_meta.ess_warmup.data_ptr()  # appended by the plugin's hook
    for i, r in enumerate(reqs):
        decode_rt.reset_rows([r.kv.req_pool_idx])  # SGLang's prealloc handed the row out (its on-alloc-rows callback)
        send_aux(prefill_meta, r.metadata_buffer_index, decode_meta, 5 + i)
        decode_req = decode_request(sglang_req(r.kv.req_pool_idx, r.bootstrap_room, prompt=CTX), 5 + i)
        hooks.pd.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=decode_meta), decode_req)
    decode_rt.start_forward()  # the reset, then the load, in the next forward's order

    for slot in SLOTS:
        for layer in range(L):
            def state(rt):
                sp = rt.cache.sparse
                return {int(p): int(s) for p, s in zip(sp.slot_pos[layer, slot], sp.slot_stamp[layer, slot]) if p >= 0}
            assert state(decode_rt) and state(decode_rt) == state(colocated), (slot, layer)
            pos, slots = decode_rt.cache.sparse.resident_slots(layer, torch.tensor([slot]))
            held = pos >= 0
            assert torch.equal(decode_rt.cache.gpu[layer][slots[held]], rows_of(pool.req_to_token[slot, pos[held]], layer))

    stale, _ = setup_runtime(warmup=W, pool=pool)
    monkeypatch.setattr(hooks.state, "runtime", stale)
    other = decode_request(sglang_req(SLOTS[0], 77), 5)  # row 5 holds room 1000's state
    hooks.pd.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=decode_meta), other)
    stale.start_forward()
    monkeypatch.setattr(hooks.state.pd, "wire", None)
    plain = metadata_buffers(4)  # a prefill node without ESS: one buffer fewer, so row 5 is not written
    assert not hasattr(plain, "ess_warmup")
    send_aux(plain, 1, decode_meta, 5)
    assert pd_warmup.read_row(decode_meta.ess_warmup[5], 1000, L, K) is not None
    assert stale.cache.sparse.resident(0, SLOTS[0]) == set()
