"""Three layers of real prefill, decode and MTP target-verify forwards through SGLang's own
DeepseekSparseAttnBackend, with ESS's plugin hooks as SGLang's hook registry applied them, against the stock backend
over SGLang's stock DSA pool: the same attention output at every layer and step; with DA the misses' copy starts at
the indexer hook, before the attention call; prefill's top-k warms decode up. And the trace recorder's next-ranked
positions, taken where SGLang's indexer metadata makes the top-k.

Real here: ServerArgs resolved by SGLang with the ESS flags, its runtime context, ModelConfig, ReqToTokenPool,
DSATokenToKVPool (stock) and ESS's subclass, the ESS runtime built by the plugin's model-runner hook, both
DeepseekSparseAttnBackend objects, ForwardBatch, init_forward_metadata, forward_decode (FlashMLA's FP8 decode path),
RadixAttention and the forward context; the kernels are the plugin's CPU path, SGLang's own FP8 row writer among
them (which never writes destination row 0).
Two stand-ins, with the reason:
- the ModelRunner: it loads a model; the backend and the hook read the attributes given here (the real server test,
  test_server.py, runs the real one);
- the Indexer's forward: the tests choose each step's top-k (random sets over the context, so that misses and
  evictions happen at will) and call the plugin's AFTER hook with the arguments SGLang's registry passes it
  (x, q_lora, positions, forward_batch, layer_id) and that top-k, as positions (un-fused, as a real indexer returns
  it under a sparse-offload coordinator). The real indexer runs in test_cpu_path.py and the real server test.
"""

import json
import pathlib
import random
import types

import pytest
import torch

sglang = pytest.importorskip("sglang")

L, K, C, SIZE, MAX_LEN, HEADS = 3, 16, 24, 40 * 64, 200, 128
REQ = [3, 1]  # request-pool slots (0 is SGLang's padding row)
CONFIG = {**json.loads((pathlib.Path(__file__).parent / "dsv32_config.json").read_text()), "num_hidden_layers": L,
          "index_topk": K}  # DeepSeek-V3.2's config.json, with 3 layers and top-16


@pytest.fixture
def launch(tmp_path, monkeypatch, plugin):
    """launch(*flags, buffer=C): SGLang's server arguments for an ESS decode launch (DA on every layer, plus flags),
    resolved and active for the test."""
    import contextlib

    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))  # SGLang's DSA defaults: SM90
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    stack = contextlib.ExitStack()

    def start(*flags, buffer=C):
        # every request offloaded unless a test asks for residency (these tests write requests without SGLang's
        # scheduler, which gives each one its region at admission)
        residency = [] if "--ess-residency" in flags else ["--ess-residency", "off"]
        sa = prepare_server_args(["--model-path", str(tmp_path), "--skip-tokenizer-init", "--device", "cpu",
                                  "--context-length", str(MAX_LEN), "--kv-cache-dtype", "fp8_e4m3", "--enable-ess",
                                  "--ess-buffer-tokens", str(buffer), "--ess-overlap", "da", *residency, *flags])
        sa.resolve_once()
        stack.enter_context(runtime_context.use_context(runtime_context.create_context(sa, role="test")))
        return sa, ModelConfig.from_server_args(sa)

    with stack:
        yield start
    monkeypatch.setattr(plugin.state, "runtime", None)
    monkeypatch.setattr(plugin.state, "stage_tokens", None)


def model_runner(sa, model_config, pool, tokens):
    """The ModelRunner attributes the DSA backend and ESS's hook read (a real one loads the model on a GPU)."""
    return types.SimpleNamespace(device="cpu", page_size=64, model_config=model_config, token_to_kv_pool=pool,
                                 req_to_token_pool=tokens, hisparse_coordinator=None, is_draft_worker=False,
                                 kv_cache_dtype=torch.float8_e4m3fn, server_args=sa)


FRAMES = 42  # with --ess-disk-dir: a third of the pages (3 layers x 41), one layer's worth


