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


def test_the_resident_path_writes_decode_rows_into_regions_and_a_backup_flushes_them_first(pools, sglang_req,
                                                                                          monkeypatch):
    """Residency first, no offloaded request: a decode forward takes the resident path, where the pool's write (SGLang's
    quantiser) puts each new row straight into its request's region and nothing into the host pool; a PD retraction's
    backup (get_cpu_copy) gets those rows all the same, flushed to the host pool first (docs/plugin.md, "Two paths")."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # SGLang's index-K copy syncs the GPU
    stock, ess, tokens = pools
    facts = EssFacts("co-located", K, L, tokens.req_to_token.shape[1], C, residency=True)
    rt = EssRuntime(EssArgs(enable=True, buffer_tokens=C), facts, tokens.req_to_token, host=ess.ess_host,
                    device="cpu", backend="torch")
    ess.ess_runtime = rt
    rt.plan_positions(REQ[0], 40, sglang_req(REQ[0], prompt=30))
    rt.reset_rows([REQ[0]])
    rt.start_forward(decode=False)
    prefill(stock, ess, tokens, [REQ[0]], [0], [30], random.Random(0))
    rt.start_forward()
    assert rt.resident_forward
    ess.ess_phase = DECODE
    rt.set_batch(torch.tensor([REQ[0]]), torch.tensor([30]))
    own = tokens.req_to_token[REQ[0], 30:31].long()
    start = rt.cache.region[REQ[0]][0]
    for layer in range(L):
        write(stock, ess, layer, own)
        want = stock.kv_buffer[layer][own, 0].view(torch.uint8)
        assert torch.equal(rt.cache.gpu[layer, start + 30:start + 31], want)  # in its region
        assert not ess.ess_host[layer, own].any()  # and not backed up
    copy = ess.get_cpu_copy(tokens.req_to_token[REQ[0], :31], req_pool_index=REQ[0])
    for layer in range(L):
        assert torch.equal(copy["kv"][layer], stock.kv_buffer[layer][tokens.req_to_token[REQ[0], :31].long(), 0]
                           .view(torch.uint8))


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
