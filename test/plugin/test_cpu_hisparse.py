"""SGLang's own HiSparse (`--enable-hisparse`) on the CPU path (sglang_ess.cpu.hisparse; its targets are checked with
the CPU path's in test_cpu_path): the torch swap-in against the contract of SGLang's JIT
kernel (kvcacheio/hisparse.cuh, load_cache_to_device_buffer_kernel) on a hand-checked case; the host backup against
its definition, through a real unpinned host pool; and a real HiSparse server whose greedy tokens equal stock
SGLang's, request by request, on prompts longer than its hot buffer (so the LRU swap-in fetches rows from host)."""

import pytest
import torch

pytest.importorskip("sglang")

from ess.reference import checkpoint  # noqa: E402
from ess.harness import servers as S  # noqa: E402
from sglang_ess.cpu import hisparse  # noqa: E402

HISPARSE_FLAGS = ["--enable-hisparse", "--hisparse-config", '{"top_k":64,"device_buffer_size":128}']
NEW_TOKENS = 24


def swap_in_case(skip_io=False):
    """Four batch rows (K=5, HOT=6, 16-byte rows), the last one padding:
    row 0, request slot 2, seq_len 3 <= HOT: the fast path;
    row 1, request slot 1, seq_len 10: newest 9, hits 4 and 1, misses 7 then 8 (LRU 3 0 5 1 4 2);
    row 2, request slot 0, seq_len 8: newest 7, hits 0 5 3, miss 6 (LRU 0 1 2 3 4 5)."""
    K, HOT, ITEM = 5, 6, 16
    locs = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34, 35, 36],
                         [0] * 7], dtype=torch.int32)
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5, -1]] * 4, dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 0, 5, 1, 4, 2], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]],
                       dtype=torch.int16)
    host_locs = torch.full((4, 16), -1, dtype=torch.int64)
    host_locs[1, 7], host_locs[1, 8], host_locs[0, 6] = 11, 5, 2
    host = torch.arange(20 * ITEM, dtype=torch.int64).remainder(251).to(torch.uint8).view(20, 1, ITEM)
    device = torch.zeros(40, 1, ITEM, dtype=torch.uint8)
    top_k = torch.tensor([[2, 0, -1, 1, 1], [7, 9, 4, 8, 1], [6, 7, 0, 5, 3], [1, 2, 3, 4, 5]], dtype=torch.int32)
    out = torch.full((4, K), 99, dtype=torch.int32)
    hisparse.load_cache_to_device_buffer_mla(
        top_k_tokens=top_k, device_buffer_tokens=tokens, host_cache_locs=host_locs, device_buffer_locs=locs,
        host_cache=host, device_buffer=device, top_k_device_locs=out,
        req_pool_indices=torch.tensor([2, 1, 0, 3]), seq_lens=torch.tensor([3, 10, 8, 20]), lru_slots=lru,
        item_size_bytes=ITEM, num_top_k=K, hot_buffer_size=HOT, num_real_reqs=torch.tensor([3], dtype=torch.int32), skip_io=skip_io)
    return out, tokens, lru, host, device


def test_swap_in_follows_the_kernels_contract():
    out, tokens, lru, host, device = swap_in_case()
    assert out[0].tolist() == [32, 30, -1, -1, -1]  # fast path: locs[top_k] for the first min(seq_len, K) entries, -1 kept
    assert out[1].tolist() == [23, 26, 24, 20, 21]  # 7 -> slot 3, newest -> slot HOT, 4 hit, 8 -> slot 0, 1 hit
    assert out[2].tolist() == [11, 16, 10, 15, 13]  # 6 -> slot 1 (first non-hit in LRU order), newest, hits
    assert out[3].tolist() == [-1] * 5  # padding row
    # misses record their tokens; the LRU order is unused evictables, the misses' slots, then the hits (old order)
    assert tokens[1, :6].tolist() == [8, 1, 2, 7, 4, 5] and lru[1].tolist() == [5, 2, 3, 0, 1, 4]
    assert tokens[0, :6].tolist() == [0, 6, 2, 3, 4, 5] and lru[0].tolist() == [2, 4, 1, 0, 3, 5]
    assert tokens[2].tolist() == [0, 1, 2, 3, 4, 5, -1] and lru[2].tolist() == [0, 1, 2, 3, 4, 5]  # fast path: as is
    # each miss's host row copied to its slot's device row, nothing else written
    want = torch.zeros_like(device)
    want[23], want[20], want[11] = host[11], host[5], host[2]
    assert torch.equal(device, want)


