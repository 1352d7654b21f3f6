"""The CUDA LRU step (sgl-kernel/csrc/lru_step.cu through ess.core.kernels.lru_step_cuda) equals the torch reference
(ess.core.policy.lru_update) byte for byte: results and tables (sink columns aside). Here through the kernel's CPU
emulation (the same source under g++, a block's threads as std::threads) and with nvcc compile-only; on a GPU, the
compiled kernel at serving sizes and in a CUDA graph."""

import random
import subprocess

import pytest
import torch

from ess.core.kernels import lru_step_cuda
from ess.core.kernels.lru_step_cuda import lru_update_cuda
from ess.core.policy import STAMP_MOD, lru_update
from ess.core.sparse_pool import SparseMemoryPool

emulation = pytest.mark.skipif(lru_step_cuda.find_cxx() is None, reason="the CUDA kernel's CPU emulation needs g++ (C++20)")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.fixture
def check(kernel_check):
    return kernel_check(lru_update_cuda)


@emulation
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_decode_steps_equal_the_reference(seed, staged, check, random_steps):
    rng = random.Random(seed)
    R, K, steps = 3, 40, 10  # 40 entries on the emulation's 32 threads: two per thread
    ctx = [rng.randint(60, 120) for _ in range(R)]
    C = rng.choice([K + 1, K + 9, 70])
    warm = random_steps(rng, R, 3, K, [c - 3 for c in ctx]) if seed % 2 else ()
    own = lambda t: torch.tensor([c + t for c in ctx])
    check.trace(random_steps(rng, R, steps, K, ctx), C, max(ctx) + steps + 1, own, warm, seed=seed, staged=staged)


@emulation
def test_adversarial_steps_equal_the_reference(check, adversarial):
    traces, own = adversarial
    for trace in traces:
        check.trace(trace, 7, 60, own)  # capacity exactly K + 1: every slot full from the second step
    check.trace(traces[0], 7, 60, lambda t: torch.tensor([40, 50]))  # a replayed own position: resident, restamped
    # every resident shares a stamp (a warm-up window): ties break by position
    check.trace([[[10, 11, 12, 13]], [[20, 21, 22, 23]]], 5, 40, lambda t: torch.tensor([30 + t]), warm=[[[0, 5, 3, 4]]])
    # all stamps equal at every step, slots full, positions spread over a wide range (several select passes)
    rng = random.Random(7)
    wide = [[rng.sample(range(0, 200000, 7), 12) for _ in range(2)] for _ in range(6)]
    check.trace(wide, 30, 200010, lambda t: torch.tensor([200001 + t, 200005 + t]), stamps=[5] * 6)


@emulation
def test_ages_spread_over_the_stamp_range(check, random_steps):
    """Stamps far apart (ages near STAMP_MOD): the select's key range spans many histogram passes."""
    rng = random.Random(11)
    ctx = [300, 310]
    stamps = [0, STAMP_MOD // 3, STAMP_MOD // 2, STAMP_MOD - 7, 5, STAMP_MOD // 5, 9, 12]
    steps = random_steps(rng, 2, len(stamps), 10, ctx, pad=0.0)
    check.trace(steps, 25, 330, lambda t: torch.tensor([c + t for c in ctx]), stamps=stamps)


@emulation
@pytest.mark.parametrize("seed", range(2))
def test_mtp_verify_steps_equal_the_reference(seed, check, mtp_verify_trace):
    """M own tokens per step and the union of M query rows' sets, duplicates included."""
    mtp_verify_trace(check, seed, K=36, C=45, steps=7, ctx_range=(40, 80))


@emulation
@pytest.mark.parametrize("first_stamp", [STAMP_MOD - 5, 2**31 - 5, -3])
def test_stamps_wrap_like_the_reference(first_stamp, check, random_steps):
    rng = random.Random(5)
    R, K, ctx = 2, 6, [30, 35]
    warm = random_steps(rng, R, 3, K, [c - 4 for c in ctx])
    own = lambda t: torch.tensor([c + t for c in ctx])
    check.trace(random_steps(rng, R, 10, K, ctx), 9, 50, own, warm, first_stamp=first_stamp)


@emulation
def test_empty_batch_padding_rows_and_num_rows(check):
    """An empty batch launches nothing; padding rows (no entry, no own token, request slot 0 like SGLang's) and rows
    at or past num_rows come back empty and touch no table."""
    a, b = (SparseMemoryPool(1, 4, 9, 40, "cpu", "torch") for _ in range(2))
    table = torch.arange(4 * 40, dtype=torch.int32).view(4, 40)
    empty = lru_update_cuda(*b.layer_state(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 6, dtype=torch.int32),
                            torch.zeros(0, dtype=torch.long), 3, table)
    assert empty.attn_slot.shape == (0, 6) and empty.n_miss.shape == (0,)
    req = torch.tensor([2, 0, 3, 0])
    own = torch.tensor([30, -1, 31, -1])
    for t in range(3):
        sets = torch.tensor([[t, t + 1, 5, 5, -1, 7], [-1] * 6, [t + 2, 9, 9, 1, 2, 3], [-1] * 6], dtype=torch.int32)
        check.step(a, b, req, sets, own + t, t, table)
    # rows past num_rows: the same as empty rows, whatever they hold
    sets = torch.tensor([[1, 2, 3, 4, 5, 6], [11, 12, -1, -1, -1, -1], [7, 8, -1, 9, 10, 11], [3] * 6], dtype=torch.int32)
    own = torch.tensor([33, -1, 34, 35])
    before = [x.clone() for x in b.layer_state(0)]
    r = lru_update_cuda(*b.layer_state(0), req[2:], sets[2:], own[2:], 4, table, num_rows=torch.zeros(1, dtype=torch.int32))
    assert (r.attn_slot == -1).all() and (r.miss_pos == -1).all() and not r.hit.any() and (r.own_slot == -1).all()
    assert not r.n_miss.any() and not r.n_set.any()
    assert all(torch.equal(x, y) for x, y in zip(before, b.layer_state(0)))
    check.step(a, b, req[:1], sets[:1], own[:1], 4, table, num_rows=torch.ones(1, dtype=torch.int32))


def test_bad_arguments_are_named():
    sp, st, ps = (torch.zeros(2, 10, dtype=torch.int64) for _ in range(3))
    with pytest.raises(ValueError, match="slot_pos must be a contiguous int32 table"):
        lru_update_cuda(sp, st, ps, torch.arange(2), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2), 0)
    with pytest.raises(ValueError, match="top-k"):
        lru_update_cuda(sp.int(), st.int(), ps.int(), torch.arange(2), torch.zeros(2, 9, dtype=torch.int32), torch.zeros(2), 0)