def tier_flags(tmp_path) -> list[str]:
    """A disk tier of FRAMES host pages over a page file in tmp_path/disk (SIZE's locations scatter every request's
    positions over all 41 pages of a layer: no locality, the tier's worst case)."""
    (tmp_path / "disk").mkdir(exist_ok=True)
    return ["--ess-host-pool-gib", str((FRAMES + 0.5) * 64 * 656 / 2**30), "--ess-disk-dir", str(tmp_path / "disk"),
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


def host_rows_by_location(pool, layer):
    """ESS's host rows of every location on `layer` (through the disk tier's frames when there is one)."""
    locs = torch.arange(SIZE + 64)
    if pool.ess_tier is None:
        return pool.ess_host[layer, : SIZE + 64]
    pool.ess_tier.ensure(pool.ess_tier.pages(layer, locs))
    return pool.ess_host[layer][pool.ess_tier.rows(layer, locs)]


def build(plugin, sa, mc):
    """SGLang's request table, its stock DSA pool and ESS's (with the launch's disk tier, if any), the ESS runtime
    (through the plugin's model-runner hook) and both real backends."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

    from sglang_ess.args import ess_args
    from sglang_ess.pool import EssDSATokenToKVPool, pool_class
    from sglang_ess.sizing import disk_tier_spec

    kw = dict(size=SIZE, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=L,
              device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656, start_layer=0, end_layer=L)
    tokens = ReqToTokenPool(4, MAX_LEN, "cpu", False)
    locs = torch.randperm(SIZE - 1, generator=torch.Generator().manual_seed(0))  # scattered, the same every run
    tokens.req_to_token[REQ] = (locs[: len(REQ) * MAX_LEN] + 1).int().view(len(REQ), -1)
    stock_pool = DSATokenToKVPool(**kw)
    ess_pool = pool_class(scratch_rows=8, stage_rows=64, backend="torch",
                          tier=disk_tier_spec(ess_args(sa), 1))(**kw)
    assert isinstance(ess_pool, EssDSATokenToKVPool)

    runner = model_runner(sa, mc, ess_pool, tokens)
    plugin.startup.after_init_sparse_coordinator(None, runner)  # SGLang calls it after maybe_init_hisparse_coordinator
    rt = plugin.state.runtime
    assert rt is not None and runner.hisparse_coordinator is rt and rt.modes == ["da"] * L
    # prefill admission keeps batches within the staging rows (row 0 is SGLang's writer's reserved row)
    assert plugin.state.stage_tokens == ess_pool.ess_stage.shape[0] - 1
    ess = DeepseekSparseAttnBackend(runner)
    stock = DeepseekSparseAttnBackend(model_runner(sa, mc, stock_pool, tokens))
    assert ess.hisparse_coordinator is rt and stock.hisparse_coordinator is None
    assert ess.dsa_decode_impl == stock.dsa_decode_impl == "flashmla_kv"
    return tokens, stock_pool, ess_pool, rt, ess, stock


def attention_layers():
    """SGLang's RadixAttention of each layer, as DeepSeek-V3.2's absorbed MLA calls the backend (576-wide q and k)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return [RadixAttention(num_heads=HEADS, head_dim=576, scaling=576**-0.5, num_kv_heads=1, layer_id=i,
                           v_head_dim=512) for i in range(L)]


def write_prompts(tokens, stock_pool, ess_pool, layers, ctx, gen):
    """The prompts' rows (ctx[b] positions of request REQ[b]), written through both pools' own set_mla_kv_buffer
    (ESS's: staged prefill, then the host)."""
    ess_pool.stage_extend(tokens.req_to_token, torch.tensor(REQ), ctx, [0] * len(ctx))
    for layer in layers:
        loc = torch.cat([tokens.req_to_token[r, :n] for r, n in zip(REQ, ctx)]).long()
        nope, rope = torch.randn(loc.shape[0], 1, 512, generator=gen), torch.randn(loc.shape[0], 1, 64, generator=gen)
        for pool in (stock_pool, ess_pool):
            pool.set_mla_kv_buffer(layer, loc, nope.bfloat16(), rope.bfloat16())


def random_topk(pos: torch.Tensor, rng) -> torch.Tensor:
    """K distinct causal positions for each query row at positions pos, as an indexer's top-k."""
    return torch.tensor([rng.sample(range(p + 1), K) for p in pos.tolist()], dtype=torch.int32)


def decode_batch(tokens, req, pos):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(req), input_ids=torch.zeros_like(req),
                        req_pool_indices=req, seq_lens=pos + 1, seq_lens_cpu=pos + 1,
                        out_cache_loc=tokens.req_to_token[req, pos].long(), seq_lens_sum=int((pos + 1).sum()),
                        positions=pos)


