"""ess.core.pinned: host memory of exactly the size asked, registered with CUDA in chunks."""

import pytest
import torch

from ess.core import pinned
from ess.core.kernels import flashtrans

GIB = 1 << 30


def test_registrations_cover_the_pool_exactly_in_bounded_chunks():
    total = 169 * GIB + 12345  # a DeepSeek-V3.2 host pool is of this order per GPU
    ranges = pinned.chunk_ranges(total)
    assert ranges[0][0] == 0 and sum(size for _, size in ranges) == total
    assert all(a + s == b for (a, s), (b, _) in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert max(size for _, size in ranges) == pinned.CHUNK_BYTES and len(ranges) == 170
    assert pinned.chunk_ranges(0) == []


def test_pool_memory_is_exactly_its_size_and_zeroed():
    t = pinned.pinned_zeros((3, 1001, 656))
    assert t.shape == (3, 1001, 656) and t.dtype == torch.uint8 and not t.any()
    assert t.untyped_storage().nbytes() == 3 * 1001 * 656  # no rounding up to a power of two
    view = t[1]
    del t
    view.fill_(7)  # the pages outlive the base tensor while a view holds them
    assert int(view.sum()) == 7 * 1001 * 656


def test_the_plugin_and_reference_pools_use_it():
    from ess.reference.host_pool import TotalMemoryPool

    pool = TotalMemoryPool(2, 1000, 2, 500, "cpu")
    assert pool.data.untyped_storage().nbytes() == pool.data.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_registered_pages_are_pinned_and_uva_copies_read_them():
    host = pinned.pinned_zeros((64, 656))
    assert host.is_pinned()
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    gpu = torch.zeros(64, 656, dtype=torch.uint8, device="cuda")
    idx = torch.randperm(64, device="cuda")
    flashtrans.gather(host, idx, gpu, torch.arange(64, device="cuda"), backend="triton")
    assert torch.equal(gpu.cpu(), host[idx.cpu()])
