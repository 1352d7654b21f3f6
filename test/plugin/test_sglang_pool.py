"""ESS's DSA KV pool against SGLang's stock DSATokenToKVPool (CPU): the same writes go to both; every read the DSA
backend makes (prefill page table through the sparse-offload translation, decode through the ESS runtime) must give
exactly the bytes the stock pool gives at those token locations. Both pools write through SGLang's own row writer
(`_write_mla_kv_buffer`: the FP8 quantiser, on a CPU the plugin's CPU path, then SGLang's scatter, which never writes
destination row 0)."""

import os
import random

import numpy as np
import pytest
import torch

sglang = pytest.importorskip("sglang")
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from sglang_ess.args import EssArgs, EssFacts  # noqa: E402
from sglang_ess.pool import DECODE, EXTEND, pool_class  # noqa: E402
from sglang_ess.runtime import EssRuntime  # noqa: E402

L, K, C, SIZE, MAX_LEN = 2, 8, 12, 40 * 64, 200
REQ = [3, 1]  # request-pool slots (0 is SGLang's padding row)


# SGLang's DSA pool constructor arguments for both pools (DeepSeek-V3.2's MLA dims, L layers, SIZE locations)
POOL_KW = dict(size=SIZE, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=L,
               device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656, start_layer=0, end_layer=L)


@pytest.fixture
def pools(plugin):
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):  # one GPU, no decode context parallelism
        stock = DSATokenToKVPool(**POOL_KW)
        ess = pool_class(scratch_rows=8, stage_rows=16, backend="torch")(**POOL_KW)
        tokens = ReqToTokenPool(4, MAX_LEN, "cpu", False)
        locs = torch.randperm(SIZE - 1, generator=torch.Generator().manual_seed(0))  # scattered, the same every run
        tokens.req_to_token[REQ] = (locs[: len(REQ) * MAX_LEN] + 1).int().view(len(REQ), -1)
        yield stock, ess, tokens


def charged(layers, tokens, rows, cap, ctx):
    """What ESS allocates for these sizes (sglang_ess.sizing.ess_device_bytes), the scratch as sizing charges it
    (the most requests SGLang allows) and the table width SGLang gives (context + 4)."""
    from sglang_ess import sizing

    return sizing.ess_device_bytes(layers, tokens + 64, rows, cap, ctx + 4, sizing.MAX_REQUESTS, ctx).total


class Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


def kv_for(loc, layer, salt=0):
    """A token's latent values (k_nope [N, 1, 512], k_rope [N, 1, 64], BF16), a function of its location."""
    x = torch.sin(loc.double().unsqueeze(-1) * 0.731 + layer * 1.31 + salt * 0.17 + torch.arange(576) * 0.05)
    x = (x * 3).to(torch.bfloat16).unsqueeze(1)
    return x[..., :512], x[..., 512:]


def write(stock, ess, layer, loc, salt=0):
    for pool in (stock, ess):
        pool.set_mla_kv_buffer(Layer(layer), loc, *kv_for(loc, layer, salt))


def prefill(stock, ess, tokens, req, starts, ends, rng):
    """One extend forward: requests req extend from starts to ends (starts > 0: a cached prefix); then the backend's
    read of every query token's top-k through the translated page table is compared with the stock read."""
    ess.stage_extend(tokens.req_to_token, torch.tensor(req), ends, starts)
    ess.ess_phase = EXTEND
    for layer in range(L):
        loc = torch.cat([tokens.req_to_token[r, s:e] for r, s, e in zip(req, starts, ends)])
        write(stock, ess, layer, loc)
        for r, s, e in zip(req, starts, ends):
            for p in range(s, e):  # each query token's top-k among positions [0, p], -1 padded
                pos = rng.sample(range(p + 1), min(K, p + 1)) + [-1] * max(0, K - p - 1)
                pos = torch.tensor(pos)
                locs = torch.where(pos >= 0, tokens.req_to_token[r, pos.clamp(min=0)].long(), -1)
                rows = ess.translate_loc_to_hisparse_device(locs)
                assert torch.equal(rows < 0, locs < 0)
                got = ess.get_key_buffer(layer)[rows[rows >= 0]]
                want = stock.get_key_buffer(layer)[locs[locs >= 0]]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, r, p)


