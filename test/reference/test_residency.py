"""Residency first (ess.core.residency, docs/design.md): requests whose rows all fit on the GPU skip the LRU step and
never miss; offloaded ones share the batch (one attention call); both decode the dense baseline's tokens."""

import pytest
import torch

from ess.core.settings import EssConfig
from ess.reference.ess_cache import EssLatentCache
from ess.reference.tiny import BUFFER, TINY, dense, tiny_model, tiny_prompts

STEPS = 10
CFG = EssConfig(topk=TINY.index_topk, buffer_tokens=BUFFER, warmup_windows=0)


def regions(rows_of):
    """A cache factory with a device pool of rows_of(max_len) rows."""
    return lambda ctx, max_len: EssLatentCache(CFG, TINY.num_layers, ctx, max_len, "cpu", device_rows=rows_of(max_len))


@pytest.fixture(scope="module")
def baseline():
    return tiny_model().generate(tiny_prompts(), STEPS, dense())[0]


@pytest.mark.parametrize("resident", [3, 2, 1, 0])
def test_resident_and_offloaded_requests_decode_the_baselines_tokens(baseline, resident):
    # room for `resident` whole requests beside the others' C slots each
    res, cache = tiny_model().generate(tiny_prompts(), STEPS, regions(lambda n: resident * n + (3 - resident) * BUFFER))
    assert cache.resident == [b < resident for b in range(3)]
    assert torch.equal(res.tokens, baseline.tokens)
    misses = cache.miss_counts()  # [B, steps, layers]
    assert int(misses[:resident].sum()) == 0
    if resident < 3:
        assert int(misses[resident:].sum()) > 0
    else:  # nothing offloaded: the LRU tables were never touched
        assert int((cache.sparse.slot_pos >= 0).sum()) == 0


def test_demotion_copies_nothing_and_promotion_restores_residency(baseline):
    """Across the wall both ways mid-decode: request 0 demoted after 4 steps (its region shrinks to C slots, the
    host pool holds its rows), request 1 promoted after 7 (its rows come back from the host pool)."""
    model, prompts = tiny_model(), tiny_prompts()
    ctx = [int(p.shape[0]) for p in prompts]
    max_len = max(ctx) + STEPS
    cache = EssLatentCache(CFG, TINY.num_layers, ctx, max_len, "cpu", device_rows=max_len + 2 * BUFFER)
    assert cache.resident == [True, False, False]
    sv = cache.serving

    def at_step(t):
        if t == 4:
            sv.demote(0, ctx[0] + t)
            assert sv.all_resident() is False and sv.regions.largest_free() == max_len - BUFFER
        if t == 7:
            assert sv.promote(1, max_len, cache.token_table, ctx[1] + t)
            assert sv.resident_requests() == [1]

    res, _ = model.generate(prompts, STEPS, lambda c, m: cache, on_step=at_step)
    assert torch.equal(res.tokens, baseline.tokens)
    misses = cache.miss_counts()
    assert int(misses[0, :4].sum()) == 0 and int(misses[0, 4:].sum()) > 0
    assert int(misses[1, 7:].sum()) == 0


def test_admission_refuses_what_does_not_fit():
    cache = EssLatentCache(CFG, TINY.num_layers, [100, 100], 120, "cpu", device_rows=2 * BUFFER)
    assert cache.resident == [False, False]
    cache.serving.release(1)
    cache.serving.regions.alloc(BUFFER)  # its rows taken meanwhile
    with pytest.raises(ValueError, match=f"request slot 1: {BUFFER} free device rows wanted"):
        cache.serving.admit(1, 120)


def test_promotion_without_room_keeps_the_request_in_its_slots():
    cache = EssLatentCache(CFG, TINY.num_layers, [100, 100], 120, "cpu", device_rows=2 * BUFFER + 50)
    sv = cache.serving
    assert cache.resident == [False, False] and sv.region[1] == (BUFFER, BUFFER)
    assert not sv.promote(1, 120, cache.token_table, 100)
    assert sv.region[1] == (BUFFER, BUFFER) and sv.regions.free_rows() == 50 and sv.offloaded == {0, 1}


@pytest.mark.parametrize("kernel", ["fused", "cuda"])
def test_the_lru_kernels_step_a_mixed_batch(baseline, kernel):
    """The kernels a GPU runs take the mixed batch as the torch step does: resident requests' rows masked out."""
    from ess.core.kernels import lru_step_cuda

    if kernel == "cuda" and lru_step_cuda.find_cxx() is None:
        pytest.skip("the CUDA kernel's CPU emulation needs g++ (C++20)")
    res, cache = tiny_model().generate(tiny_prompts(), 4, lambda ctx, max_len: EssLatentCache(
        CFG, TINY.num_layers, ctx, max_len, "cpu", kernel=kernel, device_rows=max_len + 2 * BUFFER))
    assert cache.resident == [True, False, False]
    assert torch.equal(res.tokens, baseline.tokens[:, :5]) and int(cache.miss_counts()[0].sum()) == 0


def test_offloaded_slots_map_into_their_regions_only_when_moved():
    cache = EssLatentCache(CFG, TINY.num_layers, [100, 100], 120, "cpu", device_rows=3 * BUFFER)
    sv = cache.serving
    assert sv.moved == set() and sv.region == {0: (0, BUFFER), 1: (BUFFER, BUFFER)}
    sv.release(0)
    sv.admit(1, 120, resident=False)  # request slot 1 again, now at row 0
    assert sv.region[1] == (0, BUFFER) and sv.moved == {1}
    topk = torch.tensor([[5, 7, -1]], dtype=torch.int32)
    r = sv.update(0, torch.tensor([1]), topk, torch.tensor([100]))
    assert r.attn_slot.tolist()[0][2] == -1 and all(0 <= x < BUFFER for x in r.attn_slot.tolist()[0][:2])
    assert 0 <= int(r.own_slot[0]) < BUFFER


def test_the_fixed_path_a_cuda_graph_replays_decodes_the_same_tokens(baseline):
    """fixed_path: no host-known skips (a captured step must serve any mix): every step masks resident requests out
    of the LRU step and maps offloaded slots, with the baseline's tokens for an all-resident and a mixed batch."""
    for rows_of in (lambda n: 3 * n, lambda n: n + 2 * BUFFER):
        def make(ctx, max_len, rows_of=rows_of):
            cache = EssLatentCache(CFG, TINY.num_layers, ctx, max_len, "cpu", device_rows=rows_of(max_len))
            cache.serving.fixed_path = True
            return cache

        res, cache = tiny_model().generate(tiny_prompts(), STEPS, make)
        assert torch.equal(res.tokens, baseline.tokens) and not cache.serving.all_resident()