def test_resident_and_offloaded_requests_through_the_real_backend_equal_the_stock_backend(launch, plugin):
    """Residency first through SGLang's own backend and pools: request slot 3 reaches 48 positions and fits whole,
    slot 1 reaches 200 and is offloaded; its prefill rows land in its region as the pool writes them; three DA decode
    steps over both in one call give the stock backend's output bit for bit, only slot 1 missing."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    tokens, stock_pool, ess_pool, rt, ess, stock = build(plugin, *launch("--ess-residency", "on"))
    for slot, reach in zip(REQ, (48, 200)):
        rt.plan_positions(slot, reach)
    rt.reset_rows(REQ)
    rt.apply_admissions()  # at the next forward, as the scheduler's admission is applied
    assert rt.cache.resident_requests() == [3] and rt.cache.offloaded == {1}
    layers = attention_layers()
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    req, pos = torch.tensor(REQ), torch.tensor([40, 33])
    write_prompts(tokens, stock_pool, ess_pool, layers, pos.tolist(), gen)
    for step in range(3):
        batch = decode_batch(tokens, req, pos)
        ess.init_forward_metadata(batch)
        stock.init_forward_metadata(batch)
        rt.start_forward()
        for layer in layers:
            topk = random_topk(pos, rng)
            q, q_rope = torch.randn(2, HEADS, 512, generator=gen).bfloat16(), torch.randn(2, HEADS, 64, generator=gen).bfloat16()
            k, k_rope = torch.randn(2, 1, 512, generator=gen).bfloat16(), torch.randn(2, 1, 64, generator=gen).bfloat16()
            with forward_context(ForwardContext(attn_backend=ess)):
                plugin.forward.after_indexer(topk, None, None, None, batch.positions, batch, layer.layer_id)
                got = ess.forward_decode(q, k, k, layer, batch, q_rope=q_rope, k_rope=k_rope, topk_indices=topk)
            with forward_context(ForwardContext(attn_backend=stock)):
                want = stock.forward_decode(q, k, k, layer, batch, q_rope=q_rope, k_rope=k_rope, topk_indices=topk)
            assert torch.equal(got, want), (step, layer.layer_id)
        rt.end_forward()
        pos = pos + 1
    assert rt.counts()["missed_rows"] > 0 and int((rt.cache.sparse.slot_pos[:, 3] >= 0).sum()) == 0


# DA's Attn1 (OverlapSteps.attn1): the split over the misses, fused with their copy, or one call over every entry
DA_EVENTS = {"miss": ["indexer", "h2d of the misses", "attention", "attn1 over the misses"],
             "fused": ["indexer", "attention", "h2d and attn1 fused"],
             "calls": ["indexer", "h2d of the misses", "attention"]}


@pytest.mark.parametrize("tier,attn1", [(False, "miss"), (False, "fused"), (False, "calls"), (True, "miss")],
                         ids=["host", "host-fused", "host-one-call", "disk-tier"])
def test_da_decode_through_the_real_backend_equals_the_stock_backend(launch, plugin, monkeypatch, tmp_path, tier,
                                                                       attn1):
    """With --ess-disk-dir too: a third of the pages in host frames, the rest on disk, and the same output. Split
    (Attn0 through SGLang's FlashMLA call with the misses set to -1, Attn1 over the compacted miss list, merged), the
    output is the stock one's within bf16 rounding (each part leaves FlashMLA in bf16); in one call, the same bits."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    flags = [*(tier_flags(tmp_path) if tier else []), *([] if attn1 == "calls" else ["--ess-da-attn1", attn1])]
    tokens, stock_pool, ess_pool, rt, ess, stock = build(plugin, *launch(*flags))
    assert rt.overlap.attn1 == attn1  # the flag's, or its default ("calls": one call)
    events, misses = [], []
    fetch, attend, fetch_attend = rt.cache.fetch, rt.cache.attend_misses, rt.cache.fetch_attend

    def logged_fetch(layer, req, table, r, **kw):  # the H2D of a step's misses (ess.core.serving)
        events.append("h2d of the misses")
        misses.append(int(r.n_miss.sum()))
        return fetch(layer, req, table, r, **kw)

    def logged_attend(layer, r, *a):
        events.append("attn1 over the misses")
        return attend(layer, r, *a)

    def logged_fetch_attend(layer, req, table, r, *a):
        events.append("h2d and attn1 fused")
        misses.append(int(r.n_miss.sum()))
        return fetch_attend(layer, req, table, r, *a)

    monkeypatch.setattr(rt.cache, "fetch", logged_fetch)
    monkeypatch.setattr(rt.cache, "attend_misses", logged_attend)
    monkeypatch.setattr(rt.cache, "fetch_attend", logged_fetch_attend)

    layers = attention_layers()
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    req = torch.tensor(REQ)
    ctx = [40, 33]
    write_prompts(tokens, stock_pool, ess_pool, layers, ctx, gen)
    pos = torch.tensor(ctx)
    for step in range(3):
        batch = decode_batch(tokens, req, pos)
        ess.init_forward_metadata(batch)
        stock.init_forward_metadata(batch)
        # a sparse-offload coordinator makes the indexer hand over positions (un-fused top-k), as ESS's hook expects
        assert ess.get_indexer_metadata(0, batch).force_unfused_topk
        rt.start_forward()
        for layer in layers:
            topk = random_topk(pos, rng)
            q = torch.randn(len(REQ), HEADS, 512, generator=gen).bfloat16()
            q_rope = torch.randn(len(REQ), HEADS, 64, generator=gen).bfloat16()
            k = torch.randn(len(REQ), 1, 512, generator=gen).bfloat16()
            k_rope = torch.randn(len(REQ), 1, 64, generator=gen).bfloat16()
            events.clear()
            with forward_context(ForwardContext(attn_backend=ess)):
                events.append("indexer")
                plugin.forward.after_indexer(topk, None, None, None, batch.positions, batch, layer.layer_id)
                events.append("attention")
                got = ess.forward_decode(q, k, k, layer, batch, q_rope=q_rope, k_rope=k_rope, topk_indices=topk)
            assert events == DA_EVENTS[attn1], events  # DA: the H2D started at the indexer (fused: at the attention)
            assert not rt.overlap.pending and not rt.split_pending  # the attention call took the step the indexer started
            with forward_context(ForwardContext(attn_backend=stock)):
                # the stock backend maps the same positions to token locations through its own page table
                want = stock.forward_decode(q, k, k, layer, batch, q_rope=q_rope, k_rope=k_rope, topk_indices=topk)
            if attn1 == "calls":
                assert torch.equal(got, want), (step, layer.layer_id)
            else:
                torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2, msg=f"step {step} layer {layer.layer_id}")
        rt.end_forward()
        pos = pos + 1
    assert len(misses) == 3 * L and min(misses[L:]) > 0  # C = 24 slots for top-16 of 40+ positions: misses every step
    if tier:  # the decode steps themselves read pages back from disk
        assert ess_pool.ess_tier.stats["disk_reads"] > 0 and ess_pool.ess_tier.stats["exposed_disk_ms"] > 0
    # the step's own rows reached the host pool, where SGLang's PD transfer and later prefills read them
    for i in range(L):
        assert torch.equal(host_rows_by_location(ess_pool, i), stock_pool.kv_buffer[i][:, 0].view(torch.uint8))
    if tier:  # pages went to disk and came back (every location was read back above, equal to the stock pool's)
        report = rt.stats()["tier"]
        assert report["frames"] == FRAMES and report["disk_reads"] > 0 and report["disk_writes"] > 0, report
        ess_pool.ess_tier.check()
        ess_pool.ess_tier.close()