def test_prefill_reads_through_staging_equal_the_stock_pool(pools):
    stock, ess, tokens = pools
    rng = random.Random(0)
    prefill(stock, ess, tokens, REQ, [0, 0], [30, 20], rng)  # no prefix: staging holds the new rows only
    prefill(stock, ess, tokens, [REQ[0]], [30], [45], rng)  # chunk 2: the prefix comes back from the host pool
    assert ess.ess_stage.shape[0] == 64  # whole FlashMLA pages
    prefill(stock, ess, tokens, REQ, [45, 20], [50, 26], rng)  # both with prefixes: 76 rows, the stage grows
    assert ess.ess_stage.shape[0] == 128
    # every row written is in the host pool, at its location (SGLang's PD transfer reads these buffers)
    for layer in range(L):
        assert torch.equal(ess.ess_host[layer, : SIZE + 64], stock.kv_buffer[layer][:, 0])
    ptrs, lens, items = ess.get_contiguous_buf_infos()
    assert ptrs == [ess.ess_host[i].data_ptr() for i in range(L)] and items == [656 * 64] * L


def decode_batch(req, pos, mode=None):
    """SGLang's own ForwardBatch of a decode step (the fields the indexer hook reads are real)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(forward_mode=mode or ForwardMode.DECODE, batch_size=len(req), input_ids=torch.zeros_like(req),
                        req_pool_indices=req, seq_lens=pos + 1, out_cache_loc=torch.zeros_like(req),
                        seq_lens_sum=int((pos + 1).sum()))


def in_forward(pool):
    """SGLang's forward context around a forward whose attention backend serves `pool`. The backend is a stand-in
    with the one attribute the plugin reads (token_to_kv_pool), so that these tests need no server arguments;
    test_sglang_backend.py drives the real DeepseekSparseAttnBackend."""
    import types

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    return forward_context(ForwardContext(attn_backend=types.SimpleNamespace(token_to_kv_pool=pool)))


def make_runtime(ess, tokens, **flags):
    facts = EssFacts("co-located", K, L, tokens.req_to_token.shape[1], C)
    rt = EssRuntime(EssArgs(enable=True, buffer_tokens=C, **flags), facts, tokens.req_to_token, host=ess.ess_host,
                    device="cpu", backend="torch", tier=ess.ess_tier)
    ess.ess_runtime = rt
    return rt


@pytest.mark.parametrize("overlap", ["none", "da"])
def test_decode_reads_through_the_runtime_equal_the_stock_pool(pools, monkeypatch, overlap):
    """Decode through the pool and the runtime; with DA the step starts in the plugin's indexer hook."""
    from sglang_ess.hooks import registry as hooks

    stock, ess, tokens = pools
    rng = random.Random(1)
    prefill(stock, ess, tokens, REQ, [0, 0], [40, 33], rng)
    rt = make_runtime(ess, tokens, overlap=overlap)
    monkeypatch.setattr(hooks.state, "runtime", rt)
    req, pos = torch.tensor(REQ), torch.tensor([40, 33])
    batch = decode_batch(req, pos)
    for step in range(15):  # C = 12 slots against top-8 sets over 40+ positions: misses and evictions every step
        ess.ess_phase = DECODE
        seq_lens = pos + 1
        topk = torch.tensor([rng.sample(range(p + 1), K) for p in pos.tolist()], dtype=torch.int32)
        for layer in range(L):
            with in_forward(ess):
                hooks.forward.after_indexer(topk, None, None, None, positions=pos, forward_batch=batch, layer_id=layer)
            assert len(rt.overlap.pending) == (overlap == "da")
            write(stock, ess, layer, tokens.req_to_token[req, pos], salt=step)
            slots = rt.swap_in_selected_pages(req, seq_lens, topk, layer)
            got = ess.get_key_buffer(layer)[slots.long()]
            want = stock.get_key_buffer(layer)[tokens.req_to_token[req.unsqueeze(1), topk.long()].long()]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (step, layer)
        pos = pos + 1
    assert not rt.overlap.pending
    # the new decode rows reached the host pool too
    for layer in range(L):
        assert torch.equal(ess.ess_host[layer, : SIZE + 64], stock.kv_buffer[layer][:, 0])


def prefilled(stock, ess, tokens):
    """The first request's first 10 tokens written through both pools as a prefill writes them: their locations."""
    loc = tokens.req_to_token[REQ[0], :10]
    ess.ess_phase = EXTEND
    ess.stage_extend(tokens.req_to_token, torch.tensor([REQ[0]]), [10], [0])
    write(stock, ess, 0, loc)
    return loc


