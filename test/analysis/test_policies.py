"""The candidate policies (ess.analysis.candidate_policies) against plain-Python oracles written here, LRU against ESS's own
step, and Belady's MIN below every policy on every trace these tests use."""

import random

import numpy as np
import pytest
import torch

from ess.analysis import belady
from ess.analysis.candidate_policies import SCORE_UNIT, replay_policy
from ess.analysis.replay import replay_misses
from ess.analysis.synth import SynthOptions, synth_trace
from ess.reference.lru_oracle import OracleLRU


def oracle(steps, capacity, policy, decay_shift=2):
    """One row: steps [(top-k positions, own position or -1, ranks past the top-k)] -> (misses, prefetched, hits)
    per step and the wasted prefetches."""
    res: dict[int, list] = {}  # resident position -> [stamp, score, prefetched and unused]
    misses, prefetched, hits, wasted = [], [], [], 0

    def evict(n, keep):
        nonlocal wasted
        for _, _, p in sorted((v[1], v[0], p) for p, v in res.items() if p not in keep)[:max(0, n)]:
            wasted += res.pop(p)[2]

    for t, (s, o, ext) in enumerate(steps):
        u = {p for p in s if p >= 0 and p != o}
        U = u | ({o} if o >= 0 else set())
        misses.append(len(u - res.keys()))
        hits.append(sum(res[p][2] for p in U if p in res))
        need = U - res.keys()
        evict(len(res) + len(need) - capacity, U)
        if policy == "score":
            for p, v in res.items():
                v[1] = v[1] - (v[1] >> decay_shift) + (SCORE_UNIT if p in U else 0)
        for p in U:
            res[p] = [t, SCORE_UNIT if policy == "score" and p in need else res.get(p, [0, 0])[1], False]
        fetched = []
        if policy == "prefetch":
            for p in ext:
                if p >= 0 and p != o and p not in res and p not in fetched:
                    fetched.append(p)
            fetched = fetched[: capacity - len(U)]
            evict(len(res) + len(fetched) - capacity, U)
            for p in fetched:
                res[p] = [t, 0, True]
        prefetched.append(len(fetched))
    return misses, prefetched, hits, wasted + sum(v[2] for v in res.values())


def random_rows(seed, T, N, K, d, P, own_every=True):
    """Random steps for N rows: top-k sets drawn near the own position (locality), duplicates, -1 and the own
    position inside the set included; ext ranks overlapping the set."""
    rng = random.Random(seed)
    sets = torch.full((T, N, K), -1, dtype=torch.int64)
    own = torch.full((T, N), -1, dtype=torch.int64)
    ext = torch.full((T, N, d), -1, dtype=torch.int64)
    for t in range(T):
        for n in range(N):
            o = P - T + t if own_every or t % 3 else -1
            hi = o if o >= 0 else P - T - 1
            pool = [rng.randrange(0, hi + 1) for _ in range(K + d)]
            pool = [p if rng.random() > 0.1 else -1 for p in pool]
            if o >= 0 and rng.random() < 0.3:
                pool[0] = o
            sets[t, n] = torch.tensor(pool[:K])
            ext[t, n] = torch.tensor(pool[K:])
            own[t, n] = o
    return sets, own, ext


CASES = [(0, 12, 3, 6, 4, 40, 7), (1, 20, 2, 8, 8, 30, 9), (2, 15, 4, 5, 12, 60, 20), (3, 10, 2, 16, 3, 50, 17)]


@pytest.mark.parametrize("policy", ["lru", "prefetch", "score"])
@pytest.mark.parametrize("seed,T,N,K,d,P,C", CASES)
def test_vectorised_policies_equal_their_oracles(policy, seed, T, N, K, d, P, C):
    sets, own, ext = random_rows(seed, T, N, K, d, P, own_every=seed % 2 == 0)
    got = replay_policy(sets, own, C, P, policy, ext=ext)
    for n in range(N):
        steps = [(sets[t, n].tolist(), int(own[t, n]), ext[t, n].tolist()) for t in range(T)]
        m, pf, h, w = oracle(steps, C, policy)
        assert got.misses[:, n].tolist() == m
        assert got.prefetched[:, n].tolist() == pf
        assert got.prefetch_hits[:, n].tolist() == h
        assert int(got.wasted[n]) == w


@pytest.mark.parametrize("seed,T,N,K,d,P,C", CASES)
def test_lru_of_the_engine_is_esss_lru(seed, T, N, K, d, P, C):
    sets, own, _ = random_rows(seed, T, N, K, d, P)
    got = replay_policy(sets, own, C, P, "lru")
    for n in range(N):
        o = OracleLRU(C)
        assert got.misses[:, n].tolist() == [o.step(sets[t, n].tolist(), int(own[t, n]), t) for t in range(T)]


