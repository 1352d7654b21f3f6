"""Every device byte ESS allocates is charged: what the ESS KV pool and its runtime hold, measured from their tensors
(sglang_ess.device_bytes), equals sizing's count of them (sglang_ess.sizing.ess_device_bytes), which the launch's
sizing and the GPU gain plan charge; stock SGLang's DSA pool equals stock_device_bytes. Real SGLang pools and
request tables (CPU)."""

import pytest
import torch

from sglang_ess import sizing
from sglang_ess.args import EssArgs, EssFacts
from sglang_ess.runtime import EssRuntime

sglang = pytest.importorskip("sglang")
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from sglang_ess.pool import pool_class  # noqa: E402

L, K, C, SIZE, WIDTH, REQUESTS = 2, 8, 12, 40 * 64, 200, 4
POOL_KW = dict(size=SIZE, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=L,
               device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656, start_layer=0, end_layer=L)


def launch(residency: bool, scratch_rows: int = 8, stage_rows: int = 100):
    """A stock pool, and an ESS pool with its runtime over a request table of REQUESTS rows and the padding row."""
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        stock = DSATokenToKVPool(**POOL_KW)
        ess = pool_class(scratch_rows=scratch_rows, stage_rows=stage_rows, backend="torch")(**POOL_KW)
    table = ReqToTokenPool(REQUESTS, WIDTH, "cpu", False).req_to_token
    facts = EssFacts("co-located", K, L, WIDTH, C, residency=residency)
    ess.ess_runtime = EssRuntime(EssArgs(enable=True, buffer_tokens=C), facts, table, host=ess.ess_host, device="cpu",
                                 backend="torch", kernel="torch")
    return stock, ess


@pytest.mark.parametrize("residency", [False, True])
def test_what_the_pool_and_runtime_hold_is_what_sizing_charges(plugin, residency):
    stock, ess = launch(residency)
    locations = SIZE + 64
    charged = sizing.ess_device_bytes(L, locations, REQUESTS + 1, C, WIDTH, 8, 100)
    assert ess.get_kv_size_bytes() == charged.total
    assert charged.slots == L * 64 * 656  # 5 rows x 12 slots + a sink, in whole pages
    assert charged.staging == 128 * 656  # row 0 and 100 rows, in whole pages
    assert stock.get_kv_size_bytes() == sizing.stock_device_bytes(L, locations)


def test_a_buffer_added_without_being_charged_is_measured(plugin):
    _, ess = launch(residency=True)
    charged = sizing.ess_device_bytes(L, SIZE + 64, REQUESTS + 1, C, WIDTH, 8, 100).total
    ess.ess_runtime.cache.extra = {"rows": [torch.zeros(10, dtype=torch.int32)]}
    assert ess.get_kv_size_bytes() == charged + 40
    ess.ess_scratch_copy = torch.zeros(3, dtype=torch.int64)
    assert ess.get_kv_size_bytes() == charged + 40 + 24


def test_views_and_the_host_pool_are_not_counted(plugin):
    _, ess = launch(residency=False)
    before = ess.get_kv_size_bytes()
    rt = ess.ess_runtime
    rt.keep_own_rows(0, ess.ess_scratch[1:3, 0])  # a view of the scratch
    ess.ess_host.add_(0)  # the host pool is no device memory
    assert ess.get_kv_size_bytes() == before


def test_the_pool_alone_holds_index_k_scratch_staging_and_map(plugin):
    stock, ess = launch(residency=False, stage_rows=16)
    ess.ess_runtime = None  # as SGLang logs it, before the runtime exists
    latent = L * (SIZE + 64) * 656
    index_k = stock.get_kv_size_bytes() - latent  # SGLang's count: latent + index-K of every location
    # ESS: index-K, the decode scratch (8 rows after the writer's reserved row 0) and its row index (int64), the
    # staging buffer (one page) and the location -> staging map
    assert ess.get_kv_size_bytes() == index_k + (1 + 8) * 656 + 8 * 8 + 64 * 656 + (SIZE + 65) * 4
    assert not ess.ess_host.is_cuda and ess.ess_host.shape == (L, SIZE + 65, 656)
