"""ess.core.kernels.miss_attention: DA's Attn1 over the compacted miss lists and the fused copy-attend equal the reference split
attention's miss part, and Attn0 + Attn1 merged equals attention over every entry: the torch path exactly as
ess.core.dsa_math computes it, the Triton kernel through Triton's CPU interpreter (float32 there, so within float32
summation order) and compiled on a GPU (bf16 products, as FlashMLA)."""

import math

import pytest
import torch

from ess.core import dsa_math, layout
from ess.core.kernels import flashtrans
from ess.core.kernels import miss_attention as MA
from ess.core.policy import lru_update

interpreter = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="Triton's CPU interpreter needs Triton >= 3.8")
SCALE = 0.07


def _rows(g, n):
    return layout.quantize_latent(torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g))


def _case(seed=0, N=3, H=5, K=12, rows=64):
    """A pool, each query row's K distinct entries (a few -1), which of them hit, and the misses compacted left."""
    g = torch.Generator().manual_seed(seed)
    pool = _rows(g, rows)
    idx = torch.stack([torch.randperm(rows, generator=g)[:K] for _ in range(N)]).int()
    idx[0, -3:] = -1
    hit = (torch.rand(idx.shape, generator=g) < 0.5) & (idx >= 0)
    hit[1] = idx[1] >= 0  # a row without misses
    hit[2] = False  # a row without hits
    miss = (idx >= 0) & ~hit
    order = torch.sort((~miss).int(), dim=1, stable=True).indices  # misses first, in entry order
    slots = torch.where(torch.gather(miss, 1, order), torch.gather(idx, 1, order), -1).int()
    counts = miss.sum(1).int()
    qn, qp = torch.randn(N, H, 512, generator=g), torch.randn(N, H, 64, generator=g)
    return qn, qp, pool, idx, hit, slots, counts


def _reference_part(qn, qp, pool, idx, valid):
    return dsa_math.sparse_attention(qn, qp, pool[idx.long().clamp(min=0)], valid, SCALE)


def test_torch_path_is_the_reference_miss_part_and_merges_to_full_attention():
    qn, qp, pool, idx, hit, slots, counts = _case()
    o1, lse1 = MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="torch")
    o_ref, lse_ref = _reference_part(qn, qp, pool, idx, (idx >= 0) & ~hit)
    torch.testing.assert_close(o1, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse1, lse_ref, rtol=1e-5, atol=1e-5)
    assert bool((lse1[1] == -math.inf).all()) and not o1[1].any()  # no misses: empty
    o0, lse0 = _reference_part(qn, qp, pool, idx, hit)
    o, lse = MA.merge(o0, lse0, o1, lse1)
    o_full, lse_full = _reference_part(qn, qp, pool, idx, idx >= 0)
    torch.testing.assert_close(o, o_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_full, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("block_n", [4, 16])
def test_kernel_in_interpreter_equals_the_torch_path(block_n):
    qn, qp, pool, idx, hit, slots, counts = _case(1)
    slots[0, 1] = -1  # a listed entry without a slot is skipped, as in the torch path
    got = MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="interpret", block_n=block_n)
    want = MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="torch")
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert bool((got[1][1] == -math.inf).all()) and not got[0][1].any()


@interpreter
def test_kernel_ignores_everything_past_the_count():
    qn, qp, pool, idx, hit, slots, counts = _case(2)
    poisoned = pool.clone()
    listed = torch.zeros(pool.shape[0], dtype=torch.bool)
    for n in range(slots.shape[0]):
        listed[slots[n, : counts[n]].long()] = True
    poisoned[~listed] = 0x7F  # NaN bytes in every row no listed entry names
    stale = torch.where(slots >= 0, slots, torch.tensor(0, dtype=torch.int32))  # the tail names real (poisoned) rows
    got = MA.miss_attention(qn, qp, poisoned, stale, counts, SCALE, backend="interpret", block_n=4)
    want = MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="torch")
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_copy_attend_lands_the_rows_and_attends_to_them(backend):
    qn, qp, host, idx, hit, host_rows, counts = _case(3, H=20)  # 20 heads: two head blocks in one program
    g = torch.Generator().manual_seed(4)
    gpu = _rows(g, 80)
    slots = torch.where(host_rows >= 0, torch.randperm(79, generator=g)[: host_rows.numel()].view(host_rows.shape).int(), -1)
    slots[0, -1] = 5  # past the count: not copied
    want_gpu = gpu.clone()
    flashtrans.gather_lists(host, host_rows, want_gpu, slots, counts, "torch")
    o, lse = MA.copy_attend(qn, qp, host, host_rows, gpu, slots, counts, SCALE, backend=backend, block_n=4)
    assert torch.equal(gpu[:-1], want_gpu[:-1])  # byte for byte FlashTrans' list gather (the torch one's sink row aside)
    o_ref, lse_ref = _reference_part(qn, qp, host, idx, (idx >= 0) & ~hit)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)