def test_move_and_cpu_copy_keep_the_host_rows(pools, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # SGLang's index-K copy syncs the GPU
    stock, ess, tokens = pools
    loc = prefilled(stock, ess, tokens)
    free = torch.arange(SIZE - 10, SIZE)
    rows = stock.kv_buffer[0][loc.long(), 0].view(torch.uint8)  # the rows SGLang's writer made
    ess.move_kv_cache(free, loc)
    assert torch.equal(ess.ess_host[0, free], rows)
    copy = ess.get_cpu_copy(free)
    ess.ess_host[:, free] = 0
    ess.load_cpu_copy(copy, free)
    assert torch.equal(ess.ess_host[0, free], rows)


def test_a_retraction_restore_lands_the_request_s_rows_in_its_region(pools, monkeypatch):
    """SGLang's PD decode retraction (cpu_tensor) restores a request's backup through its allocator's load_cpu_copy with
    the request's new row: with residency, that row's region then holds the restored rows (EssRuntime.kv_landed)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # SGLang's index-K copy syncs the GPU
    stock, ess, tokens = pools
    loc = prefilled(stock, ess, tokens)
    copy = ess.get_cpu_copy(loc)  # the retraction's backup
    ess.ess_host.zero_()
    facts = EssFacts("pd-decode", K, L, tokens.req_to_token.shape[1], C, residency=True)
    rt = EssRuntime(EssArgs(enable=True, buffer_tokens=C), facts, tokens.req_to_token, host=ess.ess_host,
                    device="cpu", backend="torch")
    ess.ess_runtime = rt
    rt.plan_positions(REQ[0], 20)
    rt.reset_rows([REQ[0]])  # its new row
    allocator = PagedTokenToKVPoolAllocator(SIZE, 64, torch.float8_e4m3fn, "cpu", ess, need_sort=False)
    allocator.load_cpu_copy(copy, loc, req_pool_index=REQ[0])
    rt.start_forward()
    start = rt.cache.region[REQ[0]][0]
    assert rt.cache.resident_requests() == [REQ[0]]
    assert torch.equal(rt.cache.gpu[0, start:start + 10], stock.kv_buffer[0][loc.long(), 0].view(torch.uint8))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_move_reads_every_source_before_writing_any_target(pools, monkeypatch, backend):
    """Overlapping moves (SGLang's own reads before it writes): the host rows go through device memory, every layer
    in one gather and one scatter (the FlashTrans kernel through Triton's interpreter here, on the GPU's stream there)."""
    from ess.core.kernels import flashtrans

    if backend == "interpret" and not flashtrans.INTERPRETER_OK:
        pytest.skip("Triton < 3.8 cannot interpret the FlashTrans kernel")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # SGLang's index-K copy syncs the GPU
    _, ess, _ = pools
    monkeypatch.setattr(ess, "backend", backend)
    ess.ess_host.copy_(torch.randint(0, 256, ess.ess_host.shape, dtype=torch.uint8))
    before = ess.ess_host.clone()
    tgt, src = torch.tensor([5, 6, 7, 40]), torch.tensor([6, 7, 8, 5])  # 5, 6 and 7 are both read and written
    ess.move_kv_cache(tgt, src)
    assert torch.equal(ess.ess_host[:, tgt], before[:, src])
    rest = torch.ones(ess.ess_host.shape[1], dtype=torch.bool)
    rest[tgt] = False
    assert torch.equal(ess.ess_host[:, rest], before[:, rest])


def configurator(monkeypatch, layers, avail):
    """SGLang's real KVCacheConfigurator (a slots dataclass: no attribute beyond its fields can be set on it) and its
    real DefaultPoolConfigurator (DSA FP8 cell, no draft), with the schedule and PD settings sizing reads, for a node
    of 8 ranks with `avail` bytes of device budget each. Built without its constructor, which profiles a loaded
    model's memory: the fields sizing reads are set, and the two profiling methods answer `avail` and pass tokens."""
    import types

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor import pool_configurator as pc

    stock = pc.DefaultPoolConfigurator.__new__(pc.DefaultPoolConfigurator)
    stock._cell_size, stock._fixed_overhead_bytes = layers * (656 + 132), 0  # SGLang's DSA FP8 cell, no draft
    monkeypatch.setattr(pc, "create_memory_pool_configurator", lambda kvc: stock)
    schedule = types.SimpleNamespace(max_running_requests=None, page_size=64, mem_fraction_static=0.9)
    monkeypatch.setattr("sglang.srt.runtime_context.get_schedule", lambda: schedule)
    disagg = types.SimpleNamespace(disaggregation_mode="null", enable_pd_role_switch=False,
                                   disaggregation_decode_extra_slots=None)
    monkeypatch.setattr("sglang.srt.runtime_context.get_disagg", lambda: disagg)
    monkeypatch.setattr(KVCacheConfigurator, "_profile_available_bytes", lambda self, pre: avail)
    monkeypatch.setattr(KVCacheConfigurator, "_apply_token_constraints", lambda self, tokens: tokens)
    # the request table's extra positions (no speculative decoding): SGLang's rule reads its published settings
    monkeypatch.setattr("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len", lambda: 4)
    # and the batch padding (no two-batch overlap, no DP attention: none), which reads them too
    from sglang_ess import sizing

    monkeypatch.setattr(sizing, "scratch_requests", lambda rows: rows)
    kvc = object.__new__(KVCacheConfigurator)
    kvc.layer_info = types.SimpleNamespace(num_effective_layers=layers)
    kvc.attn_dp_size = 1
    kvc.server_args = types.SimpleNamespace(tp_size=8, pp_size=1, nnodes=1)
    return kvc, stock, schedule, disagg


def resolve(kvc, ess, facts):
    """The plugin's sizing of this launch: SGLang's MemoryPoolConfig (the disk tier's spec goes to the pool)."""
    from sglang_ess import sizing

    return sizing.resolve_memory_pool_config(kvc, 0, ess, facts)[0]


def test_memory_pool_config_charges_the_latent_cache_to_the_host(monkeypatch):
    """SGLang's configurator hands ESS its profiled budget and per-token cell (latent + index-K); ESS sizes tokens and
    requests so that index-K of every token, C slots per request slot, staging and scratch fit the budget."""
    from sglang_ess import sizing

    layers, ctx, cap, avail = 61, 32768, 6554, 70 << 30
    kvc, stock, schedule, disagg = configurator(monkeypatch, layers, avail)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (2 << 40) * 8 // 10 // ranks)  # a 2 TiB node
    facts = EssFacts("co-located", 2048, 61, ctx, cap)
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    R, T = config.max_running_requests, config.max_total_num_tokens
    used = charged(layers, T, R + 1, cap, ctx)
    assert used <= avail and T >= R * ctx - 64  # every request can reach full context
    baseline_requests = avail // (stock._cell_size * ctx)
    # past the memory wall: 139 request slots of 0.25 GiB sparse pool + 0.25 GiB index-K each, against 47 full caches
    assert (baseline_requests, R) == (47, 138)
    schedule.max_running_requests = 40  # a requested count is kept, and tokens fill the rest of the device
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    assert config.max_running_requests == 40 and config.max_total_num_tokens > 40 * ctx
    # a PD decode node: SGLang's table has size + extra slots + 1 rows (DecodeReqToTokenPool), each with C slots
    disagg.disaggregation_mode, disagg.disaggregation_decode_extra_slots = "decode", 80
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    R, T = config.max_running_requests, config.max_total_num_tokens
    used = charged(layers, T, R + 80 + 1, cap, ctx)
    assert R == 40 and used <= avail
    schedule.max_running_requests = None  # sized to fit: the in-transfer rows are charged before the requests
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    assert config.max_running_requests == 138 - 80
    disagg.disaggregation_mode = "null"
    with pytest.raises(ValueError, match="--ess-host-pool-gib 1"):
        resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=1), facts)
    # the host wall: a rank's share of the node's pinnable memory (2 TiB x 0.8 / 8 = 204.8 GiB) is found at start-up
    with pytest.raises(ValueError, match="--ess-host-pool-gib 300: more than this rank may pin, 204.8 GiB"):
        resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=300), facts)
    # on a 1 TiB node (102.4 GiB per rank) the host pool, not the device, caps the rows: 83 of 32K tokens, one of
    # them SGLang's padding row
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (1 << 40) * 8 // 10 // ranks)
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    assert config.max_total_num_tokens * layers * 656 <= 102.4 * (1 << 30) and config.max_running_requests == 82


