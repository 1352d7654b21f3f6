import dataclasses
import math

import pytest
import torch

from ess.core import layout
from ess.reference import attention as A
from ess.reference.config import FULL, from_hf, get_config
from ess.reference.tiny import TINY, dense, tiny_model, tiny_prompts


def test_full_config_is_deepseek_v32():
    assert (FULL.num_layers, FULL.num_heads, FULL.index_heads, FULL.index_topk) == (61, 128, 64, 2048)
    assert FULL.latent_bytes(1) == 61 * 656 and FULL.index_k_bytes(1) == 61 * 132
    with pytest.raises(ValueError, match="kv_lora_rank"):
        get_config("mini", kv_lora_rank=256)
    with pytest.raises(ValueError, match="--config"):
        get_config("huge")


def brute_topk(scores, pos, k):
    out = []
    for row, p in zip(scores.tolist(), pos.tolist()):
        cand = sorted(((-row[t], t) for t in range(min(p + 1, len(row)))))[:k]
        sel = [t for _, t in cand]
        out.append(sel + [-1] * (k - len(sel)))
    return torch.tensor(out, dtype=torch.int32)


def test_topk_equals_brute_force_with_ties_and_short_contexts():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (8, 40), generator=g).float()  # many ties
    pos = torch.tensor([0, 3, 9, 15, 20, 30, 39, 39])
    assert torch.equal(A.select_topk(scores, pos, 12), brute_topk(scores, pos, 12))


def test_index_scores_formula():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 128, generator=g)
    w = torch.randn(2, 3, generator=g)
    k_rows = layout.quantize_index_k(torch.randn(2, 5, 128, generator=g))
    k = layout.dequantize_index_k(k_rows)
    expect = torch.zeros(2, 5)
    for n in range(2):
        for t in range(5):
            expect[n, t] = sum(w[n, h] * max(0.0, float(q[n, h] @ k[n, t])) for h in range(3))
    torch.testing.assert_close(A.index_scores(q, w, k_rows), expect, rtol=1e-5, atol=1e-5)


