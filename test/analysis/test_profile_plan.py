import json

import numpy as np
import pytest

from ess.cli import main
from ess.analysis.planning import make_plan
from ess.core.plan import PlanError, load_plan
from ess.analysis.profiling import page_access, profile_traces, similarity
from ess.analysis.sim.profile import synthetic_profile
from ess.analysis.synth import SynthOptions, synth_trace
from ess.core.trace import Trace, load_trace
from ess.reference.lru_oracle import OracleLRU

SMALL = SynthOptions(requests=2, steps=12, layers=3, topk=64, context=2048, window=8, churn_min=2, churn_max=20,
                     pool=256, drift_max=0.1, seed=3)


def hand_trace():
    # 1 request, 1 layer, K = 3, context 6; decode positions 6, 7, 8.
    topk = np.array([[[[6, 0, 1]], [[7, 0, 2]], [[3, 4, 5]]]], dtype=np.int32)  # [R, steps, layers, K]
    pre = np.array([[[[0, 1, -1]], [[0, 1, 5]]]], dtype=np.int32)  # [R, W = 2, layers, K]
    return Trace(topk, np.array([6], dtype=np.int64), pre, {"source": "hand"})


def test_profile_equals_direct_computation_on_a_hand_made_trace():
    tr = hand_trace()
    prof = profile_traces([("hand", tr)], buffer_tokens=[4, 5])
    for b, row in zip(prof["buffer_tokens"], prof["mean_misses"]):
        lru = OracleLRU(b)
        for w, s in enumerate(tr.prefill_topk[0, :, 0].tolist()):
            lru.step(s, -1, w - 2)
        misses = [lru.step(tr.topk[0, t, 0].tolist(), 6 + t, t) for t in range(3)]
        assert row == [pytest.approx(np.mean(misses), abs=1e-4)]  # the profile keeps 4 decimals
    # |T1 & T0| / |T1| = |{7,0,2} & {6,0,1}| / 3 = 1/3; |T2 & T1| / |T2| = 0.
    assert prof["similarity"] == [pytest.approx((1 / 3 + 0) / 2, abs=1e-5)]
    assert prof["misses_by_step"]["cold"][0] == 2.0  # 0 and 1: an empty buffer; 6 is the own token
    assert prof["misses_by_step"]["warmup"][0] == 0.0


def test_page_access_ranks_pages_coldest_first():
    """Two requests, one layer, pages of 64 positions: request 0 reads page 0 only, request 1 pages 0 and 1 alike."""
    ctx = np.array([256, 256], dtype=np.int64)  # 256 + 2 steps: 5 pages each
    topk = np.array([[[[0, 1, 2, -1]], [[3, 4, 5, 6]]],
                     [[[0, 64, 1, 65]], [[2, 66, 3, 67]]]], dtype=np.int32)
    curve = page_access(Trace(topk, ctx), shares=[0.0, 0.6, 0.8, 1.0])
    # request 0: 4 of 5 pages unread; request 1: 3 of 5 unread, then page 0 or 1 with half the accesses
    assert curve["access_share"] == [0.0, pytest.approx(0.0), pytest.approx((0 + 0.5) / 2), 1.0]


def test_similarity_ignores_padding():
    t = np.array([[[[1, 2, -1, -1]], [[2, 3, -1, -1]]]], dtype=np.int32)
    assert similarity(Trace(t, np.array([4], dtype=np.int64))) == pytest.approx([0.5])


def test_synthetic_trace_structure():
    tr = synth_trace(SMALL).validate()
    assert tr.topk.shape == (2, 12, 3, 64) and tr.prefill_topk.shape == (2, 32, 3, 64)
    assert "NOT a measurement" in tr.meta["source"]
    prof = profile_traces([("s", tr)], ratios=[0.05, 0.1, 0.3])
    means = [np.mean(m) for m in prof["mean_misses"]]
    assert means[0] > means[1] > means[2]  # fewer misses at a higher ratio
    cold, warm = prof["misses_by_step"]["cold"], prof["misses_by_step"]["warmup"]
    assert cold[0] > 5 * warm[0]  # warm-up removes the spike at the start of decode
    assert len(set(np.round(prof["mean_misses"][1], 3))) == 3  # layers differ


def test_plan_moves_from_da_to_dba_as_misses_and_context_grow():
    base = synthetic_profile(62)
    order = {"none": 0, "da": 1, "dba": 2}

    def modes(scale: float, context: int, ratio: float = 0.2) -> list[int]:
        prof = dict(base, mean_misses=(np.asarray(base["mean_misses"]) * scale).tolist())
        return [order[m] for m in make_plan(prof, "H200", context, 96, sparse_ratio=ratio)["modes"]]

    by_misses = [modes(s, 32768) for s in (0.01, 0.3, 1.0, 3.0, 4.5)]  # (4.5: up to 6,126 of 6,144 a step selects)
    for a, b in zip(by_misses, by_misses[1:]):
        assert all(x <= y for x, y in zip(a, b))
    assert sum(by_misses[0]) < sum(by_misses[-1]) and 2 in by_misses[-1]
    by_context = [modes(3.0, c, 0.3) for c in (8192, 32768, 131072)]  # (0.2 of 8192 is below top-k + 1)
    for a, b in zip(by_context, by_context[1:]):
        assert all(x <= y for x, y in zip(a, b))
    assert sum(by_context[0]) < sum(by_context[-1])


