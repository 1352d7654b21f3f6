"""Residency's step glue (ess.core.kernels.residency_map): the Triton kernels (in Triton's CPU interpreter) equal the torch
reference, and the reference maps as docs/design.md says."""

import pytest
import torch

from ess.core.kernels import flashtrans
from ess.core.kernels import residency_map as RM
from ess.core.policy import PolicyResult

interpreter = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="Triton's CPU interpreter needs Triton >= 3.8")
R, C = 9, 16  # request slots, LRU slots per offloaded request


def case(seed=0, B=5, KK=40, M=None, pos_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    req = torch.randperm(R, generator=g)[:B].to(torch.int32)
    topk = torch.randint(-1, 300, (B, KK), generator=g).to(pos_dtype)
    own = torch.randint(-1, 300, (B,) if M is None else (B, M), generator=g).to(torch.int64)
    start32 = (torch.arange(R) * 1000 + 7).to(torch.int32)
    is_res = torch.rand(R, generator=g) < 0.5
    virt = lambda shape: torch.where(torch.rand(shape, generator=g) < 0.3, -1,  # noqa: E731
                                     req.long().view(-1, *[1] * (len(shape) - 1)) * C
                                     + torch.randint(0, C, shape, generator=g)).to(torch.int32)
    r = PolicyResult(attn_slot=virt((B, KK)), hit=torch.rand(B, KK, generator=g) < 0.5,
                     miss_pos=torch.randint(-1, 300, (B, KK), generator=g).to(torch.int32), miss_slot=virt((B, KK)),
                     own_slot=virt(tuple(own.shape)), n_miss=torch.randint(0, KK, (B,), generator=g).to(torch.int32),
                     n_set=torch.randint(0, KK, (B,), generator=g).to(torch.int32))
    none, zero = torch.full((B, KK), -1, dtype=torch.int32), torch.zeros(B, dtype=torch.int32)
    return req, topk, own, start32, is_res, r, none, zero


def same(a: PolicyResult, b: PolicyResult):
    for f in ("attn_slot", "hit", "miss_pos", "miss_slot", "own_slot", "n_miss", "n_set"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f


def test_the_reference_maps_resident_and_offloaded_rows():
    req, topk, own, start32, is_res, r, none, zero = case()
    got = RM.map_result(r, req, topk, own, start32, is_res, C, none, zero, "torch")
    for b in range(req.shape[0]):
        s, q = int(start32[req[b]]), int(req[b])
        for k in range(topk.shape[1]):
            t, v = int(topk[b, k]), int(r.attn_slot[b, k])
            want = (s + t if t >= 0 else -1) if is_res[q] else (s + v - q * C if v >= 0 else -1)
            assert int(got.attn_slot[b, k]) == want
        assert int(got.n_set[b]) == (0 if is_res[q] else int(r.n_set[b]))
    masked_topk, masked_own = RM.premask(req, topk, own, is_res, "torch")
    res = is_res[req.long()]
    assert (masked_topk[res] == -1).all() and torch.equal(masked_topk[~res], topk[~res])
    assert (masked_own[res] == -1).all() and torch.equal(masked_own[~res], own[~res])


@interpreter
@pytest.mark.parametrize("M", [None, 3])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_the_kernels_equal_the_reference(M, pos_dtype):
    req, topk, own, start32, is_res, r, none, zero = case(seed=1, KK=RM.BLOCK + 37, M=M, pos_dtype=pos_dtype)
    for lru in (r, None):
        same(RM.map_result(lru, req, topk, own, start32, is_res, C, none, zero, "interpret"),
             RM.map_result(lru, req, topk, own, start32, is_res, C, none, zero, "torch"))
    for a, b in zip(RM.premask(req, topk, own, is_res, "interpret"), RM.premask(req, topk, own, is_res, "torch")):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_bad_backend_is_named():
    req, topk, own, start32, is_res, r, none, zero = case()
    with pytest.raises(ValueError, match="region map: backend"):
        RM.premask(req, topk, own, is_res, "cuda")