def test_sparse_attention_equals_dense_softmax_over_selected_rows():
    g = torch.Generator().manual_seed(3)
    N, H, K = 2, 3, 6
    rows = layout.quantize_latent(torch.randn(N, K, 512, generator=g), torch.randn(N, K, 64, generator=g))
    valid = torch.tensor([[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    qn, qp = torch.randn(N, H, 512, generator=g), torch.randn(N, H, 64, generator=g)
    o, lse = A.sparse_attention(qn, qp, rows, valid, 0.1)
    c, r = layout.dequantize_latent(rows)
    for n in range(N):
        sel = valid[n].nonzero().flatten()
        s = (qn[n] @ c[n, sel].T + qp[n] @ r[n, sel].T) * 0.1
        torch.testing.assert_close(o[n], torch.softmax(s, -1) @ c[n, sel], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[n], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    # A row outside the selection does not matter.
    rows2 = rows.clone()
    rows2[0, 2] = 7
    assert torch.equal(A.sparse_attention(qn, qp, rows2, valid, 0.1)[0], o)


def test_merge_of_empty_part_is_exact():
    o = torch.randn(2, 3, 512)
    lse = torch.randn(2, 3)
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, -math.inf)
    m, l = A.merge_attention(o, lse, empty_o, empty_lse)
    assert torch.equal(m, o) and torch.equal(l, lse)


def test_decode_never_selects_future_positions_and_is_deterministic():
    prompts = tiny_prompts()
    r1, _ = tiny_model().generate(prompts, 5, dense())
    r2, _ = tiny_model().generate(prompts, 5, dense())
    assert torch.equal(r1.tokens, r2.tokens) and r1.tokens_sha256 == r2.tokens_sha256
    assert r1.tokens.shape == (3, 6)
    own = r1.context_len[:, None, None, None] + torch.arange(5)[None, :, None, None]
    t = r1.decode_topk
    assert t.shape == (3, 5, TINY.num_layers, TINY.index_topk)
    assert torch.all(t <= own) and torch.all(t >= -1)
    # Distinct entries, the own position usually among them.
    for row in t.reshape(-1, TINY.index_topk).tolist():
        v = [x for x in row if x >= 0]
        assert len(v) == len(set(v))
    # Warm-up sets are prefill positions only.
    assert torch.all(r1.prefill_topk < r1.context_len[:, None, None, None])


def test_prefill_topk_is_causal():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(50, 2, 128, generator=g)
    w = torch.rand(50, 2, generator=g)
    k_rows = layout.quantize_index_k(torch.randn(50, 128, generator=g))
    topk = A.prefill_topk(q, w, k_rows, 8, chunk=16)
    assert torch.all(topk <= torch.arange(50).unsqueeze(1))
    assert torch.all(topk[0, 1:] == -1) and topk[0, 0] == 0
    scores = A.index_scores(q, w, k_rows.unsqueeze(0).expand(50, -1, -1))
    assert torch.equal(topk, brute_topk(scores, torch.arange(50), 8))


def test_yarn_rotary_table_against_closed_form_values():
    # DeepSeek-V3.2: rope dim 64, base 1e4, original 4096 positions, factor 40, beta 32 / 1. The correction range is
    # floor(64 ln(4096 / (32 * 2 pi)) / (2 ln 1e4)) = 10 to ceil(64 ln(4096 / (2 pi)) / (2 ln 1e4)) = 23.
    assert FULL.yarn and not get_config("mini").yarn and get_config("mini", original_seq_len=4096).yarn
    f = A.rope_freqs(FULL, torch.device("cpu")).double()
    base = 1e4 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ramp = ((torch.arange(32, dtype=torch.float64) - 10) / 13).clamp(0, 1)
    torch.testing.assert_close(f, base / 40 * ramp + base * (1 - ramp), rtol=1e-6, atol=0)
    torch.testing.assert_close(f[:11], base[:11], rtol=1e-6, atol=0)  # fast dimensions kept
    torch.testing.assert_close(f[23:], base[23:] / 40, rtol=1e-6, atol=0)  # slow ones stretched 40 times
    assert f[16] == pytest.approx(float(base[16]) * (1 - 6 / 13 * 39 / 40), rel=1e-6)
    off = A.rope_freqs(get_config("mini"), torch.device("cpu")).double()
    torch.testing.assert_close(off, base, rtol=1e-6, atol=0)  # no YaRN: the plain table


def test_softmax_scale_carries_yarn_mscale_squared():
    assert FULL.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert get_config("mini").softmax_scale == pytest.approx(128**-0.5)
    assert get_config("full", mscale=0.5).softmax_scale == pytest.approx(192**-0.5 * (0.05 * math.log(40) + 1) ** 2)
    with pytest.raises(ValueError, match="YaRN"):
        get_config("full", rope_factor=0.5)


def test_hugging_face_config_maps_to_the_full_model():
    hf = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
          "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64,
          "index_head_dim": 128, "index_topk": 2048, "vocab_size": 129280, "intermediate_size": 18432,
          "max_position_embeddings": 163840, "rope_theta": 10000,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"}}
    assert from_hf(hf, name="full") == FULL
    plain = from_hf({k: v for k, v in hf.items() if k != "rope_scaling"})
    assert not plain.yarn
    with pytest.raises(ValueError, match="hidden_size"):
        from_hf({k: v for k, v in hf.items() if k != "hidden_size"})


def test_index_k_norm_uses_eps_1e6_and_its_bias():
    cfg = get_config("mini")
    g = torch.Generator().manual_seed(4)
    w = A.AttentionWeights.random(cfg, g)
    # small key activations (variance about 1e-6): eps 1e-5 and 1e-6 give different keys
    x = torch.randn(8, cfg.hidden, generator=g) * 2e-3 / torch.linalg.matrix_norm(w.idx_wk, ord=2)
    k = x @ w.idx_wk.T
    ours = torch.nn.functional.layer_norm(k, (128,), w.idx_k_norm, w.idx_k_norm_bias, 1e-6)
    torch_default = torch.nn.functional.layer_norm(k, (128,), w.idx_k_norm, w.idx_k_norm_bias, 1e-5)
    assert float((ours - torch_default).abs().max()) > 0.1
    pos = torch.arange(8)
    freqs = A.rope_freqs(cfg, torch.device("cpu"))
    pe, nope = ours.split([64, 64], -1)
    expected = layout.quantize_index_k(A.hadamard(torch.cat([A.rope(pe, pos, freqs, interleaved=False), nope], -1)))
    assert torch.equal(A.index_key_rows(w, cfg, x, pos), expected)
    # the bias moves the keys, and with them the index scores
    biased = dataclasses.replace(w, idx_k_norm_bias=torch.randn(128, generator=g))
    assert not torch.equal(A.index_key_rows(biased, cfg, x, pos), expected)
    q, weights = A.index_query(w, cfg, x, A.q_lora_of(w, x), pos)
    scores = A.index_scores(q, weights, expected.expand(8, -1, -1))
    assert not torch.equal(A.index_scores(q, weights, A.index_key_rows(biased, cfg, x, pos).expand(8, -1, -1)), scores)
