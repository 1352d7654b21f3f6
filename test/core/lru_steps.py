"""Shared by the LRU kernels' tests (test_lru_kernel.py, test_lru_cuda.py): a kernel's steps against ess.core.policy's
torch path, byte for byte, on two copies of the same tables."""

import random

import torch

from ess.core.policy import lru_update
from ess.core.sparse_pool import SparseMemoryPool

FIELDS = ("attn_slot", "hit", "miss_pos", "miss_slot", "own_slot", "n_miss", "n_set")


def assert_same_step(a: SparseMemoryPool, b: SparseMemoryPool, req, sets, own, stamp, token_table, kernel):
    """One step: the torch path on a's tables, `kernel(*b's tables, req, sets, own, stamp, token_table)` on b's; every
    output, the miss rows read from the token table, and the tables after equal. Returns the torch path's result."""
    ra = lru_update(*a.layer_state(0), req, sets, own, stamp)
    rb = kernel(*b.layer_state(0), req, sets, own, stamp, token_table)
    for f in FIELDS:
        x, y = getattr(ra, f), getattr(rb, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (f, x, y)
    rows = token_table[req.long().unsqueeze(1), ra.miss_pos.clamp(min=0).long()]
    assert torch.equal(torch.where(ra.miss_pos >= 0, rows, -1), rb.miss_row)
    for x, y in zip(a.layer_state(0), b.layer_state(0)):  # the last column is each table's scratch sink
        assert torch.equal(x[:, :-1], y[:, :-1])
    return ra


def run_trace(steps, C, max_pos, own_of, warm=(), first_stamp=0, device="cpu", seed=0, stamps=None, *, kernel):
    """steps / warm: lists of [R, K] sets; own_of(t) the own positions of step t ([R] or [R, M]); stamps: the steps'
    stamps (default first_stamp + t). Returns each step's miss counts."""
    R = len(steps[0])
    a, b = (SparseMemoryPool(1, R, C, max_pos, device, "torch") for _ in range(2))
    req = torch.tensor(random.Random(seed).sample(range(R), R), device=device)  # rows need not be in slot order
    gen = torch.Generator().manual_seed(seed)
    token_table = torch.randint(0, 1 << 20, (R, max_pos), dtype=torch.int32, generator=gen).to(device)
    none = torch.full((R,), -1, device=device)
    for w, sets in enumerate(warm):
        assert_same_step(a, b, req, torch.tensor(sets, device=device), none, first_stamp + w - len(warm), token_table,
                         kernel)
    misses = []
    for t, sets in enumerate(steps):
        stamp = first_stamp + t if stamps is None else stamps[t]
        r = assert_same_step(a, b, req, torch.tensor(sets, device=device), own_of(t).to(device), stamp, token_table,
                             kernel)
        misses.append(r.n_miss)
    return misses


def random_steps(rng, R, steps, K, ctx, M=1, dup=False, pad=0.1):
    out = []
    for t in range(steps):
        row = []
        for i in range(R):
            pool = range(0, ctx[i] + (t + 1) * M)
            sel = [rng.choice(pool) for _ in range(K)] if dup else rng.sample(pool, K)
            row.append([x if rng.random() > pad else -1 for x in sel])
        out.append(row)
    return out