def test_a_disk_tier_moves_the_host_wall_to_the_disk(monkeypatch, tmp_path):
    """With --ess-disk-dir the tokens are capped by the page file's budget and the host holds --ess-host-pool-gib of
    frames, which must hold one layer's worst-case step; on a 1 TiB node (102.4 GiB per rank) the host pool alone
    capped ESS at 82 requests of 32K, the tier lets the device decide."""
    from ess.core.disk_tier import PAGE_BYTES
    from ess.core.settings import DISK_PAGE_BYTES
    from sglang_ess import sizing

    layers, ctx, cap, avail = 61, 32768, 6554, 70 << 30
    kvc, _, schedule, _ = configurator(monkeypatch, layers, avail)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (1 << 40) * 8 // 10 // ranks)
    facts = EssFacts("co-located", 2048, 61, ctx, cap)
    tiered = dict(enable=True, buffer_tokens=cap, disk_dir=str(tmp_path), disk_gib=1000)
    config, spec = sizing.resolve_memory_pool_config(kvc, 0, EssArgs(**tiered, host_pool_gib=64), facts)
    assert config.max_running_requests == 138  # the device's count, as on a 2 TiB node without a tier
    assert (spec.host_bytes, spec.disk_dir, spec.disk_bytes) == (64 << 30, str(tmp_path), 1000 << 30)
    assert config.max_total_num_tokens * layers * DISK_PAGE_BYTES // 64 <= spec.disk_bytes
    # a small disk caps the tokens (2.5M, below 100 requests x 32K)
    s = sizing.ess_pool_sizes(layers, avail, 64, 100, ctx, cap, host_limit=102 << 30, disk_budget_bytes=100 << 30)
    assert s.limited_by == "disk" and s.tokens == (100 << 30) // (layers * DISK_PAGE_BYTES) * 64
    assert s.host_bytes == 64 << 30 and s.disk_bytes <= 100 << 30
    with pytest.raises(ValueError, match="--ess-disk-gib: 1.0 GiB of disk hold 24960 tokens, below one request of 32768"):
        sizing.ess_pool_sizes(layers, avail, 64, None, ctx, cap, disk_budget_bytes=1 << 30)
    # frames below one layer's worst-case step are refused at start-up: 138 requests x 2049 rows, each in a page of
    # its own, capped by one layer of the token pool (its pages)
    need = min(138 * 2049, config.max_total_num_tokens // 64 + 1)
    assert need * PAGE_BYTES > 2 << 30
    with pytest.raises(ValueError, match=f"--ess-host-pool-gib 2: a disk tier's frames must hold the {need} pages"):
        resolve(kvc, EssArgs(**tiered, host_pool_gib=2), facts)
    schedule.max_running_requests = 16  # fewer requests need fewer frames (16 x 2049 pages: 1.3 GiB)
    resolve(kvc, EssArgs(**tiered, host_pool_gib=2), facts)
    # without --ess-disk-gib: this rank's share of the directory's free space
    monkeypatch.setattr(sizing, "free_disk_bytes", lambda d: 8 << 40)
    assert sizing.disk_tier_spec(EssArgs(enable=True, host_pool_gib=8, disk_dir=str(tmp_path)), 8).disk_bytes == 1 << 40


def test_backend_hooks_stage_prefill_and_set_the_phase(pools):
    """The DSA backend hooks: a prefill batch is staged at metadata time; target-verify reads like decode."""
    import types

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_ess.hooks import registry as hooks

    stock, ess, tokens = pools
    backend = types.SimpleNamespace(token_to_kv_pool=ess, req_to_token=tokens.req_to_token)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor(REQ),
                                  seq_lens_cpu=torch.tensor([5, 3]), extend_prefix_lens_cpu=[2, 0])
    hooks.forward.after_init_forward_metadata(None, backend, batch)
    staged = tokens.req_to_token[REQ[0], :5].long()
    # staging rows from 1 on (SGLang's writer skips row 0)
    assert torch.equal(ess.translate_loc_to_hisparse_device(staged), torch.arange(1, 6, dtype=torch.int32))
    locs, rows, _ = ess._stage_cached  # request 0's cached prefix, and only it, comes from the host
    assert torch.equal(locs, staged[:2]) and rows.tolist() == [1, 2]
    seen = []
    for mode, phase in [(ForwardMode.EXTEND, EXTEND), (ForwardMode.TARGET_VERIFY, DECODE)]:
        batch.forward_mode = mode
        hooks.forward.around_forward_extend(lambda b, *a: seen.append(b.token_to_kv_pool.ess_phase), backend, None, None, None, None, batch)
        assert seen[-1] == phase and ess.ess_phase == EXTEND  # restored after the call
    hooks.forward.around_forward_decode(lambda b, *a: seen.append(b.token_to_kv_pool.ess_phase), backend)
    assert seen[-1] == DECODE
    batch.forward_mode = ForwardMode.TARGET_VERIFY  # verify batches are not staged
    ess.ess_stage_of_loc.fill_(-7)
    hooks.forward.after_init_forward_metadata(None, backend, batch)
    assert (ess.ess_stage_of_loc == -7).all()


