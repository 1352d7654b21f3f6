"""The plugin's runtime logic on the CPU against the ESS core: index translation in SGLang's coordinates (request-pool
slots, token locations from a real ReqToTokenPool), residency, masks, release and row resets, trace recording, pool
sizing. DA / DBA and MTP verify: test_sglang_runtime_overlap.py; LRU-Warmup and PD: test_sglang_runtime_warmup.py.
The runtime kit (setup_runtime, rows_of, ...) is conftest.py's."""

import random
import types

import numpy as np
import pytest
import torch

from ess.core.kernels import flashtrans
from ess.core.settings import EssConfig
from ess.core.trace import load_trace
from ess.reference.ess_cache import EssLatentCache
from sglang_ess.args import EssArgs
from sglang_ess.runtime import layer_modes
from sglang_ess.sizing import ess_pool_sizes

sglang = pytest.importorskip("sglang")
from sglang_ess.pd import warmup as pd_warmup  # noqa: E402

L, K, C, CTX, STEPS = 2, 8, 12, 40, 12  # the runtime kit's shape (conftest.py)
SLOTS = [3, 1]  # SGLang request-pool slots of the two requests (slot 0 is SGLang's padding row)
NEEDS_INTERPRETER = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8")  # fused, on a CPU


@pytest.mark.parametrize("kernel", ["torch", pytest.param("fused", marks=NEEDS_INTERPRETER)])
def test_translation_gives_the_right_rows_and_the_core_misses(kernel, setup_runtime, random_topk, decode_and_check):
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
def test_residency_steps_resident_and_offloaded_requests_together(fixed, backend, setup_runtime, rows_of, random_topk,
                                                                  decode_and_check):
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
    rt.end_forward()  # the counters hold the forwards that ended (SGLang's forward hook ends each)
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


def test_residency_on_a_pd_decode_node_fills_a_resident_request_once_its_kv_lands(setup_runtime, decode_and_check):
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


def test_top_k_past_a_request_is_masked_and_an_empty_batch_is_empty(setup_runtime, store, rows_of):
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


def test_release_through_the_scheduler_hook_reads_sglangs_req(plugin, monkeypatch, setup_runtime, store, rows_of,
                                                              sglang_req):
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


def test_a_row_handed_to_a_new_request_starts_empty(plugin, setup_runtime, store, rows_of, sglang_req):
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


def test_record_trace_writes_profileable_files(tmp_path, plugin, setup_runtime, random_topk):
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


def test_a_trace_folder_that_goes_away_costs_the_traces_not_the_server(tmp_path, plugin, caplog, setup_runtime,
                                                                       random_topk):
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


def test_pd_transfer_engines_see_the_host_pool_as_host_memory(plugin, monkeypatch, setup_runtime):
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
