import json

import pytest
import torch

from ess.core import layout
from ess.core.settings import DA_ATTN1, DA_ATTN1_KINDS
from ess.cli import main
from ess.reference import flashmla
from ess.reference.layer_setup import build_layer, graph_replay_check, preload, restore
from ess.reference.overlap import MODES, ess_layer_attention
from ess.reference import attention as A
from ess.reference.config import get_config
from ess.reference.tiny import dense, ess_cache, tiny_model, tiny_prompts

ONE_LAYER = get_config("mini", num_layers=1, index_topk=32)
FULL_HEADS = get_config("full", num_layers=1)  # FlashMLA takes 64 or 128 heads


def run_mode(L, snap, mode, step=3, attn1=DA_ATTN1):
    restore(L, snap)
    L.cache.set_step(step)
    o, topk = ess_layer_attention(mode, L.w, L.cfg, L.h, L.q_lora, L.pos, L.index_k, L.cache, 0, attn1=attn1)
    return o, topk, [t.clone() for t in L.state()], L.cache.misses[0][-1]


def test_modes_agree_with_each_other_and_with_a_fully_resident_cache():
    L = build_layer(ONE_LAYER, batch=3, context=300, buffer=48, device="cpu")
    snap = preload(L, misses=10)
    out = {m: run_mode(L, snap, m) for m in MODES}
    o_none, topk, state, misses = out["none"]
    assert torch.equal(misses, torch.full((3,), 10, dtype=torch.int32))
    for m in ("da", "dba"):
        o, t, s, n = out[m]
        assert torch.equal(t, topk) and torch.equal(n, misses)
        assert all(torch.equal(a, b) for a, b in zip(s, state))  # same LRU tables, GPU rows and host rows
        torch.testing.assert_close(o, o_none, rtol=1e-5, atol=1e-5)
    # Fully resident: every selected row read straight from the host pool, which holds every token.
    req = L.cache.req
    rows = torch.stack([L.cache.host.read(0, int(req[b]), topk[b].long().clamp(min=0)) for b in range(3)])
    q_nope_abs, q_pe = A.pre_attn(L.w, L.cfg, L.q_lora, L.pos)
    o_ref, _ = A.sparse_attention(q_nope_abs, q_pe, rows, topk >= 0, L.cfg.softmax_scale)
    assert torch.equal(o_none, o_ref)  # one call over the same bytes: bitwise
    torch.testing.assert_close(out["dba"][0], o_ref, rtol=1e-5, atol=1e-5)
    # The own rows were written to the GPU pool and backed up to the host pool.
    own = A.kv_latent_rows(L.w, L.cfg, L.h, L.pos)
    for b in range(3):
        assert torch.equal(L.cache.host.read(0, int(req[b]), L.pos[b : b + 1])[0], own[b])


@pytest.mark.parametrize("attn1", DA_ATTN1_KINDS)
def test_every_attn1_kind_equals_one_call(attn1):
    """DA / DBA with Attn1 over the compacted miss lists (the kernel's CPU path), fused with the H2D, or as a second
    full-width call: the same tables and rows as mode none, the output within float32 rounding of its one call."""
    L = build_layer(ONE_LAYER, batch=3, context=300, buffer=48, device="cpu")
    snap = preload(L, misses=10)
    o_none, topk, state, misses = run_mode(L, snap, "none")
    for mode in ("da", "dba"):
        o, t, s, n = run_mode(L, snap, mode, attn1=attn1)
        assert torch.equal(t, topk) and torch.equal(n, misses)
        assert all(torch.equal(a, b) for a, b in zip(s, state))  # the fused kernel lands every miss in its slot
        torch.testing.assert_close(o, o_none, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Attn1 kind"):
        run_mode(L, snap, "da", attn1="two")


def test_tokens_identical_in_every_mode_end_to_end():
    base, _ = tiny_model().generate(tiny_prompts(), 10, dense())
    for modes in (["none", "none"], ["da", "da"], ["dba", "dba"], ["dba", "none"]):
        for warmup in (False, True):
            res, cache = tiny_model().generate(tiny_prompts(), 10, ess_cache(warmup), modes=modes)
            assert torch.equal(res.tokens, base.tokens), (modes, warmup)
            assert int(cache.miss_counts().sum()) > 0


def test_demo_overlap_modes_share_one_hash(tmp_path, capsys):
    small = ["demo", "--ess", "--batch", "2", "--context", "96", "--steps", "3", "--layers", "2", "--topk", "16",
             "--ess-buffer-tokens", "24", "--quiet", "--json"]
    hashes = set()
    for mode in MODES:
        assert main(small + ["--overlap", mode]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["tokens_identical"] and doc["ess"]["layer_modes"] == [mode, mode]
        hashes.add(doc["ess"]["tokens_sha256"])
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "ess-layer-plan/1", "num_layers": 2, "modes": ["dba", "da"]}))
    assert main(small + ["--overlap", "plan", "--layer-plan", str(plan)]) == 0
    hashes.add(json.loads(capsys.readouterr().out)["ess"]["tokens_sha256"])
    assert len(hashes) == 1
    plan.write_text(json.dumps({"format": "ess-layer-plan/1", "num_layers": 3, "modes": ["da"] * 3}))
    assert main(small + ["--overlap", "plan", "--layer-plan", str(plan)]) == 2
    assert "plan for 3 layers, the model has 2" in capsys.readouterr().err


def test_attention_ignores_nan_in_masked_rows():
    g = torch.Generator().manual_seed(0)
    rows = layout.quantize_latent(torch.randn(1, 4, 512, generator=g), torch.randn(1, 4, 64, generator=g))
    rows[0, 3] = 0xFF  # 0xFF bytes: NaN in fp8, fp32 and bf16 alike, as an in-flight slot may hold
    valid = torch.tensor([[True, True, True, False]])
    qn, qp = torch.randn(1, 2, 512, generator=g), torch.randn(1, 2, 64, generator=g)
    o, lse = A.sparse_attention(qn, qp, rows, valid, 0.1)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_equals_eager(mode):
    L = build_layer(ONE_LAYER, batch=4, context=300, buffer=48, device="cuda")
    got = graph_replay_check(L, preload(L, misses=10), mode)
    assert got["topk_equal"] and got["state_equal"]
    assert got["max_abs_err"] < 1e-4


@pytest.mark.skipif(not flashmla.available(), reason="needs a CUDA device and the sgl-flash-mla wheel")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_with_flashmla_equals_eager(mode):
    L = build_layer(FULL_HEADS, batch=4, context=2200, buffer=2100, device="cuda")
    got = graph_replay_check(L, preload(L, misses=100), mode, attention="flashmla")
    assert got["topk_equal"] and got["state_equal"]
    assert got["max_abs_err"] < 1e-2  # bf16 output of one kernel, same inputs


def test_overlap_benchmark_smoke_mode(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmark" / "overlap_layer.py"
    spec = importlib.util.spec_from_file_location("overlap_layer", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kinds = [None, *[(mode, k) for mode in ("da", "dba") for k in DA_ATTN1_KINDS]]
    assert [(r["misses_per_request"], r["attn1"] and (r["mode"], r["attn1"])) for r in doc["rows"]][:7] == \
        [(0, k) for k in kinds]
    assert doc["attn1"] == DA_ATTN1 and set(doc["exposed_ms_by_attn1"]) == set(DA_ATTN1_KINDS)
    assert doc["exposed_ms"] == doc["exposed_ms_by_attn1"][DA_ATTN1]
    assert "not a measurement" in doc["device"]