def test_indexer_hook_skips_prefill_and_the_draft_worker(pools, monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_ess.hooks import registry as hooks

    stock, ess, tokens = pools
    rt = make_runtime(ess, tokens, overlap="da")
    monkeypatch.setattr(hooks.state, "runtime", rt)
    topk, pos = torch.zeros(2, K, dtype=torch.int32), torch.tensor([5, 5])
    for mode, pool in [(ForwardMode.EXTEND, ess), (ForwardMode.DECODE, stock)]:  # prefill; the MTP draft's pool
        with in_forward(pool):
            hooks.forward.after_indexer(topk, None, None, None, pos, decode_batch(torch.tensor(REQ), pos, mode), 0)
    with in_forward(ess):
        hooks.forward.after_indexer(topk, None, None, None, pos, decode_batch(torch.tensor(REQ), pos), L)  # the NextN layer
    hooks.forward.after_indexer(topk, None, None, None, pos, decode_batch(torch.tensor(REQ), pos), 0)  # outside a forward
    assert not rt.overlap.pending
    with in_forward(ess):  # the target's decode forward: the step starts at its indexer
        hooks.forward.after_indexer(topk, None, None, None, pos, decode_batch(torch.tensor(REQ), pos), 0)
    assert len(rt.overlap.pending) == 1


def test_prefill_top_k_warms_up_through_the_hooks(pools):
    """The prefill hooks plan LRU-Warmup at metadata time and apply it after each layer's attention, from SGLang's
    fused top-k (token locations, mapped back to positions through the staging plan). A TBO micro-batch is not
    staged again."""
    import types

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_ess.hooks import registry as hooks

    stock, ess, tokens = pools
    rt = make_runtime(ess, tokens, warmup_windows=2)
    req = torch.tensor(REQ)
    backend = types.SimpleNamespace(token_to_kv_pool=ess, req_to_token=tokens.req_to_token, use_fused_topk=True)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=req,
                                  seq_lens_cpu=torch.tensor([5, 3]), extend_prefix_lens_cpu=[2, 0])
    hooks.forward.after_init_forward_metadata(None, backend, batch)  # query rows: request 0 at 2..4, request 1 at 0..2
    pos = torch.tensor([[0, 1, -1], [1, 2, 3], [2, 3, 4], [0, -1, -1], [0, 1, -1], [1, 2, -1]])
    row_req = torch.tensor([REQ[0]] * 3 + [REQ[1]] * 3).unsqueeze(1)
    loc = torch.where(pos >= 0, tokens.req_to_token[row_req, pos.clamp(min=0)].long(), -1)
    assert torch.equal(ess.stage_positions(loc), pos)
    hooks.forward.around_forward_extend(lambda *a, **kw: None, backend, None, None, None, Layer(1), batch, topk_indices=loc)
    assert rt.cache.sparse.resident(1, REQ[0]) == {1, 2, 3, 4}  # its last 2 query rows
    assert rt.cache.sparse.resident(1, REQ[1]) == {0, 1, 2}
    assert rt.cache.sparse.resident(0, REQ[0]) == set()  # layer 0 did not run
    child = types.SimpleNamespace(**vars(batch), tbo_parent_token_range=(0, 3))
    child.req_pool_indices = req[:1]
    ess.ess_stage_of_loc.fill_(-7)
    hooks.forward.after_init_forward_metadata(None, backend, child)
    assert (ess.ess_stage_of_loc == -7).all()