def test_score_policy_keeps_frequent_rows_that_lru_evicts():
    """Position 0 is used in the first four steps and then every other step, the other positions once each: at each
    burst of new positions LRU evicts 0 (its stamp ties the others', its position is lowest); its score keeps it."""
    steps = [([0, 100 + t], 1000 + t, []) for t in range(4)]
    steps += [([0, 100 + t] if t % 2 == 0 else [200 + t, 300 + t], 1000 + t, []) for t in range(4, 12)]
    lru, *_ = oracle(steps, 4, "lru")
    score, *_ = oracle(steps, 4, "score")
    assert lru[4:] == [1] + [2] * 7 and score[4:] == [1, 2] * 4


def test_prefetch_of_next_steps_entrants_removes_their_misses():
    """Each step's ranks past the top-k are exactly the next step's new positions: after the first step every
    demand miss is gone, and nothing is wasted."""
    T, K = 8, 3
    sets = [[10 * t + j for j in range(K)] for t in range(T)]
    steps = [(sets[t], 500 + t, sets[t + 1] if t + 1 < T else []) for t in range(T)]
    m, pf, h, w = oracle(steps, 2 * K + 2, "prefetch")
    assert m == [K] + [0] * (T - 1) and pf == [K] * (T - 1) + [0] and h == [0] + [K] * (T - 1) and w == 0
    lru, *_ = oracle(steps, 2 * K + 2, "lru")
    assert sum(lru) == K * T


def _trace_rows(trace, layer_slice=slice(None)):
    """Steps [T, N, K], own [T, N] and ext [T, N, d] (or None) of a trace, one row per (request, layer)."""
    R, T, L, K = trace.topk.shape
    sets = torch.as_tensor(trace.topk).permute(1, 0, 2, 3).reshape(T, R * L, K).long()
    own = (torch.as_tensor(trace.context_len).repeat_interleave(L).unsqueeze(0) + torch.arange(T).unsqueeze(1))
    ext = None
    if trace.topk_ext is not None:
        ext = torch.as_tensor(trace.topk_ext[..., K:]).permute(1, 0, 2, 3).reshape(T, R * L, -1).long()
    return sets, own, ext


def small_synth():
    return synth_trace(SynthOptions(requests=2, steps=10, layers=3, topk=64, context=512, warmup_windows=4,
                                    sinks=2, window=8, churn_min=2, churn_max=20, pool=120, seed=5))


def test_min_is_at_most_every_policy_on_every_test_trace():
    traces = []
    for seed, T, N, K, d, P, C in CASES:
        sets, own, ext = random_rows(seed, T, N, K, d, P)
        traces.append((sets, own, ext, C, P))
    tr = small_synth()
    sets, own, _ = _trace_rows(tr)
    P = int(tr.context_len.max()) + tr.topk.shape[1]
    traces.append((sets, own, None, 80, P))
    for sets, own, ext, C, P in traces:
        best = belady.min_misses(sets, own, C, P)
        for policy in ("lru", "score") + (("prefetch",) if ext is not None else ()):
            got = replay_policy(sets, own, C, P, policy, ext=ext)
            assert (best.sum(0) <= got.misses.sum(0)).all(), policy


def test_lru_of_the_engine_equals_the_replay_of_esss_pool():
    tr = small_synth()
    sets, own, _ = _trace_rows(tr)
    P = int(tr.context_len.max()) + tr.topk.shape[1]
    got = replay_policy(sets, own, 80, P, "lru").misses  # [T, R * L]
    want = replay_misses(tr, 80, warmup=False)  # [R, T, L]
    R, T, L = want.shape
    assert np.array_equal(got.reshape(T, R, L).permute(1, 0, 2).numpy(), want)