def test_swap_in_counts_its_host_rows_and_skip_io_copies_none():
    before = dict(hisparse.COUNTS)
    swap_in_case()
    assert hisparse.COUNTS["swap_ins"] == before["swap_ins"] + 1
    assert hisparse.COUNTS["host_rows"] == before["host_rows"] + 3
    out, _, lru, _, device = swap_in_case(skip_io=True)  # SGLANG_DEBUG_HISPARSE_SKIP_IO: the same plan, no bytes
    assert out[1].tolist() == [23, 26, 24, 20, 21] and lru[1].tolist() == [5, 2, 3, 0, 1, 4]
    assert not device.any()


def test_host_pool_is_unpinned_and_backup_copies_the_rows_asked(plugin):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    g = torch.Generator().manual_seed(0)
    bufs = tuple(torch.randint(0, 256, (64 * 3, 1, 656), dtype=torch.uint8, generator=g) for _ in range(2))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=(0, 1), device_layer_num=2, page_size=64, kv_lora_rank=512,
                         qk_rope_head_dim=64, kv_cache_dim=656, dtype=torch.uint8, device=torch.device("cpu"),
                         packed_fp8=True)
    host = MLATokenToKVPoolHost(buffer_info=info, host_to_device_ratio=2, host_size=0, page_size=64,
                                layout="layer_first", override_kv_cache_dim=656, device_capacity_tokens=64 * 3,
                                start_layer=0, end_layer=2, target_layer_num=2)  # pin_memory defaults to True
    assert host.pin_memory is False
    host.kv_buffer.zero_()
    h, d = torch.tensor([5, 70, 3, 300]), torch.tensor([1, 130, 64, 191])
    host.backup_from_device_all_layer(None, h, d, io_backend="kernel")
    want = torch.zeros_like(host.kv_buffer)
    for layer in range(2):
        want[layer][h] = bufs[layer][d]
    assert torch.equal(host.kv_buffer, want)


def test_cpu_streams_synchronize_and_the_per_step_tensor_is_unpinned():
    hisparse._CpuStream().synchronize()
    assert torch.equal(hisparse._UnpinnedTorch().tensor([1, 2], dtype=torch.int64, device="cpu", pin_memory=True),
                       torch.tensor([1, 2]))


def test_hisparse_server_gives_stock_tokens(tmp_path):
    """Stock SGLang and HiSparse (top-k 64, a hot buffer of 128 rows) on the tiny checkpoint, both without the radix
    cache (same batches): eight prompts of 200 to 420 tokens, 24 greedy tokens each, equal request by request."""
    model = tmp_path / "ckpt"
    model.mkdir()
    checkpoint.write(str(model), seed=0)
    plain = ["--disable-radix-cache"]
    servers = {"stock": S.Server(str(model), S.CPU_FLAGS + plain, str(tmp_path / "stock.log")),
               "hisparse": S.Server(str(model), S.CPU_FLAGS + plain + HISPARSE_FLAGS, str(tmp_path / "hisparse.log"))}
    prompts = S.prompts(8, (200, 420), seed=0)
    with S.terminate_as_exit():
        try:
            S.start_all(list(servers.values()))
            answers = {name: srv.generate(prompts, NEW_TOKENS) for name, srv in servers.items()}
            log = servers["hisparse"].log()
        finally:
            for srv in servers.values():
                srv.stop()
    stock, hs = ([a["output_ids"] for a in answers[n]] for n in ("stock", "hisparse"))
    assert all(len(t) == NEW_TOKENS for t in hs)
    assert [a == b for a, b in zip(hs, stock)] == [True] * 8
    assert "Allocating kv hierarchical KV host pool" in log
    assert "HiSparse CPU swap-in: first host fetch" in log  # the slow path ran and read rows from the host pool
