"""ESS's LRU as a stack policy (ess.analysis.lru_curve) and `ess trace synth --like` (ess.analysis.synth_fit)."""

import json
import pathlib

import numpy as np
import pytest

from ess.analysis.lru_curve import lru_ranks, misses_at
from ess.analysis.replay import replay_counts
from ess.analysis.synth import SynthOptions, synth_trace
from ess.analysis.synth_fit import fit_like, load_fitted, scaled
from ess.cli import main
from ess.core.trace import Trace, load_trace, save_trace

SMALL = SynthOptions(requests=2, steps=16, layers=3, topk=32, context=400, warmup_windows=6, sinks=2, window=6,
                     churn_min=2, churn_max=12, pool=90, fresh=0.05, seed=3)


def _random_trace(seed=0) -> Trace:
    """Sets with repeats across steps, duplicates inside a set and -1 padding, and the own position selected."""
    rng = np.random.default_rng(seed)
    R, steps, L, K, ctx = 2, 12, 2, 8, 40
    topk = rng.integers(0, ctx, size=(R, steps, L, K)).astype(np.int32)
    topk[..., -1] = -1
    topk[:, :, :, 0] = ctx + np.arange(steps)[None, :, None]  # the own position
    pre = rng.integers(0, ctx - 4, size=(R, 4, L, K)).astype(np.int32)
    return Trace(topk, np.full(R, ctx, dtype=np.int64), pre, {"source": "test"})


@pytest.mark.parametrize("warmup", [True, False])
def test_lru_ranks_give_the_pools_misses_at_every_size(warmup):
    for trace in (synth_trace(SMALL), _random_trace()):
        ranks = lru_ranks(trace, warmup)
        K = trace.topk.shape[3]
        for C in (K + 1, K + 5, 2 * K, 4 * K, 10 * K):
            if C > int(trace.context_len.max()) + trace.topk.shape[1] + 1:
                continue
            assert np.array_equal(misses_at(ranks, C), replay_counts(trace, C, warmup).misses), C


def test_pool_spread_keeps_the_default_trace():
    """pool_min: None and pool_min = pool draw the same trace (the old generator's)."""
    import dataclasses

    a, b = synth_trace(SMALL), synth_trace(dataclasses.replace(SMALL, pool_min=SMALL.pool))
    assert np.array_equal(a.topk, b.topk) and np.array_equal(a.prefill_topk, b.prefill_topk)


def test_pool_by_churn_hands_the_same_pool_sizes_out_in_churn_order():
    """pool_by_churn: no change without pool_min; with it, the same sizes, the layer with more churn the larger."""
    import dataclasses

    a = synth_trace(dataclasses.replace(SMALL, pool_by_churn=True))
    assert np.array_equal(a.topk, synth_trace(SMALL).topk)
    spread = dataclasses.replace(SMALL, layers=6, pool_min=10)
    shuffled, ordered = synth_trace(spread).meta, synth_trace(dataclasses.replace(spread, pool_by_churn=True)).meta
    assert sorted(ordered["pool_per_layer"]) == sorted(shuffled["pool_per_layer"])
    churn, pool = np.array(ordered["churn_per_layer"]), np.array(ordered["pool_per_layer"])
    assert np.all(np.diff(pool[np.argsort(churn, kind="stable")]) >= 0)


def test_fit_like_a_synthetic_trace_lands_within_15_percent():
    """A trace the generator itself made is within its reach: the fit's curve is within 15% at every ratio."""
    like = synth_trace(SMALL)
    opt, trace, report = fit_like(like, seed=1)
    assert report["within_15_percent"], report
    assert opt.topk == 32 and opt.layers == 3 and opt.steps == 16 and opt.requests == 2
    assert trace.topk.shape == synth_trace(opt).topk.shape  # the trace the fitted options make, returned
    assert len(report["real_stats"]["reentry_gap_shares_and_first_touch"]) == 6


def test_synth_like_cli(tmp_path, capsys):
    real = tmp_path / "real.npz"
    save_trace(real, synth_trace(SMALL))
    out, fit = tmp_path / "like.npz", tmp_path / "fit.json"
    assert main(["trace", "synth", "--like", str(real), "--out", str(out), "--fit-out", str(fit), "--quiet",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    t = load_trace(out)
    assert "NOT a measurement" in t.meta["source"] and t.meta["fit"]["ratios"] == doc["ratios"]
    assert json.loads(fit.read_text())["max_relative_error"] == doc["max_relative_error"]
    assert main(["trace", "synth", "--like", str(real), "--pool", "5", "--out", str(tmp_path / "x.npz")]) == 2
    assert "--pool: --like fits" in capsys.readouterr().err
    assert main(["trace", "synth", "--fit-out", str(fit) + "2", "--out", str(tmp_path / "x.npz")]) == 2
    assert "give --like too" in capsys.readouterr().err


def test_the_committed_fit_carries_to_deepseek_shapes():
    """scaled: the SmolLM2 fit (top-k 256 of 7,936 tokens) at top-k 2048 and 32K / 128K: window and churn scale with
    top-k, the pools with the context, the rest stays; the result is a valid generator setting."""
    fit = load_fitted(str(pathlib.Path(__file__).resolve().parents[2] / "benchmark/results/policies/real_fit.json"))
    for context in (32768, 131072):
        s = scaled(fit, 2048, context)
        s.validate()
        assert s.window == round(fit.window * 8) and s.churn_max == round(fit.churn_max * 8)
        assert s.pool == round(fit.pool * context / fit.context) and (s.sinks, s.fresh, s.pool_power) == (
            fit.sinks, fit.fresh, fit.pool_power)