# -- --ess-disk-dir: the host pool as a disk tier's frames ------------------------------------------------------------
FRAMES = 42  # one layer's pages (41) + 1: half of the 2 layers' pages in host memory, the rest on disk


@pytest.fixture
def tiered(pools, tmp_path):
    """The stock pool, and an ESS pool whose host rows are a disk tier of FRAMES pages over a file in tmp_path (the
    test's random locations scatter each request over every page of a layer: the tier's worst case)."""
    from sglang_ess.sizing import DiskTierSpec

    stock, _, tokens = pools
    with get_parallel().override(attn_dcp_size=1):
        ess = pool_class(8, 16, "torch", DiskTierSpec(FRAMES * 64 * 656, str(tmp_path), 1 << 30))(**POOL_KW)
    yield stock, ess, tokens
    ess.ess_tier.close()
    assert not list(tmp_path.iterdir())  # the page file goes with the tier


def by_location(ess, layer, locs):
    """ESS's host rows at locations locs on `layer`, read through the tier (their pages brought in first)."""
    return ess.ess_host[layer][ess._frame_rows(layer, locs)]


def test_prefill_and_decode_through_a_disk_tier_equal_the_stock_pool(tiered, monkeypatch):
    """Chunked prefill (its cached prefix staged from the tier) and DA decode steps (misses paged in at the indexer
    hook) read exactly the stock pool's rows, with half the pages on disk; every row comes back from host or disk."""
    from sglang_ess.hooks import registry as hooks

    stock, ess, tokens = tiered
    rng = random.Random(2)
    prefill(stock, ess, tokens, REQ, [0, 0], [30, 20], rng)
    prefill(stock, ess, tokens, REQ, [30, 20], [40, 33], rng)  # the prefixes come back through the tier
    rt = make_runtime(ess, tokens, overlap="da")
    monkeypatch.setattr(hooks.state, "runtime", rt)
    assert rt.cache.tier is ess.ess_tier
    req, pos = torch.tensor(REQ), torch.tensor([40, 33])
    for step in range(8):
        ess.ess_phase = DECODE
        topk = torch.tensor([rng.sample(range(p + 1), K) for p in pos.tolist()], dtype=torch.int32)
        for layer in range(L):
            with in_forward(ess):
                hooks.forward.after_indexer(topk, None, None, None, positions=pos, forward_batch=decode_batch(req, pos),
                                    layer_id=layer)
            write(stock, ess, layer, tokens.req_to_token[req, pos], salt=step)
            slots = rt.swap_in_selected_pages(req, pos + 1, topk, layer)
            got = ess.get_key_buffer(layer)[slots.long()]
            want = stock.get_key_buffer(layer)[tokens.req_to_token[req.unsqueeze(1), topk.long()].long()]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (step, layer)
        pos = pos + 1
    stats = dict(ess.ess_tier.stats)
    assert stats["disk_reads"] > 0 and stats["disk_writes"] > 0 and stats["prefetch_hits"] > 0, stats
    locs = torch.arange(SIZE + 64)
    for layer in range(L):
        assert torch.equal(by_location(ess, layer, locs), stock.kv_buffer[layer][:, 0].view(torch.uint8))
    ess.ess_tier.check()


