"""The fused LRU step (ess.core.kernels.lru_step) equals the torch reference (ess.core.policy.lru_update) byte for byte: results and
tables (sink columns aside), through Triton's CPU interpreter here and compiled on a GPU; FlashTrans' list gather
equals its torch fallback; a trace replays to the same misses through either kernel."""

import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from ess.core.kernels import flashtrans
from ess.core.kernels import lru_step
from ess.core.kernels.lru_step import lru_update_fused
from ess.core.policy import STAMP_MOD
from ess.core.sparse_pool import SparseMemoryPool

interpreter = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="Triton's CPU interpreter needs Triton >= 3.8")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.fixture
def check(kernel_check):
    return kernel_check(lru_update_fused)


@interpreter
@pytest.mark.parametrize("seed", range(3))
def test_decode_steps_equal_the_reference(seed, check, random_steps):
    rng = random.Random(seed)
    R, K, steps = 3, 8, 14
    ctx = [rng.randint(12, 40) for _ in range(R)]
    C = rng.choice([K + 1, K + 4, 20])
    warm = random_steps(rng, R, 3, K, [c - 3 for c in ctx]) if seed % 2 else ()
    own = lambda t: torch.tensor([c + t for c in ctx])
    check.trace(random_steps(rng, R, steps, K, ctx), C, max(ctx) + steps + 1, own, warm, seed=seed)


@interpreter
def test_adversarial_steps_equal_the_reference(check, adversarial):
    traces, own = adversarial
    for trace in traces:
        check.trace(trace, 7, 60, own)  # capacity exactly K + 1
    # every resident shares a stamp (a warm-up window): ties break by position
    check.trace([[[10, 11, 12, 13]], [[20, 21, 22, 23]]], 5, 40, lambda t: torch.tensor([30 + t]), warm=[[[0, 5, 3, 4]]])


@interpreter
@pytest.mark.parametrize("seed", range(2))
def test_mtp_verify_steps_equal_the_reference(seed, check, mtp_verify_trace):
    """M own tokens per step and the union of M query rows' sets, duplicates included."""
    mtp_verify_trace(check, seed, K=12, C=16, steps=8, ctx_range=(20, 40))


@interpreter
@pytest.mark.parametrize("first_stamp", [STAMP_MOD - 5, 2**31 - 5])
def test_stamps_wrap_like_the_reference(first_stamp, check, random_steps):
    rng = random.Random(5)
    R, K, ctx = 2, 6, [30, 35]
    warm = random_steps(rng, R, 3, K, [c - 4 for c in ctx])
    own = lambda t: torch.tensor([c + t for c in ctx])
    check.trace(random_steps(rng, R, 10, K, ctx), 9, 50, own, warm, first_stamp=first_stamp)


@interpreter
def test_slots_beyond_the_register_block_take_the_chunked_path(monkeypatch, check, random_steps):
    monkeypatch.setattr(lru_step, "REGISTER_SLOTS", 4)  # C = 11 slots in chunks of 4
    rng = random.Random(3)
    ctx = [25, 30]
    own = lambda t: torch.tensor([c + t for c in ctx])
    check.trace(random_steps(rng, 2, 10, 8, ctx), 11, 45, own, warm=random_steps(rng, 2, 2, 8, [20, 24]))


@interpreter
@pytest.mark.parametrize("B,K", [(1, 8), (3, 16), (5, 7)])
def test_list_gather_equals_the_torch_fallback(B, K, monkeypatch):
    monkeypatch.setattr(flashtrans, "LIST_PROGRAMS", 2)  # programs loop over the list
    g = torch.Generator().manual_seed(B)
    host = torch.randint(0, 256, (100, 656), dtype=torch.uint8, generator=g)
    counts = torch.randint(0, K + 1, (B,), dtype=torch.int32, generator=g)
    rows = torch.randint(0, 99, (B, K), dtype=torch.int32, generator=g)
    rows[0, 0], counts[0] = -1, K  # a -1 pair is skipped
    slots = torch.stack([torch.randperm(40, generator=g)[:K] for _ in range(B)]).int() + 40 * torch.arange(B).int().unsqueeze(1)
    got = []
    for backend in ("torch", "interpret"):
        gpu = torch.zeros(40 * B + 1, 656, dtype=torch.uint8)
        flashtrans.gather_lists(host, rows, gpu, slots, counts, backend)
        got.append(gpu[:-1])
    assert torch.equal(*got)
    assert got[0].any()


@interpreter
def test_replay_with_the_fused_kernel_counts_the_same_misses(replay_misses):
    out = replay_misses(("torch", "fused"))
    assert out["torch"] == out["fused"] and np.asarray(out["torch"]).sum() > 0


# -- on a GPU: the compiled kernel, at serving sizes, and under CUDA graph capture ---------------------------------------

