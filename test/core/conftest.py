"""Shared by the LRU kernels' tests (test_lru_kernel.py, test_lru_cuda.py; tests import no test module, so through
fixtures): a kernel's step against the torch ops (ess.core.policy.lru_update) on twin tables, byte for byte."""

import random

import pytest
import torch

from ess.core.policy import lru_update
from ess.core.sparse_pool import SparseMemoryPool

class KernelCheck:
    """kernel(slot_pos, slot_stamp, pos_slot, req, sets, own, stamp, token_table, **options) -> PolicyResult."""

    FIELDS = ("attn_slot", "hit", "miss_pos", "miss_slot", "own_slot", "n_miss", "n_set")  # compared, with miss_row

    def __init__(self, kernel):
        self.kernel = kernel

    def step(self, a: SparseMemoryPool, b: SparseMemoryPool, req, sets, own, stamp, token_table, **options):
        """One step on a (the torch ops) and b (the kernel): equal results, miss rows and tables; a's result."""
        ra = lru_update(*a.layer_state(0), req, sets, own, stamp)
        rb = self.kernel(*b.layer_state(0), req, sets, own, stamp, token_table, **options)
        for f in self.FIELDS:
            x, y = getattr(ra, f), getattr(rb, f)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (f, x, y)
        rows = token_table[req.long().unsqueeze(1), ra.miss_pos.clamp(min=0).long()]
        assert torch.equal(torch.where(ra.miss_pos >= 0, rows, -1), rb.miss_row)
        for x, y in zip(a.layer_state(0), b.layer_state(0)):  # the last column is each table's scratch sink
            assert torch.equal(x[:, :-1], y[:, :-1])
        return ra

    def trace(self, steps, C, max_pos, own_of, warm=(), first_stamp=0, device="cpu", seed=0, stamps=None, **options):
        """steps / warm: lists of [R, K] sets; own_of(t) the own positions of step t ([R] or [R, M]); stamps: the
        steps' stamps (default first_stamp + t). Returns each step's miss counts."""
        R = len(steps[0])
        a, b = (SparseMemoryPool(1, R, C, max_pos, device, "torch") for _ in range(2))
        req = torch.tensor(random.Random(seed).sample(range(R), R), device=device)  # rows need not be in slot order
        gen = torch.Generator().manual_seed(seed)
        token_table = torch.randint(0, 1 << 20, (R, max_pos), dtype=torch.int32, generator=gen).to(device)
        none = torch.full((R,), -1, device=device)
        for w, sets in enumerate(warm):
            self.step(a, b, req, torch.tensor(sets, device=device), none, first_stamp + w - len(warm), token_table,
                      **options)
        misses = []
        for t, sets in enumerate(steps):
            stamp = first_stamp + t if stamps is None else stamps[t]
            r = self.step(a, b, req, torch.tensor(sets, device=device), own_of(t).to(device), stamp, token_table,
                          **options)
            misses.append(r.n_miss)
        return misses


def steps_at_random(rng, R, steps, K, ctx, M=1, dup=False, pad=0.1):
    """R requests' top-k sets for `steps` steps over contexts ctx growing by M a step (dup: repeats; pad: -1 share)."""
    out = []
    for t in range(steps):
        row = []
        for i in range(R):
            pool = range(0, ctx[i] + (t + 1) * M)
            sel = [rng.choice(pool) for _ in range(K)] if dup else rng.sample(pool, K)
            row.append([x if rng.random() > pad else -1 for x in sel])
        out.append(row)
    return out


def adversarial_traces():
    """Two requests (contexts 40 and 50), K = 6: every entry a miss, duplicates and -1 padding, the own position in
    the set; with the own positions of each step."""
    all_new = [[[t * 6 + j for j in range(6)], [t * 6 + j + 1 for j in range(6)]] for t in range(4)]
    dups_and_pad = [[[3, 3, 3, -1, -1, 5], [-1] * 6], [[5, 5, 2, 2, -1, 3], [0] * 6]] * 2
    with_own = [[[40 + t, 1, 2, 3, -1, -1], [50 + t, 50 + t, 4, -1, -1, -1]] for t in range(3)]
    return (all_new, dups_and_pad, with_own), lambda t: torch.tensor([40 + t, 50 + t])


def verify_own(ctx, M):
    """Own positions of MTP verify step t ([R, M]; request 1 verifies one row fewer)."""
    def own(t):
        o = torch.tensor([[c + M * t + j for j in range(M)] for c in ctx])
        o[1, M - 1] = -1
        return o
    return own


@pytest.fixture
def kernel_check():
    return KernelCheck


@pytest.fixture
def adversarial():
    return adversarial_traces()


@pytest.fixture
def mtp_own():
    return verify_own


@pytest.fixture
def random_steps():
    return steps_at_random


@pytest.fixture
def replay_misses(tmp_path, capsys):
    """kernels -> {kernel: misses}: `ess cache replay` of one small synthetic trace with each LRU step kernel."""
    import json

    from ess.analysis.synth import SynthOptions, synth_trace
    from ess.cli import main
    from ess.core.trace import save_trace

    def replay(kernels):
        opt = SynthOptions(requests=2, steps=5, layers=2, topk=32, context=400, warmup_windows=4, sinks=2, window=8,
                           churn_min=2, churn_max=12, pool=120, seed=1)
        path = tmp_path / "t.npz"
        save_trace(path, synth_trace(opt))
        out = {}
        for kernel in kernels:
            assert main(["cache", "replay", str(path), "--buffer", "40", "--warmup", "--kernel", kernel, "--json",
                         "--quiet"]) == 0
            out[kernel] = json.loads(capsys.readouterr().out)["misses"]
        return out

    return replay


@pytest.fixture
def mtp_verify_trace(random_steps, mtp_own):
    """(check, seed, K, C, steps, ctx_range): a trace of M = 3 own tokens per step and the union of 3 query rows'
    sets, duplicates included, through check's kernel against the reference."""

    def run(check, seed, K, C, steps, ctx_range):
        rng = random.Random(seed)
        R, M = 3, 3
        ctx = [rng.randint(*ctx_range) for _ in range(R)]
        check.trace(random_steps(rng, R, steps, K, ctx, M, dup=True), C, max(ctx) + M * steps + 1, mtp_own(ctx, M),
                    seed=seed)

    return run
