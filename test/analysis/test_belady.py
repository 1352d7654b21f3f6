"""Belady's MIN under ESS's step semantics: the vectorised replay equals the plain-Python oracle, and its misses are
at most LRU's on every trace (it is the optimum)."""

import json
import random

import numpy as np
import pytest
import torch

from ess.analysis.belady import min_misses, min_misses_oracle, next_uses
from ess.analysis.replay import replay_misses
from ess.analysis.synth import SynthOptions, synth_trace
from ess.core.trace import Trace


def random_rows(seed, N, T, K, span, warm=0, dup=True):
    rng = random.Random(seed)
    sets, own = [], []
    for t in range(T):
        o = [span + t if t >= warm else -1 for _ in range(N)]
        hi = span + max(t, 0)
        row = []
        for i in range(N):
            pick = [rng.randrange(hi) for _ in range(K)] if dup else rng.sample(range(hi), K)
            row.append([p if rng.random() > 0.15 else -1 for p in pick])
        sets.append(row)
        own.append(o)
    return torch.tensor(sets), torch.tensor(own)


def oracle_rows(sets, own, C):
    T, N, _ = sets.shape
    return [min_misses_oracle([(sets[t, n].tolist(), int(own[t, n])) for t in range(T)], C) for n in range(N)]


@pytest.mark.parametrize("seed", range(4))
def test_min_equals_its_oracle(seed):
    K = 6
    C = [K + 1, K + 3, 12, 20][seed]
    sets, own = random_rows(seed, N=3, T=18, K=K, span=25, warm=seed % 3)
    got = min_misses(sets, own, C, positions=25 + 18 + 1)
    assert got.T.tolist() == oracle_rows(sets, own, C)


def test_farthest_next_use_goes_first_and_own_is_never_a_miss():
    # 4 slots. Step 1 needs 3 (4, 5 and its own 10) with 1 free: it evicts 1 and 2 (never used again), keeps 3 (used
    # at step 3). Step 2's four positions (4, 6, 10 and its own 11) fill all 4 slots, so 3 must go, and step 3 misses
    # it again.
    steps = [([1, 2, 3], -1), ([4, 5, -1], 10), ([4, 6, 10], 11), ([3, 4, 10], 12)]
    assert min_misses_oracle(steps, 4) == [3, 2, 1, 1]
    sets = torch.tensor([[s] for s, _ in steps])
    own = torch.tensor([[o] for _, o in steps])
    assert min_misses(sets, own, 4, 20)[:, 0].tolist() == [3, 2, 1, 1]


def test_next_uses_look_ahead_per_row():
    uses = torch.tensor([[[1, 2]], [[2, -1]], [[1, 3]]])
    assert next_uses(uses, 5)[:, 0].tolist() == [[2, 1], [np.iinfo(np.int32).max, np.iinfo(np.int32).max],
                                                  [np.iinfo(np.int32).max] * 2]


@pytest.mark.parametrize("warmup", [False, True])
def test_min_never_misses_more_than_lru(warmup):
    opt = SynthOptions(requests=2, steps=8, layers=3, topk=32, context=400, warmup_windows=4, sinks=2, window=8,
                       churn_min=2, churn_max=12, pool=160, seed=3)
    trace = synth_trace(opt)
    for C in (33, 48, 80):
        lru = replay_misses(trace, C, warmup, 4)
        best = replay_misses(trace, C, warmup, 4, policy="belady")
        assert best.shape == lru.shape and (best <= lru).all() and lru.sum() > 0
    rng = np.random.default_rng(0)  # random sets, no locality: MIN still never loses
    topk = rng.integers(0, 200, size=(3, 10, 2, 16)).astype(np.int32)
    t = Trace(topk=topk, context_len=np.full(3, 200, dtype=np.int64), meta={"source": "test"})
    assert (replay_misses(t, 17, False, policy="belady") <= replay_misses(t, 17, False)).all()


def test_replay_cli_takes_the_policy(tmp_path, capsys):
    from ess.cli import main
    from ess.core.trace import save_trace

    opt = SynthOptions(requests=1, steps=4, layers=2, topk=32, context=300, warmup_windows=4, sinks=2, window=8,
                       churn_min=2, churn_max=12, pool=120, seed=1)
    save_trace(tmp_path / "t.npz", synth_trace(opt))
    out = {}
    for policy in ("lru", "belady"):
        assert main(["cache", "replay", str(tmp_path / "t.npz"), "--buffer-tokens", "40", "--policy", policy,
                     "--json", "--quiet"]) == 0
        out[policy] = json.loads(capsys.readouterr().out)
    assert out["belady"]["policy"] == "belady" and np.all(np.array(out["belady"]["misses"]) <= np.array(out["lru"]["misses"]))