def test_bad_settings_name_the_flag():
    sets = torch.zeros(2, 1, 4, dtype=torch.int64)
    own = torch.ones(2, 1, dtype=torch.int64) * 5
    with pytest.raises(ValueError, match="--buffer-tokens"):
        replay_policy(sets, own, 4, 8, "lru")
    with pytest.raises(ValueError, match="topk_ext"):
        replay_policy(sets, own, 8, 8, "prefetch")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A reference-model trace with 8 ranks past each top-k, written and read back."""
    from ess.core.trace import load_trace, save_trace
    from ess.reference.demo import DemoOptions, record_trace

    opt = DemoOptions(layers=2, topk=16, batch=2, context=64, steps=6)
    path = tmp_path_factory.mktemp("rec") / "ref.npz"
    save_trace(path, record_trace(opt, lookahead=8))
    return path, load_trace(path), record_trace(opt)


def test_recorded_ranks_extend_the_same_top_k(recorded):
    _, tr, plain = recorded
    assert tr.lookahead == 8 and tr.topk_ext.shape == (2, 6, 2, 24)
    assert np.array_equal(tr.topk_ext[..., :16], tr.topk) and np.array_equal(tr.topk, plain.topk)
    assert plain.topk_ext is None and plain.lookahead == 0


def test_topk_ext_is_validated():
    from ess.core.trace import Trace, TraceError

    topk = np.array([[[[0, 1]], [[1, 2]]]], dtype=np.int32)  # [1, 2, 1, 2]
    ctx = np.array([3], dtype=np.int64)
    Trace(topk, ctx, topk_ext=np.concatenate([topk[..., ::-1], np.full_like(topk, -1)], -1)).validate()
    for bad, msg in [(np.concatenate([topk, topk], -1)[..., :2], "more than 2"),
                     (np.concatenate([topk[..., :1], topk[..., :1] + 2, topk], -1), "top-k set"),
                     (np.concatenate([topk, np.full_like(topk, 9)], -1), "future")]:
        with pytest.raises(TraceError, match=msg):
            Trace(topk, ctx, topk_ext=bad.astype(np.int32)).validate()


def test_replay_cli_reports_prefetch_and_score(recorded, capsys):
    import json

    from ess.cli import main

    path = str(recorded[0])
    out = {}
    for policy in ("lru", "prefetch", "score", "belady"):
        lookahead = ["--lookahead", "4"] if policy == "prefetch" else []  # the other policies refuse it
        assert main(["cache", "replay", path, "--buffer-tokens", "20", "--warmup", "--policy", policy, *lookahead,
                     "--json", "--quiet"]) == 0
        out[policy] = json.loads(capsys.readouterr().out)
    pre = out["prefetch"]
    assert pre["lookahead"] == 4 and np.array(pre["prefetched"]).shape == (2, 6, 2)
    assert np.array(pre["wasted"]).shape == (2, 2) and (np.array(pre["prefetch_hits"]) <= 4).all()
    moved = np.array(pre["misses"]).mean() + np.array(pre["prefetched"]).mean()
    assert pre["bytes_per_step"] == pytest.approx(moved * 656)
    for policy in ("lru", "prefetch", "score"):
        assert (np.array(out["belady"]["misses"]).sum() <= np.array(out[policy]["misses"]).sum())
    assert main(["cache", "replay", path, "--buffer-tokens", "20", "--policy", "prefetch", "--lookahead", "9",
                 "--quiet"]) == 2
    assert "--lookahead" in capsys.readouterr().err


def test_a_prefetch_profile_charges_its_prefetched_rows_in_the_simulator(recorded):
    from ess.analysis.profiling import profile_traces
    from ess.analysis.sim.engine import layer_misses
    from ess.analysis.sim.profile import misses_at, validate_profile
    from ess.analysis.sim.specs import MODELS

    _, tr, _ = recorded
    prof = validate_profile(profile_traces([("ref", tr)], buffer_tokens=[20, 40], policy="prefetch"))
    assert prof["policy"] == "prefetch" and len(prof["mean_prefetched"]) == 2
    spec = next(iter(MODELS.values()))
    prof = {**prof, "num_layers": spec.layers, "mean_misses": [[1.0] * spec.layers] * 2,
            "mean_prefetched": [[0.5] * spec.layers] * 2}
    r = prof["ratios"][0]
    assert layer_misses(spec, 0, prof, r) == pytest.approx([x + 0.5 for x in misses_at(prof, r)])


def test_the_policy_benchmark_smoke_run(tmp_path):
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmark" / "policies.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads((tmp_path / "policies.json").read_text())
    assert (tmp_path / "policies.png").exists() and doc["date"] and doc["machine"]
    ref, syn = doc["results"]
    assert {r["policy"] for r in ref["rows"]} == {"lru", "belady", "score", "prefetch"}
    assert "prefetch" not in {r["policy"] for r in syn["rows"]} and "SYNTHETIC" in syn["trace"]
    for res in doc["results"]:
        for ratio in {r["ratio"] for r in res["rows"]}:
            best = next(r for r in res["rows"] if r["ratio"] == ratio and r["policy"] == "belady")["mean_misses"]
            assert all(r["mean_misses"] >= best for r in res["rows"] if r["ratio"] == ratio)
