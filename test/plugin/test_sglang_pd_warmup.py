"""LRU-Warmup across PD disaggregation (CPU), the wire format: the state a prefill node sends equals what a
co-located warm-up leaves, and its parts merge into the whole. Its trip through SGLang's metadata buffers into a decode
node's runtime is tested with the runtime (test_sglang_runtime.py)."""

import random

import pytest
import torch

from ess.core.policy import STAMP_MOD, lru_update
from ess.core.sparse_pool import SparseMemoryPool
from ess.reference.lru_oracle import OracleLRU
from sglang_ess.pd import warmup as pd_warmup

sglang = pytest.importorskip("sglang")



def random_sets(rng, W, K, P):
    """[1, W, K] warm-up sets over positions < P, some windows short or empty."""
    sets = torch.full((1, W, K), -1)
    for w in range(W):
        n = rng.randint(0, K)
        sets[0, w, :n] = torch.tensor(rng.sample(range(P), n), dtype=torch.long)
    return sets


def test_sent_state_equals_the_colocated_warmup_and_decodes_alike():
    """For C <= N slots the loaded state (rows and stamps) is the oracle warm-up's, and the decode steps after it
    miss the same rows; with more slots than entries the N newest by (window, position) are kept."""
    rng = random.Random(3)
    K, P = 8, 70
    for trial in range(60):
        W, C = rng.randint(1, 32), rng.randint(K + 1, 4 * K)
        sets = random_sets(rng, W, K, P)
        oracle = OracleLRU(C)
        for w in range(W):
            oracle.step(sets[0, w].tolist(), -1, w - W)
        entries = pd_warmup.compact(pd_warmup.encode(sets), pd_warmup.entries_per_layer(K))
        pool = SparseMemoryPool(1, 2, C, P, "cpu")
        pos, window = pd_warmup.unpack(entries, C)
        pool.load(1, pos, window - pd_warmup.WINDOWS)
        held = {int(p): int(s) for p, s in zip(pool.slot_pos[0, 1, :C], pool.slot_stamp[0, 1, :C]) if p >= 0}
        assert held == {p: s % STAMP_MOD for p, s in oracle.stamp.items()}, trial  # the policy's modular stamps
        slots = pool.pos_slot[0, 1, :P]
        assert all(int(pool.slot_pos[0, 1, s]) == p for p, s in enumerate(slots.tolist()) if s >= 0)
        assert int((slots >= 0).sum()) == len(held)
        for t in range(4):  # decode steps: same misses as the oracle
            own, topk = P - 4 + t, rng.sample(range(P - 4 + t), K)
            got = lru_update(*pool.layer_state(0), torch.tensor([1]), torch.tensor([topk]), torch.tensor([own]), t)
            assert int(got.n_miss[0]) == oracle.step(topk, own, t)

    sets = torch.arange(40).view(1, 5, 8)  # 40 distinct positions, 8 per window
    entries = pd_warmup.compact(pd_warmup.encode(sets), 12)  # room for the 12 newest only
    pos, window = pd_warmup.unpack(entries, 64)
    assert pos.tolist() == [list(range(39, 27, -1))] and set(window[0].tolist()) == {31, 30}


def test_parts_merge_into_the_whole():
    """TBO micro-batches hold parts of a request's windows; merging their compacted parts gives the whole."""
    rng = random.Random(4)
    for _ in range(30):
        sets = random_sets(rng, 12, 8, 40)
        v = pd_warmup.encode(sets)
        cut = rng.randint(0, v.shape[1])
        n = rng.randint(4, 40)
        parts = torch.cat([pd_warmup.compact(v[:, :cut], n), pd_warmup.compact(v[:, cut:], n)], 1).long()
        assert torch.equal(pd_warmup.compact(parts, n), pd_warmup.compact(v, n))