def test_move_and_cpu_copy_through_a_disk_tier(tiered, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # SGLang's index-K copy syncs the GPU
    stock, ess, tokens = tiered
    ess.ess_phase = EXTEND
    loc = tokens.req_to_token[REQ[0], :100]
    ess.stage_extend(tokens.req_to_token, torch.tensor([REQ[0]]), [100], [0])
    for layer in range(L):
        write(stock, ess, layer, loc)
    tgt, src = torch.cat([torch.arange(SIZE - 10, SIZE), loc[:2]]), torch.cat([loc[:10], loc[2:4]])
    moved = torch.stack([stock.kv_buffer[layer][src.long(), 0].view(torch.uint8) for layer in range(L)])
    tier = ess.ess_tier  # the first source row lost on layer 1 (as a failed checksum leaves it): its mark moves with it
    tier.rewritten(1, src[:1], lost=np.array([True]), note="page N fails its checksum")
    ess.move_kv_cache(tgt, src)  # also overlapping: two sources are targets too
    for layer in range(L):
        assert torch.equal(by_location(ess, layer, tgt), moved[layer])
        assert tier.lost_rows(layer, tgt).tolist() == [layer == 1] + [False] * 11
    copy = ess.get_cpu_copy(tgt)
    assert torch.equal(copy["kv"], moved) and copy["ess_lost"][1][0].tolist() == [True] + [False] * 11
    for layer in range(L):  # overwrite them (found again), then load the copy back (lost again)
        write(stock, ess, layer, tgt, salt=5)
        assert not tier.lost_rows(layer, tgt).any()
    ess.load_cpu_copy(copy, tgt)
    for layer in range(L):
        assert torch.equal(by_location(ess, layer, tgt), moved[layer])
    assert tier.lost_rows(1, tgt[:1]).all() and tier.lost_note[1 * tier.P + int(tgt[0]) // 64] == "page N fails its checksum"
    ess.ess_tier.check()


def test_a_pd_decode_node_charges_its_warmup_metadata_to_the_host(monkeypatch):
    """A PD decode node's metadata buffers (two slots per request-table row, in host memory) each carry ESS's
    warm-up row (about 2 MB for DeepSeek-V3.2): sizing charges them to the same host budget as the latent rows."""
    from sglang_ess import sizing
    from sglang_ess.pd import warmup as pd_warmup

    layers, ctx, cap, avail = 61, 32768, 6554, 70 << 30
    kvc, _, schedule, disagg = configurator(monkeypatch, layers, avail)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (2 << 40) * 8 // 10 // ranks)
    disagg.disaggregation_mode, disagg.disaggregation_decode_extra_slots = "decode", 8
    schedule.max_running_requests = 40
    facts = EssFacts("pd-decode", 2048, layers, ctx, cap)
    rows = 40 + 8 + 1  # SGLang's decode request table: running + in-transfer + padding
    row_bytes = pd_warmup.row_ints(layers, 2048) * 4
    assert sizing.warmup_metadata_bytes(facts, EssArgs(enable=True)) == 2 * row_bytes and row_bytes > 1.9e6
    latent = 40 * ctx * layers * 656
    host_gib = (latent + rows * 2 * row_bytes // 2) / (1 << 30)  # room for the requests' tokens, not for all metadata
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=host_gib), facts)
    assert config.max_total_num_tokens * layers * 656 + rows * 2 * row_bytes <= host_gib * (1 << 30)
    assert config.max_total_num_tokens < 40 * ctx  # the metadata took what the last request's tokens needed
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=host_gib, warmup_windows=0), facts)
    assert config.max_total_num_tokens >= 40 * ctx  # no warm-up rows, no metadata of ESS's: every token fits


