"""ess.reference.flashmla: the sparse decode over a pool by indices, its split, and FlashMLA against the reference (GPU)."""

import pytest
import torch

from ess.reference import flashmla
from ess.core import layout
from ess.reference import attention as A


def _case(seed=0, N=3, H=4, K=40, rows=128):
    g = torch.Generator().manual_seed(seed)
    pool = layout.quantize_latent(torch.randn(rows, 512, generator=g), torch.randn(rows, 64, generator=g))
    idx = torch.stack([torch.randperm(rows, generator=g)[:K] for _ in range(N)])
    idx[0, -7:] = -1
    qn, qp = torch.randn(N, H, 512, generator=g), torch.randn(N, H, 64, generator=g)
    return qn, qp, pool, idx


def test_reference_reads_the_indexed_rows_and_skips_minus_one():
    qn, qp, pool, idx = _case()
    o, lse = flashmla.sparse_decode(qn, qp, pool, idx, 0.05, backend="reference")
    o_ref, lse_ref = A.sparse_attention(qn, qp, pool[idx.clamp(min=0)], idx >= 0, 0.05)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    unused = torch.ones(pool.shape[0], dtype=torch.bool)
    unused[idx[idx >= 0]] = False
    poisoned = pool.clone()
    poisoned[unused] = 0xFF  # NaN bytes in every row that no valid entry names (-1 entries included)
    o2, _ = flashmla.sparse_decode(qn, qp, poisoned, idx, 0.05, backend="reference")
    assert torch.equal(o2, o)


def test_split_equals_one_call():
    qn, qp, pool, idx = _case(1)
    hit = torch.rand(idx.shape, generator=torch.Generator().manual_seed(2)) < 0.6
    hit[1] = True  # a row with no misses
    hit[2] = False  # a row with no hits
    waited = []
    o, lse = flashmla.split_decode(qn, qp, pool, idx, hit, 0.05, lambda: waited.append(1), backend="reference")
    o_ref, lse_ref = flashmla.sparse_decode(qn, qp, pool, idx, 0.05, backend="reference")
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    assert waited == [1]


def test_bad_backend_and_pool_are_refused():
    qn, qp, pool, idx = _case()
    with pytest.raises(ValueError, match="attention backend"):
        flashmla.sparse_decode(qn, qp, pool, idx, 0.05, backend="flash")
    with pytest.raises(ValueError, match="uint8"):
        flashmla.sparse_decode(qn, qp, pool.float(), idx, 0.05)
    if not flashmla.available():
        with pytest.raises(RuntimeError, match="sgl-flash-mla"):
            flashmla.sparse_decode(qn, qp, pool, idx, 0.05, backend="flashmla")


@pytest.mark.skipif(not flashmla.available(), reason="needs a CUDA device and the sgl-flash-mla wheel")
def test_flashmla_matches_the_reference_and_reads_any_pool_by_index():
    qn, qp, pool, idx = (t.cuda() for t in _case(3, N=4, H=128, K=2048, rows=8192))
    o, lse = flashmla.sparse_decode(qn, qp, pool, idx, 576**-0.5, backend="flashmla")
    o_ref, lse_ref = flashmla.sparse_decode(qn, qp, pool, idx, 576**-0.5, backend="reference")
    assert float((o - o_ref).norm() / o_ref.norm()) < 1e-2  # bf16 query and output
    assert float((lse - lse_ref).abs().max()) < 1e-2  # natural log, as the reference
    # the same rows at other places of another pool, the indices moved with them: bit for bit the same result
    perm = torch.randperm(8192, device="cuda")
    moved = torch.empty_like(pool)
    moved[perm] = pool
    o2, lse2 = flashmla.sparse_decode(qn, qp, moved, torch.where(idx >= 0, perm[idx.clamp(min=0)], -1), 576**-0.5)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    hit = torch.rand(idx.shape, device="cuda") < 0.7
    o3, _ = flashmla.split_decode(qn, qp, pool, idx, hit, 576**-0.5)
    assert float((o3 - o).norm() / o.norm()) < 1e-2
    # a row with no valid entry: the kernel returns lse = +inf there; ess.reference.flashmla's contract is o = 0, lse = -inf
    idx[1] = -1
    o4, lse4 = flashmla.sparse_decode(qn, qp, pool, idx, 576**-0.5)
    assert torch.equal(o4[1], torch.zeros_like(o4[1])) and bool((lse4[1] == -torch.inf).all())
    assert torch.equal(o4[0], o[0])


@pytest.mark.skipif(not flashmla.available(), reason="needs a CUDA device and the sgl-flash-mla wheel")
def test_attn0_on_flashmla_and_the_miss_kernel_merge_to_one_flashmla_call():
    """DA as issue 33 builds it: Attn0 = FlashMLA over the top-k with the misses set to -1, Attn1 = ess.core's miss
    kernel over each row's compacted misses (and the same fused with their H2D from a pinned host pool), merged by
    log-sum-exp: within FlashMLA's own error against the float32 reference of one call over every entry."""
    from ess.core.kernels import flashtrans
    from ess.core.kernels import miss_attention as MA

    qn, qp, pool, idx = (t.cuda() for t in _case(4, N=8, H=128, K=2048, rows=8192))
    scale = 576**-0.5
    o_one, _ = flashmla.sparse_decode(qn, qp, pool, idx, scale, backend="flashmla")
    o_ref, lse_ref = flashmla.sparse_decode(qn, qp, pool, idx, scale, backend="reference")
    own_err = float((o_one - o_ref).norm() / o_ref.norm())
    rank = torch.cumsum((idx >= 0).int(), 1) - 1
    for m in (0, 1, 256, 2047):
        miss = (idx >= 0) & (rank < m)
        order = torch.sort((~miss).int(), dim=1, stable=True).indices
        lists = torch.where(torch.gather(miss, 1, order), torch.gather(idx, 1, order), -1).int()
        counts = miss.sum(1).int()
        o0, lse0 = flashmla.sparse_decode(qn, qp, pool, torch.where(miss, -1, idx), scale, backend="flashmla")
        o, lse = MA.merge(o0, lse0, *MA.miss_attention(qn, qp, pool, lists, counts, scale))
        err = float((o - o_ref).norm() / o_ref.norm())
        assert err < max(2 * own_err, 5e-3), (m, err, own_err)
        assert float((lse - lse_ref).abs().max()) < 1e-2
        host = pool.cpu().pin_memory()
        landed = torch.zeros_like(pool)
        o1f = MA.copy_attend(qn, qp, host, lists, landed, lists, counts, scale)
        want = torch.zeros_like(pool)
        flashtrans.gather_lists(host, lists, want, lists, counts)
        torch.cuda.synchronize()
        assert torch.equal(landed, want)
        of, _ = MA.merge(o0, lse0, *o1f)
        assert float((of - o).norm() / o.norm()) < 1e-6