@interpreter
def test_split_over_a_real_lru_step_equals_one_call():
    """The LRU step's own lists: Attn0 over the hits (misses set to -1, as FlashMLA is called), the misses fetched and
    attended by copy_attend from their compacted list and device count, merged = attention over every entry."""
    g = torch.Generator().manual_seed(5)
    B, K, C, P, H = 2, 8, 12, 40, 3
    slot_pos = torch.full((B, C + 1), -1, dtype=torch.int32)
    slot_stamp = torch.zeros(B, C + 1, dtype=torch.int32)
    pos_slot = torch.full((B, P + 1), -1, dtype=torch.int32)
    host = _rows(g, B * P + 1)  # request b's position p at host row b * P + p
    gpu = torch.zeros(B * C + 1, 656, dtype=torch.uint8)
    req = torch.arange(B)
    for t in range(3):
        sets = torch.stack([torch.randperm(30, generator=g)[:K] for _ in range(B)]).int()
        own = torch.full((B,), 30 + t, dtype=torch.int32)
        r = lru_update(slot_pos, slot_stamp, pos_slot, req, sets, own, t)
        rows = torch.where(r.miss_pos >= 0, req.unsqueeze(1).int() * P + r.miss_pos, -1)
        qn, qp = torch.randn(B, H, 512, generator=g), torch.randn(B, H, 64, generator=g)
        gpu[r.own_slot.long()] = host[req * P + own.long()]  # the own rows, as store_own puts them
        attn0_idx = torch.where(r.hit, r.attn_slot, -1)
        o0, lse0 = _reference_part(qn, qp, gpu, attn0_idx, attn0_idx >= 0)
        o1, lse1 = MA.copy_attend(qn, qp, host, rows, gpu, r.miss_slot, r.n_miss, SCALE, backend="interpret")
        o, lse = MA.merge(o0, lse0, o1, lse1)
        truth = req.unsqueeze(1) * P + sets.long()
        o_full, lse_full = _reference_part(qn, qp, host, truth, sets >= 0)
        torch.testing.assert_close(o, o_full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, lse_full, rtol=1e-5, atol=1e-5)
        assert int(r.n_miss.sum()) > 0


def test_merge_takes_flashmla_empty_rows_as_empty():
    o = torch.randn(2, 3, 512)
    lse = torch.randn(2, 3)
    empty_o = torch.full_like(o, float("nan"))
    got_o, got_lse = MA.merge(empty_o, torch.full_like(lse, math.inf), o, lse)
    assert torch.equal(got_o, o) and torch.equal(got_lse, lse)
    got_o, got_lse = MA.merge(o, lse, torch.zeros_like(o), torch.full_like(lse, -math.inf))
    assert torch.equal(got_o, o) and torch.equal(got_lse, lse)


def merge_case(device="cpu"):
    """FlashMLA-shaped parts ([B, 1, H, 512] bf16 and [B, H, 1] float32, read as views) with every kind of lse: both
    parts finite, one empty (-inf, or FlashMLA's +inf over a NaN o), both empty."""
    g = torch.Generator().manual_seed(7)
    B, H = 3, 16
    o0 = torch.randn(B, 1, H, 512, generator=g).to(torch.bfloat16)
    lse0 = torch.randn(B, H, 1, generator=g) * 4
    o1 = torch.randn(B, H, 512, generator=g)
    lse1 = torch.randn(B, H, generator=g) * 4
    lse0[0, :4, 0] = math.inf
    o0[0, 0, :4] = float("nan")
    lse1[1, 2:6] = -math.inf
    lse0[2, 5, 0], lse1[2, 5] = -math.inf, -math.inf
    return [x.to(device) for x in (o0[:, 0], lse0[:, :, 0], o1, lse1)]


