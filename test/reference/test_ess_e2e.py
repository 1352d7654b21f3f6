import numpy as np
import pytest
import torch

from ess.core import layout
from ess.reference import attention as A
from ess.analysis.replay import replay_misses
from ess.reference.flashmla import split_decode
from ess.core.trace import Trace
from ess.reference.tiny import BUFFER, TINY, dense, ess_cache, tiny_model, tiny_prompts

STEPS = 12


@pytest.fixture(scope="module")
def baseline():
    return tiny_model().generate(tiny_prompts(), STEPS, dense())[0]


@pytest.mark.parametrize("warmup", [False, True])
def test_ess_tokens_equal_baseline_and_replay_agrees(baseline, warmup):
    res, cache = tiny_model().generate(tiny_prompts(), STEPS, ess_cache(warmup))
    assert torch.equal(res.tokens, baseline.tokens)
    live = cache.miss_counts().numpy()
    assert live.sum() > 0
    # `ess cache replay` runs the same policy code on the recorded trace: the same misses, step by step.
    trace = Trace(res.decode_topk.numpy(), res.context_len.numpy(), res.prefill_topk.numpy())
    assert np.array_equal(replay_misses(trace.validate(), BUFFER, warmup=warmup), live)
    # all layers at once (the default here) or one layer at a time: rows of the tables are independent
    assert np.array_equal(replay_misses(trace, BUFFER, warmup=warmup, table_bytes=1), live)


def test_warmup_cuts_the_first_step_misses(baseline):
    _, cold = tiny_model().generate(tiny_prompts(), 2, ess_cache(False, buffer=64))
    _, warm = tiny_model().generate(tiny_prompts(), 2, ess_cache(True, buffer=64))
    assert warm.miss_counts()[:, 0].sum() < cold.miss_counts()[:, 0].sum()


def split_over_rows(qn, qp, rows, valid, hit, scale):
    """ess.reference.flashmla.split_decode over gathered rows [N, K, 656]: the rows as a pool, entry k of row n at n * K + k."""
    N, K = valid.shape
    idx = torch.where(valid, torch.arange(N * K).reshape(N, K), -1)
    return split_decode(qn, qp, rows.reshape(N * K, -1), idx, hit, scale, backend="reference")[0]


def test_split_attention_equals_unsplit_and_fully_resident(baseline):
    base_out, ess_out, unsplit_out = [], [], []
    scale = TINY.softmax_scale

    def record_base(layer, qn, qp, dr):
        o, _ = A.sparse_attention(qn, qp, dr.rows, dr.valid, scale)
        base_out.append(o)
        return o

    def record_split(layer, qn, qp, dr):
        unsplit_out.append(A.sparse_attention(qn, qp, dr.rows, dr.valid, scale)[0])
        o = split_over_rows(qn, qp, dr.rows, dr.valid, dr.hit, scale)
        ess_out.append(o)
        return o

    model = tiny_model()
    b, _ = model.generate(tiny_prompts(), STEPS, dense(), attend=record_base)
    s, cache = model.generate(tiny_prompts(), STEPS, ess_cache(True), attend=record_split)
    assert torch.equal(s.tokens, b.tokens)
    assert int(cache.miss_counts().sum()) > 0
    for o_base, o_split, o_unsplit in zip(base_out, ess_out, unsplit_out):
        torch.testing.assert_close(o_split, o_unsplit, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o_split, o_base, rtol=1e-4, atol=1e-4)


def test_split_attention_op_level():
    g = torch.Generator().manual_seed(5)
    N, H, K = 3, 4, 10
    rows = layout.quantize_latent(torch.randn(N, K, 512, generator=g), torch.randn(N, K, 64, generator=g))
    valid = torch.rand(N, K, generator=g) > 0.2
    valid[:, 0] = True
    hit = torch.rand(N, K, generator=g) > 0.5
    hit[0] = True  # a row with no misses
    hit[1] = False  # a row with no hits
    qn, qp = torch.randn(N, H, 512, generator=g), torch.randn(N, H, 64, generator=g)
    full, _ = A.sparse_attention(qn, qp, rows, valid, 0.05)
    split = split_over_rows(qn, qp, rows, valid, hit, 0.05)
    torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-5)
