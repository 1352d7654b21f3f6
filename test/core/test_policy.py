import random

import pytest
import torch

from ess.core.policy import STAMP_MOD, lru_update
from ess.core.sparse_pool import SparseMemoryPool
from ess.reference.lru_oracle import OracleLRU


def run_both(steps_sets, ctx, capacity, warm_sets=(), max_pos=None, first_stamp=0):
    """Run the vectorised policy (all requests batched) and one oracle per request; compare every step. Step t has
    stamp first_stamp + t; the oracle's stamps are unbounded, the policy's are kept modulo STAMP_MOD."""
    R = len(ctx)
    max_pos = max_pos or max(ctx) + len(steps_sets) + 1
    pool = SparseMemoryPool(1, R, capacity, max_pos, "cpu")
    sp, st, ps = pool.layer_state(0)
    req = torch.arange(R)
    oracles = [OracleLRU(capacity) for _ in range(R)]
    W = len(warm_sets)
    for w, sets in enumerate(warm_sets):
        r = lru_update(sp, st, ps, req, torch.tensor(sets, dtype=torch.int32), torch.full((R,), -1), first_stamp + w - W)
        for i in range(R):
            assert int(r.n_miss[i]) == oracles[i].step(sets[i], -1, first_stamp + w - W)
            assert pool.resident(0, i) == set(oracles[i].stamp)
    for t, sets in enumerate(steps_sets):
        own = torch.tensor([c + t for c in ctx])
        r = lru_update(sp, st, ps, req, torch.tensor(sets, dtype=torch.int32), own, first_stamp + t)
        for i in range(R):
            assert int(r.n_miss[i]) == oracles[i].step(sets[i], int(own[i]), first_stamp + t), (t, i)
            assert pool.resident(0, i) == set(oracles[i].stamp), (t, i)
            # Tables agree with each other, and every top-k entry maps to the slot holding its position.
            for slot in range(capacity):
                p = int(sp[i, slot])
                if p >= 0:
                    assert int(ps[i, p]) == slot and int(st[i, slot]) == oracles[i].stamp[p] % STAMP_MOD
            for k, p in enumerate(sets[i]):
                a = int(r.attn_slot[i, k])
                assert (a == -1) if p < 0 else int(sp[i, a - i * capacity]) == p
    return pool


def random_sets(rng, R, steps, K, ctx, locality):
    out = []
    for t in range(steps):
        row = []
        for i in range(R):
            hi = ctx[i] + t
            pool = list(range(max(0, hi - locality), hi + 1))
            sel = rng.sample(pool, min(K, len(pool)))
            row.append(sel + [-1] * (K - len(sel)))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_traces_match_oracle(seed):
    rng = random.Random(seed)
    R, K = 3, 8
    ctx = [rng.randint(10, 60) for _ in range(R)]
    sets = random_sets(rng, R, 25, K, ctx, locality=rng.choice([12, 30, 80]))
    warm = random_sets(rng, R, 4, K, [c - 5 for c in ctx], locality=20) if seed % 2 else ()
    run_both(sets, ctx, capacity=rng.choice([K + 1, K + 4, 20]), warm_sets=warm)


def test_adversarial_traces_match_oracle():
    K, ctx = 6, [40, 50]
    all_new = [[[t * 6 + j for j in range(6)], [t * 6 + j + 1 for j in range(6)]] for t in range(6)]
    repeated = [[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]] * 5
    dups_and_pad = [[[3, 3, 3, -1, -1, 5], [-1, -1, -1, -1, -1, -1]], [[5, 5, 2, 2, -1, 3], [0, 0, 0, 0, 0, 0]]] * 3
    with_own = [[[40 + t, 1, 2, 3, -1, -1], [50 + t, 50 + t, 4, -1, -1, -1]] for t in range(4)]
    for trace in (all_new, repeated, dups_and_pad, with_own):
        run_both(trace, ctx, capacity=K + 1)  # capacity exactly K + 1
        run_both(trace, ctx, capacity=K + 3)


def test_ties_break_by_position():
    # All residents share one stamp (warm-up window); eviction must then take the lowest positions first.
    C = 5
    run_both([[[10, 11, 12, 13]], [[20, 21, 22, 23]]], [30], capacity=C, warm_sets=[[[0, 5, 3, 4]]])


def test_capacity_below_topk_plus_one_is_refused():
    pool = SparseMemoryPool(1, 1, 4, 10, "cpu")
    with pytest.raises(ValueError, match="top-k \\+ 1"):
        lru_update(*pool.layer_state(0), torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32), torch.tensor([5]), 0)