def test_recorded_traces_carry_the_positions_the_indexer_ranks_next(launch, plugin, tmp_path):
    """--ess-record-lookahead 4: where SGLang's indexer metadata turns logits into the top-k (the real
    DSAIndexerMetadata of the ESS backend), the plugin keeps the 4 positions ranked next; the trace files of the
    finished requests hold them as topk_ext, and the prefetch replay reads them."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from ess.analysis.replay import replay_counts
    from ess.core.trace import load_trace

    d = 4
    out = tmp_path / "traces"
    tokens, _, _, rt, ess, _ = build(plugin, *launch("--ess-record-trace", str(out), "--ess-record-lookahead", str(d)))
    layers = attention_layers()
    gen = torch.Generator().manual_seed(1)
    req, pos = torch.tensor(REQ), torch.tensor([40, 33])
    want = {}
    for step in range(3):
        batch = decode_batch(tokens, req, pos)
        ess.init_forward_metadata(batch)
        rt.start_forward()
        for layer in layers:
            logits = torch.randn(len(REQ), MAX_LEN, generator=gen)
            with forward_context(ForwardContext(attn_backend=ess)):
                topk = ess.get_indexer_metadata(layer.layer_id, batch).topk_transform(logits, K)  # SGLang's call
                plugin.forward.after_indexer(topk, None, None, None, batch.positions, batch, layer.layer_id)
                q = torch.randn(len(REQ), HEADS, 576, generator=gen).bfloat16()
                k = torch.randn(len(REQ), 1, 576, generator=gen).bfloat16()
                ess.forward_decode(q[..., :512], k[..., :512], k[..., :512], layer, batch, q_rope=q[..., 512:],
                                   k_rope=k[..., 512:], topk_indices=topk)
            ranked = torch.argsort(torch.where(torch.arange(MAX_LEN) <= pos.unsqueeze(1), logits, -torch.inf), 1,
                                   descending=True)
            for b in range(len(REQ)):
                want[REQ[b], step, layer.layer_id] = ranked[b, : K + d].tolist()
        rt.end_forward()
        pos = pos + 1
    files = [rt.release(slot, f"r{slot}") for slot in REQ]
    for slot, path in zip(REQ, files):
        trace = load_trace(path)  # validated: the first K of topk_ext are the top-k set, causal
        assert trace.lookahead == d and trace.topk_ext.shape == (1, 3, L, K + d)
        for step in range(3):
            for layer in range(L):
                row = trace.topk_ext[0, step, layer]
                assert sorted(row[:K]) == sorted(want[slot, step, layer][:K]), (slot, step, layer)
                assert row[K:].tolist() == want[slot, step, layer][K:], (slot, step, layer)
        counts = replay_counts(trace, C, warmup=False, policy="prefetch")
        assert counts.prefetched.sum() > 0


@pytest.mark.parametrize("tier", [False, True], ids=["host", "disk-tier"])
def test_mtp_verify_through_the_real_backend_equals_the_stock_backend(launch, plugin, monkeypatch, tmp_path, tier):
    """MTP target-verify (3 query rows per request: SGLang's forward_extend in TARGET_VERIFY mode) with DA: the step
    starts at the indexer hook over the union of each request's rows, the attention reads ESS's slots, and every
    row's output equals the stock backend's (with --ess-disk-dir too: the union's misses paged in from disk)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    S, buffer = 3, 3 * (K + 1) + 9  # every verify row's set and own token fit (the plugin refuses fewer)
    tokens, stock_pool, ess_pool, rt, ess, stock = build(
        plugin, *launch("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(S),
                        *(tier_flags(tmp_path) if tier else []), buffer=buffer))
    assert ess.speculative_num_draft_tokens == S and rt.cache.capacity == buffer
    layers = attention_layers()
    gen, rng = torch.Generator().manual_seed(2), random.Random(2)
    req, ctx = torch.tensor(REQ), [40, 33]
    write_prompts(tokens, stock_pool, ess_pool, layers, ctx, gen)
    seq = torch.tensor(ctx)
    for step in range(3):
        # the verify forward: S draft positions per request after its accepted ones; SGLang's seq_lens exclude them
        pos = (seq.unsqueeze(1) + torch.arange(S)).reshape(-1)
        out_loc = tokens.req_to_token[req.repeat_interleave(S), pos].long()
        batch = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(REQ),
                             input_ids=torch.zeros(len(REQ) * S, dtype=torch.long), req_pool_indices=req,
                             seq_lens=seq, seq_lens_cpu=seq, out_cache_loc=out_loc, seq_lens_sum=int(seq.sum()),
                             positions=pos)
        ess.init_forward_metadata(batch)
        stock.init_forward_metadata(batch)
        rt.start_forward()
        for layer in layers:
            topk = random_topk(pos, rng)
            q = torch.randn(len(pos), HEADS, 576, generator=gen).bfloat16()
            k = torch.randn(len(pos), 1, 576, generator=gen).bfloat16()
            with forward_context(ForwardContext(attn_backend=ess)):
                plugin.forward.after_indexer(topk, None, None, None, batch.positions, batch, layer.layer_id)
                assert len(rt.overlap.pending) == 1  # DA: the union's step started at the indexer
                got = ess.forward_extend(q[..., :512], k[..., :512], k[..., :512], layer, batch, q_rope=q[..., 512:],
                                         k_rope=k[..., 512:], topk_indices=topk)
            assert not rt.overlap.pending
            with forward_context(ForwardContext(attn_backend=stock)):
                want = stock.forward_extend(q[..., :512], k[..., :512], k[..., :512], layer, batch,
                                            q_rope=q[..., 512:], k_rope=k[..., 512:], topk_indices=topk)
            assert torch.equal(got, want), (step, layer.layer_id)
        rt.end_forward()
        seq = seq + 1 + step % 2  # 1 or 2 tokens accepted
    if tier:
        assert ess_pool.ess_tier.stats["disk_faults"] > 0
        ess_pool.ess_tier.check()
        ess_pool.ess_tier.close()


@pytest.mark.parametrize("tier", [False, True], ids=["host", "disk-tier"])
def test_prefill_through_the_real_backend_reads_staged_rows_and_warms_decode_up(launch, plugin, tmp_path, tier):
    """A prefill forward (SGLang's forward_extend, EXTEND): ESS stages the batch at metadata time, the backend's
    top-k (positions, mapped to token locations by its page table) reads staged rows equal to the stock pool's, and the same call's top-k leaves each
    request's GPU slots as LRU-Warmup over its last W query rows (the oracle LRU's resident set)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from ess.reference.lru_oracle import OracleLRU

    tokens, stock_pool, ess_pool, rt, ess, stock = build(plugin, *launch(*(tier_flags(tmp_path) if tier else [])))
    W = rt.ess.warmup_windows
    layers = attention_layers()
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    req, lens = torch.tensor(REQ), [40, 33]
    pos = torch.cat([torch.arange(n) for n in lens])
    row_req = torch.tensor([r for r, n in zip(REQ, lens) for _ in range(n)])
    seq = torch.tensor(lens)
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(REQ),
                         input_ids=torch.zeros(len(pos), dtype=torch.long), req_pool_indices=req, seq_lens=seq,
                         seq_lens_cpu=seq, out_cache_loc=tokens.req_to_token[row_req, pos].long(),
                         seq_lens_sum=int(seq.sum()), positions=pos, extend_seq_lens=seq, extend_seq_lens_cpu=lens,
                         extend_prefix_lens=torch.zeros(2, dtype=torch.long), extend_prefix_lens_cpu=[0, 0])
    ess.init_forward_metadata(batch)  # the plugin's hook stages the batch and plans LRU-Warmup
    stock.init_forward_metadata(batch)
    assert not ess.use_mha and not stock.use_mha
    warm = {}
    for layer in layers:
        sets = [rng.sample(range(p + 1), min(K, p + 1)) + [-1] * max(0, K - p - 1) for p in pos.tolist()]
        topk = torch.tensor(sets, dtype=torch.int32)
        q = torch.randn(len(pos), HEADS, 576, generator=gen).bfloat16()
        k = torch.randn(len(pos), 1, 576, generator=gen).bfloat16()
        outs = []
        for backend in (ess, stock):  # both indexers hand over the un-fused top-k: positions
            with forward_context(ForwardContext(attn_backend=backend)):
                outs.append(backend.forward_extend(q[..., :512], k[..., :512], k[..., :512], layer, batch,
                                                   q_rope=q[..., 512:], k_rope=k[..., 512:], topk_indices=topk))
        assert torch.equal(outs[0], outs[1]), layer.layer_id
        for b, r in enumerate(REQ):
            rows = [i for i in range(len(pos)) if int(row_req[i]) == r][-W:]
            oracle = OracleLRU(rt.cache.capacity)
            for w, i in enumerate(rows):
                oracle.step(sets[i], -1, w)
            warm[layer.layer_id, r] = set(oracle.stamp)
    for (layer, r), want in warm.items():
        assert rt.cache.sparse.resident(layer, r) == want, (layer, r)
    for layer in layers:  # the warm rows in the GPU slots are the prompt's rows, through the tier's frames too
        i = layer.layer_id
        for r in REQ:
            pos_, slots = rt.cache.sparse.resident_slots(i, torch.tensor([r]))
            held = pos_ >= 0
            locs = tokens.req_to_token[r, pos_[held].long()].long()
            want = stock_pool.kv_buffer[i][locs, 0].view(torch.uint8)
            assert torch.equal(rt.cache.gpu[i][slots[held].long()], want), (i, r)
    if tier:
        ess_pool.ess_tier.check()
        ess_pool.ess_tier.close()


def test_a_prefill_nodes_ragged_top_k_becomes_positions(tmp_path, monkeypatch, plugin):
    """A PD prefill node whose prefill backend is FlashMLA's FP8 sparse prefill (flashmla_sparse, Blackwell's
    default) has SGLang fuse the top-k into offsets of the batch's ragged KV (TopkTransformMethod.RAGGED), not token
    locations: the warm-up it sends must hold positions (else the decode node warms the wrong rows). The real
    backend's metadata gives each row's base; the plugin's mapping returns the positions the offsets stand for."""
    import contextlib

    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    sa = prepare_server_args(["--model-path", str(tmp_path), "--skip-tokenizer-init", "--device", "cpu",
                              "--context-length", str(MAX_LEN), "--kv-cache-dtype", "fp8_e4m3", "--enable-ess",
                              "--disaggregation-mode", "prefill", "--dsa-prefill-backend", "flashmla_sparse"])
    sa.resolve_once()
    with contextlib.ExitStack() as stack:
        stack.enter_context(runtime_context.use_context(runtime_context.create_context(sa, role="test")))
        monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1")  # SGLang's default on a GPU
        mc = ModelConfig.from_server_args(sa)
        kw = dict(size=SIZE, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=L,
                  device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656, start_layer=0,
                  end_layer=L)
        tokens = ReqToTokenPool(4, MAX_LEN, "cpu", False)
        tokens.req_to_token[REQ] = torch.arange(1, 1 + len(REQ) * MAX_LEN).int().view(len(REQ), -1)
        backend = DeepseekSparseAttnBackend(model_runner(sa, mc, DSATokenToKVPool(**kw), tokens))
        assert backend.use_fused_topk
        prefix, lens = [0, 20], [40, 33]  # request 1 extends a cached prefix of 20
        seq = torch.tensor(lens)
        ext = [n - p for n, p in zip(lens, prefix)]
        pos = torch.cat([torch.arange(p, n) for p, n in zip(prefix, lens)])
        row_req = torch.tensor([r for r, e in zip(REQ, ext) for _ in range(e)])
        batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.zeros(len(pos), dtype=torch.long),
                             req_pool_indices=torch.tensor(REQ), seq_lens=seq, seq_lens_cpu=seq,
                             out_cache_loc=tokens.req_to_token[row_req, pos].long(), seq_lens_sum=int(seq.sum()),
                             positions=pos, extend_seq_lens=torch.tensor(ext), extend_seq_lens_cpu=ext,
                             extend_prefix_lens=torch.tensor(prefix), extend_prefix_lens_cpu=prefix)
        backend.init_forward_metadata(batch)
        assert backend.get_topk_transform_method(ForwardMode.EXTEND) == TopkTransformMethod.RAGGED
        rng = random.Random(5)
        want = torch.tensor([rng.sample(range(p + 1), min(8, p + 1)) + [-1] * max(0, 7 - p)
                             for p in pos.tolist()])  # each row's positions, -1 padded
        base = torch.tensor([0] * ext[0] + [lens[0]] * ext[1]).unsqueeze(1)  # request 1's KV follows request 0's
        ragged = torch.where(want >= 0, want + base, -1)
        ragged[3, 5:] = want[3, 5:] = -1
        assert torch.equal(plugin.forward.ragged_positions(backend, batch, ragged), want)
        monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")  # the CPU path's: positions already
        backend.use_fused_topk = False
        assert plugin.forward.ragged_positions(backend, batch, want) is None


