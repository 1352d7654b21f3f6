"""The CPU path's stand-ins for SGLang's HiSparse (`--enable-hisparse`, its sparse-attention KV offload to host).

HiSparse keeps every token's latent row in a host pool and a small LRU hot buffer per request on the device; each
decode layer swaps the indexer's top-k into that buffer. Off CUDA five things fail: the host pool pins its memory
(cudaHostRegister), the host backup and the swap-in are CUDA JIT kernels, the decode backup builds a pinned tensor
every step, and torch.cpu.Stream has no synchronize(). On the CPU path (`--device cpu`) each is done in torch here,
as one sglang_ess.hooks.table (SGLang target, hook type, hook, the parameters it reads, why); every hook acts only
for CPU tensors or a CPU coordinator and leaves CUDA to SGLang's own code. docs/cpu-path.md, "SGLang\'s HiSparse on the CPU path".
"""

from __future__ import annotations

import importlib
import inspect
import logging

import torch

from sglang.srt.plugins.hook_registry import HookType
from sglang_ess.cpu.patches import on_cpu
from sglang_ess.cpu.resolution import replaced
from sglang_ess.hooks.table import Hook, expected_params

logger = logging.getLogger(__name__)

HOST_POOL = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"
COORDINATOR_MODULE = "sglang.srt.managers.hisparse_coordinator"
COORDINATOR = f"{COORDINATOR_MODULE}.HiSparseCoordinator"

COUNTS = {"swap_ins": 0, "host_rows": 0}  # this process's swap-in calls and rows fetched from host


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def around_host_pool_init(original, self, buffer_info, *args, **kwargs):
    """The host pool of a CPU device pool is built unpinned: SGLang's own pin_memory=False path (a plain allocation
    and an unregistered pointer table); pinning would call cudaHostRegister (no driver: RuntimeError)."""
    if not _is_cpu(getattr(buffer_info, "device", None)):
        return original(self, buffer_info, *args, **kwargs)
    bound = inspect.signature(original).bind(self, buffer_info, *args, **kwargs)
    bound.arguments["pin_memory"] = False
    return original(*bound.args, **bound.kwargs)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A per-layer KV tensor [rows, ...] as its rows of bytes [rows, bytes] (a view: writes go to t)."""
    return t.flatten(1).view(torch.uint8)


def around_backup(original, self, device_pool, host_indices, device_indices, io_backend, *args, **kwargs):
    """MLATokenToKVPoolHost.backup_from_device_all_layer (layer_first, kernel IO): for every layer, host row
    host_indices[i] = device row device_indices[i] (token_stride_size bytes each), as SGLang's transfer kernels do."""
    buffers = getattr(self, "device_kv_buffers", ())
    if (not buffers or buffers[0].device.type != "cpu" or self.layout != "layer_first" or io_backend != "kernel"
            or self._layer_shard_enabled or self.dcp_size != 1):
        return original(self, device_pool, host_indices, device_indices, io_backend, *args, **kwargs)
    host_idx, dev_idx = host_indices.long(), device_indices.long()
    width = self.token_stride_size
    for layer, device_buffer in enumerate(buffers):
        _rows(self.kv_buffer[layer])[host_idx, :width] = _rows(device_buffer)[dev_idx, :width]


class _UnpinnedTorch:
    """torch, except that torch.tensor(..., pin_memory=True) is not pinned (a CPU has no page-locked copy to do)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, pin_memory=False, **kwargs):
        return torch.tensor(*args, **kwargs)


def around_eager_backup(original, self, *args, **kwargs):
    """HiSparseCoordinator._eager_backup_previous_token builds its index tensor with pin_memory=True every decode
    step (no driver: RuntimeError): on a CPU coordinator it runs with the module's torch unpinned."""
    if not _is_cpu(self.device):
        return original(self, *args, **kwargs)
    with replaced(importlib.import_module(COORDINATOR_MODULE), "torch", _UnpinnedTorch()):
        return original(self, *args, **kwargs)


class _CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream with synchronize(): CPU work is done when it returns, there is nothing to wait for."""

    def synchronize(self) -> None:
        return None


def after_coordinator_init(result, self, *args, **kwargs):
    """HiSparseCoordinator's streams synchronize() in destroy() and abort_staging_request(), which torch.cpu.Stream
    lacks (AttributeError): a CPU coordinator's streams are _CpuStream."""
    if _is_cpu(self.device):
        for name in ("write_staging_stream", "decode_backup_stream", "prefetch_stream"):
            if isinstance(getattr(self, name, None), torch.cpu.Stream):
                setattr(self, name, _CpuStream())


