"""The decode indexer kernel (ess.core.kernels.indexer) equals the reference math (ess.core.dsa_math's index_scores and
select_topk): scores within fp32 summation error, through Triton's CPU interpreter here and compiled on a GPU, for
per-request rows and for a row table read through locations; the top-k exactly, tie rule included.

Tolerance: the kernel and the reference sum the same terms in different orders (q . k over D = 128, then over the H
heads), so each is within (D + H) * 2^-24 * M of the exact score, M = sum_h |w_h| * sum_d |q_hd * k_d| (the standard
bound for a recursive sum; the FP8 values are exact in fp32 and the ue8m0 scales are powers of two). The tests use
TOL * M with TOL = 1e-6, 16 times tighter than the difference of two such sums can be in the worst case
(2 * (D + H + 1) * 2^-24 = 1.6e-5 at H = 8); the largest difference seen through the interpreter was 6.4e-9 * M.
Integer-valued cases sum exactly in any order and are compared bit for bit, top-k included."""

import math

import pytest
import torch

from ess.core import dsa_math, layout
from ess.core.kernels import flashtrans, indexer, topk_split
from ess.core.kernels.indexer import (SELECTS, indexer_keys_fp8, indexer_scores_fp8, indexer_scores_pages,
                                    indexer_scores_ragged, indexer_topk_fp8, score_keys, topk_from_keys)

interpreter = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="Triton's CPU interpreter needs Triton >= 3.8")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
D = layout.INDEX_DIM
TOL = 1e-6


def random_case(N, H, T, seed, q_dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, D, generator=g).to(q_dtype)
    w = torch.randn(N, H, generator=g)
    rows = layout.quantize_index_k(torch.randn(N, T, D, generator=g) * 2)
    return q.to(device), w.to(device), rows.to(device)