@pytest.mark.skipif(lru_step_cuda.find_nvcc() is None, reason="no nvcc here (the venv has one through SGLang's nvidia-cuda-nvcc)")
def test_the_cuda_source_compiles_for_sm90(tmp_path):
    """The GPU build, compile only (no GPU needed): catches build errors before a GPU is lent."""
    cmd = lru_step_cuda.build_command("sm_90", str(tmp_path / "lru_step.o"), compile_only=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr.lower(), done.stderr[-3000:]


@emulation
def test_auto_and_cuda_choices(monkeypatch):
    """`cuda` is a kernel choice everywhere; `auto` is the torch path on a CPU, and the self-check admits the kernel."""
    from ess.core import sparse_pool

    assert sparse_pool.step_function("cuda", torch.device("cpu")) is lru_update_cuda
    assert sparse_pool.step_function("auto", torch.device("cpu")) is lru_update
    lru_step_cuda.self_check(torch.device("cpu"))  # its emulation equals the torch path


# -- on a GPU: the compiled kernel, at serving sizes, and under CUDA graph capture ---------------------------------------

@cuda
@pytest.mark.parametrize("B,C,M,staged", [(1, 2049, 1, None), (32, 6554, 1, None), (8, 6147, 3, None),
                                           (4, 20000, 1, None), (4, 40000, 1, None), (8, 6554, 1, False)])
def test_gpu_kernel_equals_the_reference_at_serving_sizes(B, C, M, staged, check):
    K, ctx = 2048, 32768
    rng = random.Random(B)
    steps = []
    for t in range(6):  # overlapping windows: hits, misses and evictions once the slots fill
        lo = t * 1500
        steps.append([[rng.randrange(lo, lo + 4096) for _ in range(M * K)] for _ in range(B)])
    if M == 1:
        own = lambda t: torch.full((B,), ctx + t)
    else:
        own = lambda t: torch.stack([torch.full((B,), ctx + M * t + j) for j in range(M)], 1)
    misses = check.trace(steps, C, ctx + M * 6 + 1, own, device="cuda", staged=staged)
    assert int(torch.stack(misses).sum()) > 0


# CUDA graph capture against eager: test_lru_kernel.py's test_gpu_kernel_in_a_cuda_graph_equals_eager[cuda]


@cuda
def test_auto_takes_the_cuda_kernel_on_a_gpu():
    from ess.core import sparse_pool

    assert sparse_pool.step_function("auto", torch.device("cuda")) is lru_update_cuda


@emulation
def test_replay_with_the_cuda_kernel_counts_the_same_misses(replay_misses):
    out = replay_misses(("torch", "cuda"))
    assert out["torch"] == out["cuda"] and sum(map(sum, sum(out["torch"], []))) > 0


@emulation
def test_the_gpus_block_of_512_threads_at_serving_sizes(monkeypatch, check):
    """The emulation with the GPU's 512 threads per block: top-k 2048 (4 entries per thread) and MTP verify's 6,144
    (12 per thread), thousands of slots, a few steps with evictions."""
    monkeypatch.setattr(lru_step_cuda, "EMULATION", "emulate512")
    rng = random.Random(4)
    for M, K, C in ((1, 2048, 2300), (3, 3 * 2048, 6200)):
        steps = [[[rng.randrange(t * 900, t * 900 + 4000) for _ in range(K)] for _ in range(2)] for t in range(3)]
        own = (lambda t: torch.full((2,), 20000 + t)) if M == 1 else (
            lambda t: torch.stack([torch.full((2,), 20000 + 3 * t + j) for j in range(3)], 1))
        misses = check.trace(steps, C, 20010, own, stamps=[3, 3, 4])
        assert int(torch.stack(misses).sum()) > 0
