import pytest
import torch

from ess.core.kernels import lru_step_cuda
from ess.reference.ess_cache import EssLatentCache
from ess.core.settings import EssConfig, KnobError as EssConfigError
from ess.reference.host_pool import PAGE_TOKENS, HostPoolExhausted, TotalMemoryPool
from ess.reference.tiny import TINY, dense, tiny_model, tiny_prompts


def test_host_pool_allocation_release_and_reuse():
    pool = TotalMemoryPool(num_layers=2, capacity_tokens=4 * PAGE_TOKENS, max_requests=2, max_tokens_per_request=300)
    a = pool.alloc_request()
    pool.reserve(a, 100)  # 2 pages
    b = pool.alloc_request()
    pool.reserve(b, 64)
    assert pool.free_pages == 1
    rows = pool.rows(torch.tensor([a, b]), torch.tensor([[0, 99, 128], [63, -1, 64]]))
    assert rows[0, 2] == -1 and rows[1, 1] == -1 and rows[1, 2] == -1  # beyond the reserved pages, and padding
    assert rows[0, 0] != rows[1, 0]
    pool.release(a)
    assert pool.free_pages == 3
    c = pool.alloc_request()
    pool.reserve(c, 150)
    assert pool.free_pages == 0
    pool.release(b)
    with pytest.raises(ValueError, match=f"request {b} is not allocated \\(released twice\\?\\)"):
        pool.release(b)  # a second release frees nothing of another request
    assert pool.free_pages == 1


def test_host_pool_exhaustion_is_clear_and_overwrites_nothing():
    pool = TotalMemoryPool(num_layers=1, capacity_tokens=2 * PAGE_TOKENS, max_requests=2, max_tokens_per_request=1000)
    a = pool.alloc_request()
    pool.reserve(a, 100)
    live = torch.randint(0, 256, (100, 656), dtype=torch.uint8)
    pool.write(0, a, torch.arange(100), live)
    b = pool.alloc_request()
    with pytest.raises(HostPoolExhausted, match="--ess-host-pool-gib"):
        pool.reserve(b, 65)  # needs 2 pages, none free
    assert pool.free_pages == 0 and torch.equal(pool.read(0, a, torch.arange(100)), live)
    with pytest.raises(IndexError, match="beyond its reserved pages"):
        pool.write(0, b, torch.arange(3), live[:3])
    with pytest.raises(HostPoolExhausted, match="request slots"):
        pool.alloc_request()


def test_config_validation_names_the_field():
    with pytest.raises(EssConfigError, match="below top-k \\+ 1 = 2049"):
        EssConfig(topk=2048, buffer_tokens=2048)
    with pytest.raises(EssConfigError, match="not both"):
        EssConfig(topk=8, buffer_tokens=9, sparse_ratio=0.5)
    assert EssConfig(topk=64).capacity(1000) == 200  # neither: the default ratio (ess.core.settings)
    with pytest.raises(EssConfigError, match="sparse_ratio"):
        EssConfig(topk=8, sparse_ratio=1.5)
    with pytest.raises(EssConfigError, match="buffer_tokens"):
        EssConfig(topk=8, buffer_tokens=-3)
    with pytest.raises(EssConfigError, match="unknown ESS config field"):
        EssConfig.from_dict({"topk": 8, "buffer_tokens": 20, "bufer": 1})
    with pytest.raises(EssConfigError, match="sparse_ratio 0.01 of 1000 tokens"):
        EssConfig(topk=64, sparse_ratio=0.01).capacity(1000)
    assert EssConfig(topk=64, sparse_ratio=0.2).capacity(1000) == 200
    assert EssConfig(topk=8, buffer_tokens=9, host_pool_gib=1.0).host_pool_tokens(61, 656) == (1 << 30) // (61 * 656)


def test_host_and_gpu_rows_stay_intact_over_many_steps():
    prompts = tiny_prompts()
    model = tiny_model()
    steps = 24
    base, dcache = model.generate(prompts, steps, dense())
    cfg = EssConfig(topk=TINY.index_topk, buffer_tokens=TINY.index_topk + 5)
    res, cache = model.generate(
        prompts, steps, lambda ctx, max_len: EssLatentCache(cfg, TINY.num_layers, ctx, max_len, "cpu")
    )
    assert int(cache.miss_counts().sum()) > 0
    for layer in range(TINY.num_layers):
        for b, c in enumerate(base.context_len.tolist()):
            n = c + steps
            # The host pool holds every token, prompt and decoded, byte for byte as the dense baseline.
            assert torch.equal(cache.host.read(layer, int(cache.req[b]), torch.arange(n)), dcache.rows[layer, b, :n])
            # Every resident GPU slot holds the row of the position its table names.
            sp = cache.sparse.slot_pos[layer, b, : cache.capacity]
            for slot in (sp >= 0).nonzero().flatten().tolist():
                pos = int(sp[slot])
                assert torch.equal(cache.serving.gpu[layer, b * cache.capacity + slot], dcache.rows[layer, b, pos])
    cache.release(0)
    assert cache.sparse.resident(0, int(cache.req[0])) == set()


@pytest.mark.skipif(lru_step_cuda.find_cxx() is None, reason="the CUDA kernel's CPU emulation needs g++ (C++20)")
def test_the_cuda_lru_step_serves_the_reference_cache():
    """The CUDA LRU step (its CPU emulation) behind the reference cache: it takes the cache's token table as it is
    (an int64 table failed every step on an H200) and decodes the dense baseline's tokens."""
    prompts, steps = tiny_prompts(), 8
    base, _ = tiny_model().generate(prompts, steps, dense())
    cfg = EssConfig(topk=TINY.index_topk, buffer_tokens=TINY.index_topk + 5)
    res, cache = tiny_model().generate(
        prompts, steps, lambda ctx, max_len: EssLatentCache(cfg, TINY.num_layers, ctx, max_len, "cpu", kernel="cuda")
    )
    assert cache.token_table.dtype == torch.int32 and int(cache.miss_counts().sum()) > 0
    assert torch.equal(res.tokens, base.tokens)