def test_plan_cli_and_bad_files(tmp_path, capsys):
    prof_path = tmp_path / "p.json"
    prof_path.write_text(json.dumps(synthetic_profile(61)))
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(prof_path), "--hardware", "H200", "--context", "32768", "--batch-size", "128",
                 "--out", str(out), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_layers"] == 62 and len(plan["exposed_transfer_us"]) == 62
    assert plan["predicted"]["exposed_transfer_ms"] <= plan["predicted"]["serial_swap_in_exposed_ms"]
    assert load_plan(out, 61, mtp_layer=True) == plan["modes"]
    with pytest.raises(PlanError, match="plan for 62 layers, the model has 61"):
        load_plan(out, 61)
    with pytest.raises(PlanError, match="plan for 62 layers, the model has 4"):
        load_plan(out, 4)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "ess-layer-plan/1", "num_layers": 2, "modes": ["da", "fast"]}')
    with pytest.raises(PlanError, match="modes"):
        load_plan(bad)
    ten = dict(synthetic_profile(10))
    prof_path.write_text(json.dumps(ten))
    assert main(["plan", "--profile", str(prof_path), "--context", "32768", "--batch-size", "128"]) == 2
    assert "profile has 10 layers; dsv32 has 61" in capsys.readouterr().err


def test_trace_record_synth_and_profile_cli(tmp_path, capsys):
    rec = tmp_path / "rec.npz"
    assert main(["trace", "record", "--out", str(rec), "--batch", "2", "--context", "96", "--steps", "3", "--layers", "2",
                 "--topk", "16", "--quiet"]) == 0
    tr = load_trace(rec)
    assert tr.topk.shape == (2, 3, 2, 16) and tr.prefill_topk.shape == (2, 32, 2, 16)
    syn = tmp_path / "syn.npz"
    assert main(["trace", "synth", "--out", str(syn), "--requests", "1", "--steps", "4", "--layers", "2", "--topk", "64",
                 "--context", "1024", "--window", "8", "--churn-min", "2", "--churn-max", "10", "--pool", "128"]) == 0
    plots = tmp_path / "plots"
    assert main(["profile", str(syn), str(rec), "--ratios", "0.1,0.3", "--plot", str(plots), "--json", "--quiet"]) == 2
    assert "layers" in capsys.readouterr().err  # the two traces differ in layers and top-k
    assert main(["profile", str(syn), "--ratios", "0.1,0.3", "--plot", str(plots), "--json", "--quiet"]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["num_layers"] == 2 and len(prof["mean_misses"]) == 2
    assert sorted(p.name for p in plots.iterdir()) == ["misses_by_step.png", "misses_per_layer.png", "similarity.png"]


def test_a_real_traces_profile_rescaled_for_the_simulator(tmp_path, capsys):
    """`ess profile --for-model dsv32`: a 3-layer, top-32 trace of another model becomes a 61-layer, top-2048
    profile (layers by depth, misses x 64) that `ess sim` takes, its source saying what it is."""
    opt = SynthOptions(requests=1, steps=6, layers=3, topk=32, context=400, warmup_windows=4, sinks=2, window=6,
                       churn_min=2, churn_max=10, pool=60)
    tr = synth_trace(opt)
    tr.meta = {"source": "a pretrained model", "model": "smollm2-135m", "texts": [{"path": "x"}]}
    path = tmp_path / "real.npz"
    from ess.core.trace import save_trace

    save_trace(path, tr)
    out = tmp_path / "p.json"
    assert main(["profile", str(path), "--ratios", "0.1,0.2", "--for-model", "dsv32", "--out", str(out), "--quiet",
                 "--json"]) == 0
    capsys.readouterr()
    p = json.loads(out.read_text())
    assert p["num_layers"] == 61 and p["topk"] == 2048 and p["trace_kind"] == "real"
    assert p["source"].startswith("REAL trace rescaled for dsv32 (3 layers -> 61 by depth, misses x 64")
    plain = profile_traces([("real", tr)], [0.1, 0.2])
    assert p["mean_misses"][0][0] == round(plain["mean_misses"][0][0] * 64, 4)
    assert p["mean_misses"][0][-1] == round(plain["mean_misses"][0][-1] * 64, 4)
    assert main(["sim", "run", "--profile", str(out), "--sparse-ratio", "0.2", "--batch-size", "8", "--json"]) == 0