@pytest.mark.parametrize("seed", range(3))
def test_several_own_tokens_per_step_match_oracle(seed):
    """MTP target-verify: M tokens of a request are produced in one step and the set is the union of M query rows."""
    rng = random.Random(seed)
    R, K, M, C = 3, 12, 3, 16
    ctx = [rng.randint(20, 50) for _ in range(R)]
    pool = SparseMemoryPool(1, R, C, max(ctx) + M * 10 + 1, "cpu")
    sp, st, ps = pool.layer_state(0)
    oracles = [OracleLRU(C) for _ in range(R)]
    for t in range(10):
        own = [[c + M * t + j for j in range(M)] for c in ctx]
        sets = [rng.sample(range(0, own[i][-1] + 1), K) for i in range(R)]  # may include this step's own tokens
        own[1][2] = -1  # a request with fewer verify rows
        r = lru_update(sp, st, ps, torch.arange(R), torch.tensor(sets, dtype=torch.int32), torch.tensor(own), t)
        assert r.own_slot.shape == (R, M)
        for i in range(R):
            assert int(r.n_miss[i]) == oracles[i].step(sets[i], own[i], t), (t, i)
            assert pool.resident(0, i) == set(oracles[i].stamp), (t, i)
            for j, o in enumerate(own[i]):
                assert (int(r.own_slot[i, j]) == -1) if o < 0 else int(sp[i, int(r.own_slot[i, j]) - i * C]) == o
    with pytest.raises(ValueError, match="below the set size"):
        lru_update(sp, st, ps, torch.arange(R), torch.zeros(R, 14, dtype=torch.int32), torch.zeros(R, 3, dtype=torch.int64), 99)


@pytest.mark.parametrize("first_stamp", [STAMP_MOD - 6, 2**31 - 6])  # the modulus; an int32 counter's limit
def test_stamps_wrap_around_with_the_oracles_order(first_stamp):
    """Steps on both sides of a wrap (warm-up windows before it) evict exactly as the oracle's unbounded stamps do."""
    rng = random.Random(7)
    R, K, ctx = 3, 8, [30, 40, 50]
    warm = random_sets(rng, R, 4, K, [c - 5 for c in ctx], 20)
    run_both(random_sets(rng, R, 12, K, ctx, 25), ctx, capacity=12, warm_sets=warm, first_stamp=first_stamp)


def test_the_serving_counter_stays_below_the_modulus():
    from ess.core.serving import ServingLatentCache

    sc = ServingLatentCache(1, 1, 10, 20, torch.zeros(1, 21, 656, dtype=torch.uint8), "cpu")
    sc.stamp.fill_(STAMP_MOD - 1)
    sc.next_step()
    assert int(sc.stamp) == 0


@pytest.mark.parametrize("seed", range(5))
def test_one_compaction_warmup_equals_window_by_window_lru(seed):
    """SparseMemoryPool.warm (one compaction) leaves the positions and stamps that W LRU steps leave, on empty rows,
    on rows warmed before (the second micro-batch of a TBO prefill holds the newer windows), with duplicates, -1 and
    capacities down to K + 1. It reports the slots that took a new position."""
    rng = random.Random(seed)
    R, K, W = 3, 6, rng.randint(1, 8)
    C = rng.choice([K + 1, K + 3, 15])
    P = 60
    sets = torch.tensor([[[rng.randrange(P) if rng.random() > 0.2 else -1 for _ in range(K)] for _ in range(W)]
                         for _ in range(R)])
    split = rng.randint(0, W)
    first_stamp = rng.choice([-W, 5, STAMP_MOD - 3])
    ref, got = SparseMemoryPool(1, R, C, P, "cpu"), SparseMemoryPool(1, R, C, P, "cpu")
    req = torch.tensor(rng.sample(range(R), R))
    none = torch.full((R,), -1)
    for w in range(W):
        lru_update(*ref.layer_state(0), req, sets[:, w], none, first_stamp + w)
    older = torch.where(torch.arange(W).view(1, W, 1) < split, sets, -1)  # micro-batch 1: the older windows
    newer = torch.where(torch.arange(W).view(1, W, 1) >= split, sets, -1)
    got.warm(0, req, older, first_stamp)
    before = {i: got.resident(0, i) for i in range(R)}
    took = got.warm(0, req, newer, first_stamp)
    for b, i in enumerate(req.tolist()):
        def state(pool):
            sp, st, ps = (t[i] for t in pool.layer_state(0))
            held = {int(p): int(s) for p, s in zip(sp[:C], st[:C]) if p >= 0}
            assert all(int(ps[p]) >= 0 and int(sp[int(ps[p])]) == p for p in held)  # the tables agree
            return held
        assert state(got) == state(ref), (seed, i)
        new_positions = {int(got.slot_pos[0, i, j]) for j in range(C) if took[b, j]}
        assert new_positions == got.resident(0, i) - before[i]


def test_the_kernels_refuse_tables_they_cannot_read_naming_them():
    """Both LRU kernels share these checks: an int64 token table (the reference cache's, once) is refused by name
    instead of failing inside a launch."""
    from ess.core.policy import check_step_tables

    t = torch.zeros(2, 5, dtype=torch.int32)
    check_step_tables("k", t, t, t, torch.zeros(2, 9, dtype=torch.int32))
    check_step_tables("k", t, t, t, None)
    with pytest.raises(ValueError, match="k: token_table must be int32 with contiguous rows.*torch.int64"):
        check_step_tables("k", t, t, t, torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="token_table must be int32 with contiguous rows"):
        check_step_tables("k", t, t, t, torch.zeros(9, 2, dtype=torch.int32).T)
    with pytest.raises(ValueError, match="k: slot_stamp must be a contiguous int32 table"):
        check_step_tables("k", t, t.long(), t, None)