def _byte_rows(t: torch.Tensor, item_size_bytes: int) -> torch.Tensor:
    """The kernel's generic addressing: row r is item_size_bytes bytes at byte r * item_size_bytes of t."""
    assert t.is_contiguous(), "the swap-in addresses its caches by byte stride"
    flat = t.reshape(-1).view(torch.uint8)
    return flat[: flat.numel() // item_size_bytes * item_size_bytes].view(-1, item_size_bytes)


def load_cache_to_device_buffer_mla(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                                    host_cache, device_buffer, top_k_device_locs, req_pool_indices, seq_lens,
                                    lru_slots, item_size_bytes, num_top_k, hot_buffer_size, page_size=1,
                                    block_size=256, num_real_reqs=None, miss_src=None, miss_dst=None,
                                    miss_count=None, skip_io=False):
    """SGLang's swap-in kernel (kernels/jit/csrc/kvcacheio/hisparse.cuh, load_cache_to_device_buffer_kernel, generic
    MLA layout) in torch, one request at a time (a CPU rehearsal stand-in: the kernel runs one block per request).
    Per request: a sequence that fits the hot buffer reads its rows in place; otherwise the newest token is the slot
    after the buffer, top-k tokens an LRU slot holds are hits, and the m-th miss (in top-k order) takes the m-th
    non-hit slot in LRU order and its host row; the new LRU order is the unused slots, the misses', then the hits'."""
    if miss_src is not None:
        raise NotImplementedError("HiSparse shared-index prefetch (miss plan) has no CPU stand-in")
    COUNTS["swap_ins"] += 1
    K, hot = num_top_k, hot_buffer_size
    real = int(num_real_reqs[0]) if num_real_reqs is not None else top_k_tokens.shape[0]
    top_k_device_locs[real:, :K] = -1  # the rows a padded batch adds
    host_rows = dev_rows = None
    arange = torch.arange(K, device=top_k_tokens.device)
    for b in range(min(real, top_k_tokens.shape[0])):
        req, seq_len = int(req_pool_indices[b]), int(seq_lens[b])
        topk = top_k_tokens[b, :K].long()
        locs, tokens, lru = device_buffer_locs[req], device_buffer_tokens[req], lru_slots[req]
        out = top_k_device_locs[b, :K]
        if seq_len <= hot:  # fast path: the buffer holds positions 0..seq_len-1 in order
            valid = (arange < min(seq_len, K)) & (topk >= 0)
            out.copy_(torch.where(valid, locs[topk.clamp(min=0)].to(out.dtype), -1))
            continue
        newest = topk == seq_len - 1
        wanted = (topk >= 0) & ~newest
        order = lru.long()  # slots, least recently used first
        held = tokens[order].long()
        # the LRU position of the slot holding each position (-1: none)
        where = torch.full((seq_len,), -1, dtype=torch.long, device=topk.device)
        ok = (held >= 0) & (held < seq_len)
        where[held[ok]] = torch.nonzero(ok).flatten()
        pos = torch.where(wanted, where[topk.clamp(0, seq_len - 1)], -1)
        hit, miss = pos >= 0, wanted & (pos < 0)
        is_hit = torch.zeros(hot, dtype=torch.bool, device=topk.device)
        is_hit[pos[hit]] = True
        evictable, hits = order[~is_hit], order[is_hit]
        n = int(miss.sum())
        taken = evictable[:n]  # the m-th miss takes the m-th evictable slot
        out.fill_(-1)
        out[newest] = locs[hot].to(out.dtype)
        out[hit] = locs[order[pos[hit]]].to(out.dtype)
        out[miss] = locs[taken].to(out.dtype)
        tokens[taken] = topk[miss].to(tokens.dtype)
        lru.copy_(torch.cat([evictable[n:], taken, hits]).to(lru.dtype))
        if n and not skip_io:
            if host_rows is None:
                host_rows = _byte_rows(host_cache, item_size_bytes)
                dev_rows = _byte_rows(device_buffer, item_size_bytes)
            dev_rows[locs[taken].long()] = host_rows[host_cache_locs[req, topk[miss]].long()]
            if COUNTS["host_rows"] == 0:
                logger.info("HiSparse CPU swap-in: first host fetch (%d rows, request slot %d, seq_len %d)",
                            n, req, seq_len)
            COUNTS["host_rows"] += n


SWAP_IN_PARAMS = ("top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs", "host_cache",
                  "device_buffer", "top_k_device_locs", "req_pool_indices", "seq_lens", "lru_slots",
                  "item_size_bytes", "num_top_k", "hot_buffer_size", "page_size", "block_size", "num_real_reqs",
                  "miss_src", "miss_dst", "miss_count", "skip_io")

PATCHES = [
    Hook(f"{HOST_POOL}.__init__", HookType.AROUND, around_host_pool_init, ("self", "buffer_info"),
         "pins the host pool with cudaHostRegister through torch.cuda.cudart() (no driver: RuntimeError)"),
    Hook(f"{HOST_POOL}.backup_from_device_all_layer", HookType.AROUND, around_backup,
         ("self", "device_pool", "host_indices", "device_indices", "io_backend"),
         "a JIT HiCache kernel on CUDA, else sgl_kernel's transfer_kv_all_layer_mla (not defined off CUDA: NameError)"),
    Hook(f"{COORDINATOR}._eager_backup_previous_token", HookType.AROUND, around_eager_backup, ("self",),
         "torch.tensor(..., pin_memory=True) every decode step (no driver: RuntimeError)"),
    Hook(f"{COORDINATOR}.__init__", HookType.AFTER, after_coordinator_init, ("self",),
         "destroy() and abort_staging_request() call Stream.synchronize(), which torch.cpu.Stream lacks"),
    # the coordinator's own name: it imported the kernel's wrapper from sglang.kernels.ops.kvcache.hisparse
    Hook(f"{COORDINATOR_MODULE}.load_cache_to_device_buffer_mla", HookType.AROUND,
         on_cpu("top_k_tokens", load_cache_to_device_buffer_mla), SWAP_IN_PARAMS,
         "the LRU swap-in is a CUDA JIT kernel (kvcacheio/hisparse.cuh): no CUDA architecture to build for"),
]

EXPECTED_PARAMS = expected_params(PATCHES)  # the tests' view: target -> the parameters its hook reads