def serving_case(B, K, C, ctx, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    max_pos = ctx + 64
    sets = torch.stack([torch.randperm(ctx, generator=g, device=device)[:K] for _ in range(B)]).int()
    return sets, torch.full((B,), ctx, device=device), max_pos


@cuda
@pytest.mark.parametrize("B,C,M", [(1, 2049, 1), (32, 6554, 1), (8, 6147, 3), (4, 20000, 1)])
def test_gpu_kernel_equals_the_reference_at_serving_sizes(B, C, M, check):
    K, ctx = 2048, 32768
    rng = random.Random(B)
    steps = []
    for t in range(6):  # overlapping windows: hits, misses and evictions once the slots fill
        lo = t * 1500
        steps.append([[rng.randrange(lo, lo + 4096) for _ in range(K)] for _ in range(B)])
    if M == 1:
        own = lambda t: torch.full((B,), ctx + t)
    else:
        own = lambda t: torch.stack([torch.full((B,), ctx + M * t + j) for j in range(M)], 1)
    misses = check.trace(steps, C, ctx + M * 6 + 1, own, device="cuda")
    assert int(torch.stack(misses).sum()) > 0


@cuda
@pytest.mark.parametrize("kernel", ["fused", "cuda"])  # the Triton kernel, and sgl-kernel's (test_lru_cuda.py)
def test_gpu_kernel_in_a_cuda_graph_equals_eager(kernel, kernel_check):
    B, K, C, ctx = 16, 2048, 6554, 32768
    tables = [SparseMemoryPool(1, B, C, ctx + 8, "cuda", kernel) for _ in range(2)]
    req = torch.arange(B, device="cuda")
    stamp = torch.zeros((), dtype=torch.int32, device="cuda")
    sets = torch.empty(B, K, dtype=torch.int32, device="cuda")
    own = torch.empty(B, dtype=torch.int64, device="cuda")
    token_table = torch.arange(B * (ctx + 8), dtype=torch.int32, device="cuda").reshape(B, -1)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def fill(t):
        sets.copy_(torch.randint(0, 6000 + 500 * t, (B, K), device="cuda", generator=gen, dtype=torch.int32))
        own.fill_(ctx + t)
        stamp.fill_(t)

    fill(0)
    tables[0].step(0, req, sets, own, stamp, token_table)  # compile outside the capture
    tables[0].reset(req)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tables[0].step(0, req, sets, own, stamp, token_table)
    tables[0].reset(req)
    for t in range(5):
        fill(t)
        graph.replay()
        eager = tables[1].step(0, req, sets, own, stamp, token_table)
        for f in kernel_check.FIELDS + ("miss_row",):
            assert torch.equal(getattr(captured, f), getattr(eager, f)), (t, f)
        for x, y in zip(tables[0].layer_state(0), tables[1].layer_state(0)):
            assert torch.equal(x[:, :-1], y[:, :-1])


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("with_table", [True, False])
def test_serving_step_moves_the_same_rows_with_either_kernel(with_table, device):
    """ServingLatentCache end to end (LRU step, H2D of the misses over the lists, own rows): the GPU pool's rows and
    the tables are the same with the fused kernel as with the torch ops, with or without the token table."""
    from ess.core.serving import ServingLatentCache

    R, K, C, ctx, steps = 2, 8, 12, 40, 6
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (1, R * (ctx + steps) + 1, 656), dtype=torch.uint8, generator=g)
    host = host.pin_memory() if device == "cuda" else host  # FlashTrans reads it through UVA
    table = torch.arange(R * (ctx + steps), dtype=torch.int32, device=device).view(R, -1)  # as req_to_token
    caches = [ServingLatentCache(1, R, C, ctx + steps, host, device, kernel=k) for k in ("torch", "fused")]
    req = torch.arange(R, device=device)
    rng = random.Random(0)
    for t in range(steps):
        sets = torch.tensor([rng.sample(range(ctx + t), K) for _ in range(R)], device=device)
        own = torch.full((R,), ctx + t, device=device)
        own_rows = host[0, table[:, ctx + t].cpu()].to(device)
        results = []
        for sc in caches:
            sc.next_step()
            if with_table:
                results.append(sc.translate(0, req, table, sets, own, own_rows))
            else:
                r = sc.update(0, req, sets, own)
                sc.fetch(0, req, table, r)
                sc.store_own(0, r, own_rows)
                results.append(r)
        a, b = results
        assert torch.equal(a.attn_slot, b.attn_slot) and (b.miss_row is not None) == with_table
        assert torch.equal(caches[0].rows(0, a), caches[1].rows(0, b))
        valid = sets >= 0
        want = host[0, table.gather(1, sets).cpu()].to(device)
        assert torch.equal(caches[1].rows(0, b)[valid], want[valid])  # the right rows


@interpreter
def test_bookkeeping_benchmark_smoke_run(tmp_path):
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, str(root / "benchmark" / "bookkeeping.py"), "--smoke", str(tmp_path)], check=True,
                   env=env, timeout=300, cwd=root)
    doc = json.loads((tmp_path / "bookkeeping.json").read_text())
    assert doc["cases"] and all(r["fused_equals_torch"] for r in doc["cases"])
    if doc["cuda_kernel"] == "built":  # the CUDA kernel in its CPU emulation (g++)
        assert all(r["cuda_equals_torch"] and "cuda_us" in r for r in doc["cases"])
    assert doc["flashtrans_lists"]["exact"] and (tmp_path / "bookkeeping.png").stat().st_size > 0


@interpreter
@pytest.mark.parametrize("bins", [2048, 8])
def test_histogram_select_equals_the_reference(bins, monkeypatch, check, random_steps, adversarial, mtp_verify_trace):
    """SELECT = "histogram": victims by histograms over the key range instead of the bisection (8 bins: many passes),
    in registers and in chunks, decode and verify, ties and wide stamps."""
    monkeypatch.setattr(lru_step, "SELECT", "histogram")
    monkeypatch.setattr(lru_step, "HIST_BINS", bins)
    test_decode_steps_equal_the_reference(1, check, random_steps)
    test_adversarial_steps_equal_the_reference(check, adversarial)
    test_mtp_verify_steps_equal_the_reference(0, check, mtp_verify_trace)
    test_stamps_wrap_like_the_reference(STAMP_MOD - 5, check, random_steps)
    test_slots_beyond_the_register_block_take_the_chunked_path(monkeypatch, check, random_steps)