def relabel_as_sglang_does(batch):
    """The fields SGLang's DP attention sets when it relabels a decode batch as one-token extends (the branch of
    ForwardBatch.prepare_mlp_sync_batch for a rank whose peers prefill; forward_batch_info.py). The function itself
    needs DP process groups and gathered buffers, which one CPU process does not have."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs = batch.batch_size
    batch._original_forward_mode = batch.forward_mode
    batch.forward_mode = ForwardMode.EXTEND
    batch.extend_num_tokens = bs
    batch.extend_seq_lens = torch.full_like(batch.seq_lens, 1)
    batch.extend_prefix_lens = batch.seq_lens - 1
    batch.extend_start_loc = torch.arange(bs, dtype=torch.int32)
    batch.extend_prefix_lens_cpu = batch.extend_prefix_lens.tolist()
    batch.extend_seq_lens_cpu = batch.extend_seq_lens.tolist()
    batch.extend_logprob_start_lens_cpu = batch.extend_prefix_lens_cpu
    return batch


def test_a_decode_step_relabelled_by_dp_attention_reads_its_rows_without_losing_the_working_sets(launch, plugin):
    """DP attention relabels a rank's decode batch as one-token extends while another rank prefills: SGLang's
    logical_forward_mode still says decode. ESS then stages, per layer, only the step's own rows and the rows its top-k
    selects (not every token of the requests), keeps the requests' GPU slots and LRU state (no warm-up), and the
    attention equals the stock backend's; the next plain decode step goes on from the working sets."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    tokens, stock_pool, ess_pool, rt, ess, stock = build(plugin, *launch())
    rt.overlap.attn1 = "calls"  # DA's decode steps in one attention call: every output compares bit for bit
    layers = attention_layers()
    gen, rng = torch.Generator().manual_seed(6), random.Random(6)
    req, ctx = torch.tensor(REQ), [40, 33]
    write_prompts(tokens, stock_pool, ess_pool, layers, ctx, gen)
    pos = torch.tensor(ctx)
    resident = None
    for step, relabel in enumerate([False, True, False]):
        batch = decode_batch(tokens, req, pos)
        stock_batch = decode_batch(tokens, req, pos)
        if relabel:
            relabel_as_sglang_does(batch), relabel_as_sglang_does(stock_batch)
            assert batch.logical_forward_mode.is_decode() and batch.forward_mode.is_extend()
            resident = [rt.cache.sparse.resident(i, REQ[0]) for i in range(L)]
        ess.init_forward_metadata(batch)
        stock.init_forward_metadata(stock_batch)
        rt.start_forward()
        for layer in layers:
            topk = random_topk(pos, rng)
            q = torch.randn(len(REQ), HEADS, 576, generator=gen).bfloat16()
            k = torch.randn(len(REQ), 1, 576, generator=gen).bfloat16()
            call = "forward_extend" if relabel else "forward_decode"
            outs = []
            for backend, b in ((ess, batch), (stock, stock_batch)):
                with forward_context(ForwardContext(attn_backend=backend)):
                    if backend is ess and not relabel:
                        plugin.forward.after_indexer(topk, None, None, None, b.positions, b, layer.layer_id)
                    outs.append(getattr(backend, call)(q[..., :512], k[..., :512], k[..., :512], layer, b,
                                                       q_rope=q[..., 512:], k_rope=k[..., 512:], topk_indices=topk))
            assert torch.equal(outs[0], outs[1]), (step, layer.layer_id)
            if relabel:
                staged = int((ess_pool.ess_stage_of_loc >= 0).sum())
                assert staged <= len(REQ) * (K + 1)  # not the requests' 73 tokens
        rt.end_forward()
        if relabel:  # the working sets survived the relabelled step
            assert [rt.cache.sparse.resident(i, REQ[0]) for i in range(L)] == resident
        pos = pos + 1
    for i in range(L):  # every step's own rows reached the host pool
        assert torch.equal(host_rows_by_location(ess_pool, i), stock_pool.kv_buffer[i][:, 0].view(torch.uint8))