def test_a_page_that_fails_its_checksum_aborts_its_readers_only(tiered, plugin, monkeypatch):
    """A cached prefix row whose disk page was changed under the tier: the prefill that stages it charges its request
    (and no other), the scheduler hook after the forward ends that request with the page's error, its output dropped
    and kept out of the prefix cache; once it is let go the hook before the next batch evicts the cache's unlocked
    prefixes. SGLang's Req and ScheduleBatch are real; the scheduler and its tree cache are stand-ins (a Scheduler is
    a whole process; test_server.py runs SGLang's own radix cache through this path)."""
    import types

    from ess.core.disk_tier import DISK_PAGE
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    stock, ess, tokens = tiered
    tier = ess.ess_tier
    rng = random.Random(3)
    prefill(stock, ess, tokens, REQ, [0, 0], [30, 20], rng)
    other = set((tokens.req_to_token[REQ[1], :20].long() // 64).tolist())
    loc = next(int(x) for x in tokens.req_to_token[REQ[0], :30] if int(x) // 64 not in other)  # request 0's alone
    page = 1 * tier.P + loc // 64  # on layer 1
    tier.clock += 1
    tier.ensure([p for p in range(2 * tier.P) if p != page][:FRAMES])  # every frame to other pages: `page` on disk
    assert tier.frame_of[page] < 0 and tier.written[page]
    fd = os.open(f"/proc/self/fd/{tier.file.fd}", os.O_RDWR)
    os.pwrite(fd, b"\xff" * 8, page * DISK_PAGE)
    os.close(fd)
    readers = torch.tensor(REQ)
    ess.stage_extend(tokens.req_to_token, readers, [40, 33], [30, 20])  # the next chunks: both prefixes staged
    for layer in range(L):
        ess._stage_layer(layer)
    assert list(tier.lost_reads) == [REQ[0]] and f"page {page} of" in tier.lost_reads[REQ[0]]
    rt = make_runtime(ess, tokens)
    monkeypatch.setattr(plugin.state, "runtime", rt)
    monkeypatch.setattr(plugin.state, "lost_readers", [])
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    a, b = (Req(f"r{slot}", "", [1] * 30, SamplingParams(max_new_tokens=4)) for slot in REQ)
    for req, slot in zip((a, b), REQ):
        req.kv.req_pool_idx, req.kv.kv_allocated_len = slot, 30  # as the scheduler leaves them: rows held
    scheduler = types.SimpleNamespace(chunked_req=a, _pending_chunked_abort_req=None)
    plugin.forward.after_run_batch(None, scheduler, ScheduleBatch(reqs=[a, b]))
    reason = a.discard_output_reason
    assert reason is a.to_finish and reason.status_code == 500 and f"page {page} of {tier.file.path}" in reason.message
    assert a.skip_radix_cache_insert and scheduler._pending_chunked_abort_req is a
    assert b.discard_output_reason is None and b.to_finish is None and not b.skip_radix_cache_insert
    evicted = []
    tree = types.SimpleNamespace(evictable_size=lambda: 77, evict=lambda p: evicted.append(p.num_tokens) or
                                 types.SimpleNamespace(num_tokens_evicted=p.num_tokens))
    scheduler.tree_cache = tree
    plugin.forward.before_get_next_batch(scheduler)
    assert evicted == []  # the aborted request still holds its prefix
    a.kv.mark_kv_released()
    rt.release(REQ[0])  # SGLang's release hook: the row's charge goes with its request
    plugin.forward.before_get_next_batch(scheduler)
    assert evicted == [77] and not plugin.state.lost_readers and REQ[0] not in tier.lost_reads
    ess.stage_extend(tokens.req_to_token, torch.tensor([REQ[1]]), [33], [20])  # the other request reads on unharmed
    for layer in range(L):
        ess._stage_layer(layer)
    assert not tier.lost_reads
