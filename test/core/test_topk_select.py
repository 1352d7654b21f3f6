"""The radix selects, one program a request (ess.core.kernels.topk_select) and split across programs (ess.core.kernels.topk_split),
against select_topk, their oracle: the same positions in the same order, on scores built to break them (ties, -0.0
against +0.0, -inf, keys equal in their high digits, k at and beyond the candidates, positions beyond pos), in Triton's
CPU interpreter; on a GPU, the compiled kernels at k = 2048."""

import math

import pytest
import torch

from ess.core import dsa_math
from ess.core.kernels import flashtrans
from ess.core.kernels.topk_select import PAD_KEY, positions_from_keys, radix_keys, radix_topk
from ess.core.kernels.topk_split import new_work, split_keys, split_topk

interpreter = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8's interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or flashtrans.triton is None, reason="needs a CUDA GPU")


def hard_scores(N: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-6, 7, (N, T), generator=g).float() * 0.25  # few values: long runs of ties
    s[0] = torch.randn(T, generator=g)  # no ties
    if N > 2:
        s[2] = 1.0 + torch.randint(0, 4, (T,), generator=g).float() * 2.0**-20  # equal in every digit but the last
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    s[torch.rand(N, T, generator=g) < 0.1] = -math.inf
    return s


@interpreter
@pytest.mark.parametrize("T,block", [(1, 16), (300, 64), (1000, 256), (2500, 1024)])
def test_radix_select_is_select_topk(T, block):
    s = hard_scores(4, T, seed=T)
    pos = torch.tensor([T - 1, T // 2, T + 7, 0])  # the whole row, half of it, beyond it, only position 0
    for k in sorted({1, 3, 64, T // 3 + 1, T, T + 5}):
        want = dsa_math.select_topk(s, pos, k)
        got = positions_from_keys(radix_keys(s, pos, k, interpret=True, block=block))
        assert torch.equal(got, want), (T, block, k)
        assert torch.equal(radix_topk(s, pos, k, backend="interpret"), want)


@interpreter
@pytest.mark.parametrize("T,chunk,block", [(1, 16, 16), (300, 64, 32), (1000, 256, 64), (2500, 1024, 256)])
def test_split_select_is_select_topk(T, chunk, block):
    """Several programs a request (chunk < T), and one (chunk >= T)."""
    s = hard_scores(4, T, seed=T)
    pos = torch.tensor([T - 1, T // 2, T + 7, 0])
    for k in sorted({1, 3, 64, T // 3 + 1, T, T + 5}):
        want = dsa_math.select_topk(s, pos, k)
        got = positions_from_keys(split_keys(s, pos, k, interpret=True, chunk=chunk, block=block))
        assert torch.equal(got, want), (T, chunk, k)
    assert torch.equal(split_topk(s, pos, 64, backend="interpret"), dsa_math.select_topk(s, pos, 64))


@interpreter
def test_split_select_refines_by_position_only_for_ties_at_the_kth_score():
    """Distinct scores settle in the high word: the position passes (4..7) count nothing. Tied ones need them."""
    s = hard_scores(4, 300, seed=5)
    pos = torch.full((4,), 299)
    for row, ties in ((0, False), (1, True)):  # row 0: no ties; row 1: few values, long runs of ties
        top = torch.sort(s[row], descending=True).values
        k = 40 if not ties else next(i for i in range(20, 300) if top[i - 1] == top[i])  # the k-th score runs on
        work = new_work(1, "cpu")
        split_keys(s[row : row + 1], pos[:1], k, interpret=True, work=work, chunk=64, block=32)
        position_counts = work[0, 4 * 256 : 8 * 256].sum().item()
        assert (position_counts > 0) == ties


@interpreter
@pytest.mark.parametrize("select", ["radix", "split"])
def test_every_score_equal_and_every_score_minus_inf(select):
    s = torch.zeros(3, 200)
    s[1, ::2] = -0.0
    s[2] = -math.inf
    pos = torch.tensor([199, 199, 199])
    got = (radix_topk if select == "radix" else split_topk)(s, pos, 16, backend="interpret")
    assert got[0].tolist() == got[1].tolist() == list(range(16)) and got[2].tolist() == [-1] * 16
    assert torch.equal(got, dsa_math.select_topk(s, pos, 16))


@interpreter
def test_the_kernel_fills_exactly_the_chosen_slots():
    s = hard_scores(2, 100, seed=1)
    pos = torch.tensor([99, 10])
    keys = radix_keys(s, pos, 40, interpret=True)
    chosen = (dsa_math.select_topk(s, pos, 40) >= 0).sum(1)
    assert ((keys != PAD_KEY).sum(1) == chosen).all()
    for row, n in zip(keys, chosen.tolist()):  # the filled slots first, in position order
        assert bool((row[n:] == PAD_KEY).all())
        positions = 0xFFFFFFFF - (row[:n] & 0xFFFFFFFF)
        assert bool((positions[1:] > positions[:-1]).all())


@pytest.mark.parametrize("topk", [radix_topk, split_topk])
def test_torch_backend_is_select_topk_and_bad_input_is_refused(topk):
    s = hard_scores(2, 50, seed=2)
    pos = torch.tensor([49, 20])
    assert torch.equal(topk(s, pos, 5), dsa_math.select_topk(s, pos, 5))  # auto on a CPU: torch
    for kwargs, name in [({"scores": s.double()}, "scores"), ({"scores": s[0]}, "scores"), ({"pos": pos.float()}, "pos"),
                         ({"pos": pos[:1]}, "pos"), ({"k": 0}, "k"), ({"k": True}, "k"), ({"backend": "cuda"}, "backend"),
                         ({"backend": "triton"}, "backend")]:
        with pytest.raises(ValueError, match=name):
            topk(**({"scores": s, "pos": pos, "k": 5} | kwargs))


@cuda
@pytest.mark.parametrize("topk", [radix_topk, split_topk])
def test_gpu_radix_select_is_select_topk_at_k_2048(topk):
    s = hard_scores(6, 40000, seed=3)
    pos = torch.tensor([39999, 30000, 2047, 1000, 40010, 0])
    got = topk(s.cuda(), pos.cuda(), 2048).cpu()
    assert torch.equal(got, dsa_math.select_topk(s, pos, 2048))