def integer_rows(vals: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Index-K rows holding small integers (exact in FP8) times power-of-two scales: every score is an exact fp32
    integer multiple of a power of two whatever the summation order."""
    out = torch.empty(*vals.shape[:-1], layout.INDEX_ROW_BYTES, dtype=torch.uint8)
    out[..., :D] = vals.float().to(layout.FP8).view(torch.uint8)
    out[..., D:] = scales.float().contiguous().view(torch.uint8).reshape(*vals.shape[:-1], 4)
    return out


def integer_case(N, H, T, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (N, H, D), generator=g).float()
    w = torch.randint(-2, 3, (N, H), generator=g).float()
    scales = 2.0 ** torch.randint(-1, 2, (N, T), generator=g)
    return q, w, integer_rows(torch.randint(-4, 5, (N, T, D), generator=g), scales)


def reference(q, w, rows, pos, loc=None):
    """The reference scores, -inf beyond pos and where a location is -1; and M, the summation-error scale."""
    picked = rows[loc.clamp(min=0).long()] if loc is not None else rows
    scores = dsa_math.index_scores(q.float(), w.float(), picked)
    k = layout.dequantize_index_k(picked)
    magnitude = torch.einsum("nh,nht->nt", w.float().abs(), torch.einsum("nhd,ntd->nht", q.float().abs(), k.abs()))
    keep = torch.arange(scores.shape[1]) <= pos.unsqueeze(1)
    if loc is not None:
        keep &= loc >= 0
    return torch.where(keep, scores, -math.inf), magnitude


def assert_close_scores(got, want, magnitude, tol=TOL):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same -inf positions
    finite = torch.isfinite(want)
    err = (got - want)[finite].abs()
    assert bool((err <= tol * magnitude[finite]).all()), float((err / magnitude[finite].clamp_min(1e-30)).max())


def table_layout(rows, seed, missing=((0, 7), (2, 1))):
    """The same rows as a shuffled flat table [S, 132] plus locations [N, T] (a strided view of a wider token table),
    some set to -1."""
    N, T, _ = rows.shape
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(N * T + 5, generator=g)  # 5 rows nobody owns
    table = torch.randint(0, 256, (N * T + 5, layout.INDEX_ROW_BYTES), dtype=torch.uint8, generator=g)
    table[perm[: N * T]] = rows.reshape(N * T, -1)
    token_table = torch.full((N, T + 9), -1, dtype=torch.int32)
    token_table[:, :T] = perm[: N * T].view(N, T).int()
    loc = token_table[:, :T]
    for n, t in missing:
        loc[n, t] = -1
    return table, loc


@interpreter
@pytest.mark.parametrize("H,T,q_dtype", [(4, 300, torch.float32), (8, 200, torch.bfloat16), (6, 257, torch.float16),
                                         (64, 130, torch.bfloat16)])  # the last: DeepSeek-V3.2's 64 heads
def test_scores_equal_the_reference_per_request(H, T, q_dtype):
    q, w, rows = random_case(3, H, T, seed=H)
    pos = torch.tensor([T + 10, T // 2, 0])  # beyond the rows, mid-block, only the first position
    got = indexer_scores_fp8(q, w, rows, pos, backend="interpret")
    assert_close_scores(got, *reference(q, w, rows, pos))
    assert torch.isinf(got[2, 1:]).all() and torch.isfinite(got[0]).all()


@interpreter
@pytest.mark.parametrize("q_dtype,loc_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_scores_equal_the_reference_through_locations(q_dtype, loc_dtype):
    q, w, rows = random_case(3, 8, 230, seed=1, q_dtype=q_dtype)
    table, loc = table_layout(rows, seed=1)
    loc = loc.to(loc_dtype)  # int32: the strided view itself (to() returns it unchanged)
    pos = torch.tensor([229, 140, 100])
    got = indexer_scores_fp8(q, w, table, pos, loc=loc, backend="interpret")
    assert_close_scores(got, *reference(q, w, table, pos, loc))
    assert got[0, 7] == -math.inf and got[2, 1] == -math.inf  # the -1 locations


@interpreter
def test_rows_may_be_a_strided_view():
    q, w, rows = random_case(3, 4, 260, seed=2)
    wide = torch.zeros(3, 300, layout.INDEX_ROW_BYTES, dtype=torch.uint8)
    wide[:, :260] = rows
    pos = torch.tensor([259, 259, 200])
    got = indexer_scores_fp8(q, w, wide[:, :260], pos, backend="interpret")  # request stride 300 rows, not 260
    assert torch.equal(got, indexer_scores_fp8(q, w, rows, pos, backend="interpret"))


@interpreter
@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("paged", [False, True])
def test_topk_equals_select_topk_on_exact_scores(paged, select):
    q, w, rows = integer_case(3, 8, 290, seed=3)
    pos = torch.tensor([289, 150, 20])
    table, loc = table_layout(rows, seed=3) if paged else (rows, None)
    want, _ = reference(q, w, table, pos, loc)
    scores = indexer_scores_fp8(q, w, table, pos, loc=loc, backend="interpret")
    assert torch.equal(scores, want)  # integer-valued: exact in any summation order
    finite = want[0][torch.isfinite(want[0])]
    assert finite.unique().numel() < finite.numel()  # the data has ties for the rule to break
    for k in (1, 16, 40):  # k = 40 > request 2's 21 positions: -1 padding
        got = indexer_topk_fp8(q, w, table, pos, k, loc=loc, backend="interpret", select=select)
        assert got.dtype == torch.int32 and torch.equal(got, dsa_math.select_topk(want, pos, k)), k


def page_layout(rows, seed, missing=(1, 2)):
    """The same rows in SGLang's index-K pages [S, 64 * 132], shuffled among pages nobody owns, and a page table
    [N, P + 1] (one column past each request's reach; page `missing[1]` of request `missing[0]` set to -1)."""
    N, T, _ = rows.shape
    P = -(-T // layout.INDEX_PAGE_TOKENS)
    g = torch.Generator().manual_seed(seed)
    S = N * P + 3
    pool = layout.quantize_index_k(torch.randn(S * layout.INDEX_PAGE_TOKENS, layout.INDEX_DIM, generator=g))
    perm = torch.randperm(S, generator=g)[: N * P].view(N, P)
    for n in range(N):
        for p in range(P):
            part = rows[n, p * layout.INDEX_PAGE_TOKENS : (p + 1) * layout.INDEX_PAGE_TOKENS]
            at = int(perm[n, p]) * layout.INDEX_PAGE_TOKENS
            pool[at : at + part.shape[0]] = part
    table = torch.full((N, P + 1), -1, dtype=torch.int32)
    table[:, :P] = perm.int()
    table[missing] = -1
    return layout.index_k_rows_to_pages(pool), table


@interpreter
def test_scores_over_sglangs_pages_equal_the_reference():
    """indexer_scores_pages reads SGLang's own index-K pages (rows, then scales, a page) through its page table:
    the reference's scores, exactly on integer-valued data, -inf in a missing page and beyond the table."""
    q, w, rows = integer_case(3, 8, 200, seed=9)  # 200 positions: 4 pages, the last partly filled
    pos = torch.tensor([199, 150, 63])
    pages, table = page_layout(rows, seed=9)
    want, whole = reference(q, w, rows, pos)[0], reference(q, w, rows, pos + 500)[0]
    want[1, 128:192] = whole[1, 128:192] = -math.inf  # request 1's page 2 is missing
    for backend in ("interpret", "torch"):
        got = indexer_scores_pages(q, w, pages, pos, table, backend=backend)
        assert got.shape == (3, 5 * 64) and torch.equal(got[:, :200], want), backend
        assert bool((got[:, 200:] == -math.inf).all())
        # positions past pos and the width past the 4-page table: scored up to the table's reach (256), then -inf
        wide = indexer_scores_pages(q, w, pages, pos + 500, table[:, :4], width=300, backend=backend)
        assert wide.shape == (3, 300) and torch.equal(wide[:, :200], whole), backend
        assert bool(torch.isfinite(wide[[0, 2], 200:256]).all()) and bool((wide[:, 256:] == -math.inf).all())
    for bad, name in ((dict(pages=pages[:, :100]), "pages"), (dict(page_table=table.float()), "page_table"),
                      (dict(page_table=table + 100), "page_table"), (dict(width=-1), "width")):
        with pytest.raises(ValueError, match=name):
            indexer_scores_pages(**(dict(q=q, w=w, pages=pages, pos=pos, page_table=table) | bad))


@interpreter
def test_ragged_scores_over_one_table_equal_the_reference():
    """indexer_scores_ragged (prefill: each query row over its window [start, end) of the batch's one key table):
    the reference's scores inside each window, exactly on integer-valued data, -inf outside it and past the table."""
    q, w, rows = integer_case(4, 8, 300, seed=13)
    keys = rows[0]  # one table of 300 rows for every query row
    starts, ends = torch.tensor([0, 100, 130, 299]), torch.tensor([300, 230, 131, 300])
    full = reference(q, w, keys.expand(4, -1, -1), torch.full((4,), 299))[0]
    t = torch.arange(300)
    want = full.masked_fill((t < starts[:, None]) | (t >= ends[:, None]), -math.inf)
    for backend in ("interpret", "torch"):
        got = indexer_scores_ragged(q, w, keys, starts, ends, backend=backend)
        assert torch.equal(got, want), backend
        wide = indexer_scores_ragged(q, w, keys, starts, ends, width=304, backend=backend)
        assert wide.shape == (4, 304) and torch.equal(wide[:, :300], want) and bool((wide[:, 300:] == -math.inf).all())
    with pytest.raises(ValueError, match="starts"):
        indexer_scores_ragged(q, w, keys, starts.float(), ends)


@interpreter
@pytest.mark.parametrize("paged,span", [(False, 1), (True, 1), (False, 3)])
def test_the_fused_first_histogram_is_the_split_selects_pass_0(paged, span, monkeypatch):
    """select="fused": the scores kernel counts pass 0 of ess.core.kernels.topk_split as it scores (-inf beyond pos and at
    missing rows counted nowhere), a program's blocks together (SPAN); the counts equal the split select's own pass 0
    over the same scores, and the fused top-k is select_topk's."""
    monkeypatch.setattr(indexer, "SPAN", span)
    q, w, rows = integer_case(3, 8, 290, seed=7)
    pos = torch.tensor([289, 150, 20])
    table, loc = table_layout(rows, seed=7) if paged else (rows, None)
    work = topk_split.new_work(3, "cpu")
    scores = indexer_scores_fp8(q, w, table, pos, loc=loc, backend="interpret", work=work)
    own = topk_split.new_work(3, "cpu")
    topk_split.split_keys(scores, pos, 16, interpret=True, work=own)
    assert torch.equal(work[:, :256], own[:, :256]) and bool((work[:, 256:] == 0).all())
    assert torch.equal(work[:, :256].sum(1), torch.isfinite(scores).sum(1).int())
    got = indexer_topk_fp8(q, w, table, pos, 16, loc=loc, backend="interpret", select="fused")
    assert torch.equal(got, dsa_math.select_topk(scores, pos, 16))
    with pytest.raises(ValueError, match="work"):
        indexer_scores_fp8(q, w, table, pos, loc=loc, backend="interpret", work=work[:2])


@interpreter
@pytest.mark.parametrize("block_t,loads,span", [(16, "bytes", 1), (64, "bytes", 1), (256, "bytes", 1), (16, "words", 1),
                                              (128, "words", 1), (16, "bytes", 4), (64, "words", 3)])
@pytest.mark.parametrize("paged", [False, True])
def test_every_launch_configuration_gives_the_same_keys(block_t, loads, span, paged):
    """benchmark/indexer_kernels.py sweeps the kernel's block of positions and how it loads the rows (bytes, or 4-byte
    words unpacked in registers): each gives the reference's keys, bit for bit on integer-valued scores, and the torch
    backend's keys are score_keys of the reference."""
    q, w, rows = integer_case(3, 8, 300, seed=5)
    pos = torch.tensor([299, 40, 150])
    table, loc = table_layout(rows, seed=5) if paged else (rows, None)
    want = score_keys(reference(q, w, table, pos, loc)[0])
    got = indexer_keys_fp8(q, w, table, pos, loc=loc, backend="interpret", block_t=block_t, loads=loads, span=span)
    assert torch.equal(got, want)
    assert torch.equal(indexer_keys_fp8(q, w, table, pos, loc=loc, backend="torch"), want)
    with pytest.raises(ValueError, match="loads"):
        indexer_keys_fp8(q, w, table, pos, loc=loc, backend="interpret", loads="halves")


@interpreter
def test_topk_equals_select_topk_on_random_scores_with_a_gap():
    q, w, rows = random_case(3, 8, 300, seed=4, q_dtype=torch.bfloat16)
    pos = torch.tensor([299, 255, 64])
    want, magnitude = reference(q, w, rows, pos)
    k = 32
    for n in range(3):  # the precondition: no two of the best k + 1 scores within the tolerance of each other
        top = torch.sort(want[n], descending=True)
        gaps = (top.values[:k] - top.values[1 : k + 1]).abs()
        assert bool((gaps > 2 * TOL * magnitude[n].max()).all())
    got = indexer_topk_fp8(q, w, rows, pos, k, backend="interpret")
    assert torch.equal(got, dsa_math.select_topk(want, pos, k))


@interpreter
@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("paged", [False, True])
def test_ties_go_to_the_lower_position(paged, select):
    """Exact ties: one key repeated at several positions, and all-zero scores (ReLU of negative dots)."""
    N, H, T = 2, 16, 140  # no padded heads: request 1's zeros are sums of -0.0 (w * ReLU = -1 * +0.0), which a
    # reduction may return as -0.0 or +0.0 (the interpreter's gives +0.0); either ties with +0.0
    q = torch.ones(N, H, D)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0] * 4).repeat(2, 1)
    w[1] *= -1  # request 1: every score <= 0
    vals = -torch.ones(N, T, D)  # dot -128 per head: score 0
    for t in (9, 30, 31, 77, 133):
        vals[:, t] = 2  # the same best key at five positions
    vals[:, 50] = 1  # the runner-up
    rows = integer_rows(vals, torch.ones(N, T))
    pos = torch.tensor([139, 139])
    table, loc = table_layout(rows, seed=5, missing=()) if paged else (rows, None)
    got = indexer_topk_fp8(q, w, table, pos, 8, loc=loc, backend="interpret", select=select)
    assert got[0].tolist() == [9, 30, 31, 77, 133, 50, 0, 1]
    zeros = [t for t in range(T) if t not in (9, 30, 31, 50, 77, 133)]
    assert got[1].tolist() == zeros[:8]  # the positive dots score below zero here
    assert torch.equal(got, dsa_math.select_topk(reference(q, w, table, pos, loc)[0], pos, 8))


def test_score_keys_rank_as_select_topk():
    """The packed int64 keys (what the kernel writes for the top-k) rank exactly as select_topk: ties, -0.0 against
    +0.0, -inf, positions beyond pos and k beyond T. Plain torch: no Triton needed."""
    g = torch.Generator().manual_seed(6)
    scores = torch.randint(-5, 6, (4, 50), generator=g).float() * 0.25
    scores[0, 3], scores[0, 10], scores[0, 20] = -0.0, 0.0, -0.0
    scores[1, ::3] = -math.inf
    scores[2] = torch.randn(50, generator=g) * 1e30
    scores[3, :] = 0.0
    scores[3, 1::2] = -0.0
    pos = torch.tensor([49, 30, 49, 12])
    masked = torch.where(torch.arange(50) <= pos.unsqueeze(1), scores, -math.inf)
    for k in (1, 7, 25, 64):
        assert torch.equal(topk_from_keys(score_keys(masked), k), dsa_math.select_topk(scores, pos, k)), k


def test_torch_backend_is_the_reference():
    q, w, rows = random_case(2, 4, 70, seed=7)
    pos = torch.tensor([69, 30])
    want, _ = reference(q, w, rows, pos)
    assert torch.equal(indexer_scores_fp8(q, w, rows, pos, backend="torch"), want)
    assert torch.equal(indexer_topk_fp8(q, w, rows, pos, 10), dsa_math.select_topk(want, pos, 10))  # auto: torch


@interpreter
@pytest.mark.parametrize("select", SELECTS)
def test_empty_inputs(select):
    q, w, rows = random_case(2, 4, 0, seed=8)
    pos = torch.tensor([5, 0])
    assert indexer_scores_fp8(q, w, rows, pos, backend="interpret").shape == (2, 0)
    assert indexer_topk_fp8(q, w, rows, pos, 3, backend="interpret", select=select).tolist() == [[-1] * 3] * 2


def bad_inputs():
    q, w, rows = random_case(2, 4, 10, seed=9)
    pos = torch.tensor([9, 9])
    loc = torch.zeros(2, 10, dtype=torch.int32)
    flat = rows.reshape(20, -1)
    odd = torch.zeros(2 * 10 * 132 + 1, dtype=torch.uint8)[1:].view(2, 10, 132)  # scales not 4-byte aligned
    ok = dict(q=q, w=w, rows=rows, pos=pos)
    return [
        ("q", dict(ok, q=q[..., :64])),
        ("q", dict(ok, q=q.double())),
        ("w", dict(ok, w=w[:, :3])),
        ("w", dict(ok, w=w.long())),
        ("rows", dict(ok, rows=rows.float())),
        ("rows", dict(ok, rows=rows[..., :128])),
        ("rows", dict(ok, rows=rows[:1])),
        ("rows", dict(ok, rows=odd)),
        ("rows", dict(ok, loc=loc)),  # a location map needs the flat [S, 132] table
        ("pos", dict(ok, pos=pos.float())),
        ("pos", dict(ok, pos=pos[:1])),
        ("loc", dict(ok, rows=flat, loc=loc.float())),
        ("loc", dict(ok, rows=flat, loc=loc[:1])),
        ("loc", dict(ok, rows=flat, loc=loc + 20)),  # beyond the table
        ("loc", dict(ok, rows=flat, loc=loc - 2)),
        ("k", dict(ok, k=0)),
        ("select", dict(ok, select="heap")),
        ("backend", dict(ok, backend="cuda")),
        ("backend", dict(ok, backend="triton")),  # CPU tensors
    ]


@pytest.mark.parametrize("name,kwargs", bad_inputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused_naming_the_argument(name, kwargs):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        indexer_topk_fp8(**{"k": 4, **kwargs})
    if name not in ("k", "select"):
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            indexer_scores_fp8(**kwargs)


# -- on a GPU: the compiled kernel (tl.dot on the tensor cores for bf16 queries) at DeepSeek-V3.2's head shape -----
# Not run yet (no GPU where this was written). The tensor cores' fp32 accumulation is not specified to round as IEEE
# adds do, so the tolerance is the worst-case summation bound itself, 2 * (D + H + 1) * 2^-24 at H = 64.
GPU_TOL = 2 * (D + 64 + 1) * 2.0**-24

@cuda
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_kernel_equals_the_reference(paged):
    q, w, rows = random_case(4, 64, 3000, seed=10)
    pos = torch.tensor([2999, 2048, 700, 5])
    table, loc = table_layout(rows, seed=10) if paged else (rows, None)
    dev = lambda x: None if x is None else x.cuda()
    for q_dtype in (torch.float32, torch.bfloat16):
        qq = q.to(q_dtype)
        want, magnitude = reference(qq, w, table, pos, loc)
        got = indexer_scores_fp8(qq.cuda(), w.cuda(), table.cuda(), pos.cuda(), loc=dev(loc)).cpu()
        assert_close_scores(got, want, magnitude, GPU_TOL)


@cuda
def test_gpu_kernel_over_sglangs_pages_equals_the_reference():
    q, w, rows = random_case(4, 64, 3000, seed=12, q_dtype=torch.bfloat16)
    pos = torch.tensor([2999, 2048, 700, 5])
    pages, table = page_layout(rows, seed=12)
    want, magnitude = reference(q, w, rows, pos)
    want[1, 128:192] = -math.inf  # request 1's page 2 is missing
    got = indexer_scores_pages(q.cuda(), w.cuda(), pages.cuda(), pos.cuda(), table.cuda()).cpu()
    assert_close_scores(got[:, :3000], want, magnitude, GPU_TOL)
    assert bool((got[:, 3000:] == -math.inf).all())


@cuda
@pytest.mark.parametrize("select", SELECTS)
def test_gpu_topk_equals_select_topk_at_k_2048(select):
    q, w, rows = integer_case(4, 64, 6000, seed=11)
    pos = torch.tensor([5999, 4000, 2100, 1000])  # the last request has fewer than k positions
    want, _ = reference(q, w, rows, pos)
    q = q.bfloat16()  # small integers: exact in bf16
    got = indexer_topk_fp8(q.cuda(), w.cuda(), rows.cuda(), pos.cuda(), 2048, select=select).cpu()
    assert torch.equal(got, dsa_math.select_topk(want, pos, 2048))