@pytest.mark.parametrize("backend", [
    pytest.param("interpret", marks=interpreter),
    pytest.param("triton", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_merge_kernel_equals_the_torch_merge(backend):
    parts = merge_case("cuda" if backend == "triton" else "cpu")
    o, lse = MA.merge(*parts, backend=backend)
    want_o, want_lse = MA.merge(*[x.cpu() for x in parts], backend="torch")
    assert o.dtype == lse.dtype == torch.float32 and torch.isfinite(o).all()
    torch.testing.assert_close(o.cpu(), want_o, rtol=1e-6, atol=1e-6)  # float32 exp / log of two libraries
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse))  # both empty: -inf, as the torch merge
    o16, lse16 = MA.merge(*parts, backend=backend, out_dtype=torch.bfloat16)  # the serving path's: written as bf16
    assert o16.dtype == torch.bfloat16 and torch.equal(lse16, lse)
    torch.testing.assert_close(o16.cpu(), want_o.to(torch.bfloat16), rtol=0.01, atol=0.01)
    with pytest.raises(ValueError, match="lse0"):
        MA.merge(parts[0], parts[1][:1], parts[2], parts[3], backend=backend)
    with pytest.raises(ValueError, match="power-of-two last dimension"):
        MA.merge(parts[0][..., :500], parts[1], parts[2][..., :500], parts[3], backend=backend)


def test_bad_inputs_are_refused_naming_the_argument():
    qn, qp, pool, idx, hit, slots, counts = _case()
    with pytest.raises(ValueError, match="q_nope"):
        MA.miss_attention(qn[..., :64], qp, pool, slots, counts, SCALE)
    with pytest.raises(ValueError, match="q_pe"):
        MA.miss_attention(qn, qp[:2], pool, slots, counts, SCALE)
    with pytest.raises(ValueError, match="slots"):
        MA.miss_attention(qn, qp, pool, slots.float(), counts, SCALE)
    with pytest.raises(ValueError, match="counts"):
        MA.miss_attention(qn, qp, pool, slots, counts[:2], SCALE)
    with pytest.raises(ValueError, match="pool"):
        MA.miss_attention(qn, qp, pool[:, :600], slots, counts, SCALE)
    with pytest.raises(ValueError, match="backend"):
        MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="cuda")
    with pytest.raises(ValueError, match="'triton' needs CUDA"):
        MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="triton")
    with pytest.raises(ValueError, match="gpu_slots"):
        MA.copy_attend(qn, qp, pool, slots, pool, slots[:, :3], counts, SCALE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_equals_the_interpreted_function_within_bf16():
    """Compiled: bf16 products as FlashMLA's, so within bf16 rounding of the float32 torch path."""
    qn, qp, pool, idx, hit, slots, counts = (t.cuda() for t in _case(6, N=4, H=128, K=300, rows=1024))
    o, lse = MA.miss_attention(qn, qp, pool, slots, counts, SCALE)
    o_ref, lse_ref = MA.miss_attention(qn, qp, pool, slots, counts, SCALE, backend="torch")
    live = torch.isfinite(lse_ref)
    assert float((o - o_ref).norm() / o_ref.norm()) < 1e-2
    assert float((lse - lse_ref)[live].abs().max()) < 1e-2 and bool((lse[~live] == -math.inf).all())
    host = pool.cpu().pin_memory()
    gpu = torch.zeros(2048, 656, dtype=torch.uint8, device="cuda")
    dst = torch.where(slots >= 0, torch.randperm(2047, device="cuda")[: slots.numel()].view(slots.shape).int(), -1)
    want = gpu.clone()
    flashtrans.gather_lists(host, slots, want, dst, counts)
    o2, lse2 = MA.copy_attend(qn, qp, host, slots, gpu, dst, counts, SCALE)
    torch.cuda.synchronize()
    assert torch.equal(gpu, want)
    assert float((o2 - o).norm() / o.norm()) < 1e-6 and torch.equal(torch.isfinite(lse2), live)
