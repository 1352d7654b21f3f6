"""Fixtures of the plugin tests.

Torch references for the GPU kernels that SGLang's DSA decode path calls (fixture `torch_kernels`). Only
kernels are replaced; every SGLang class and entry point around them is the installed one.

    FlashMLA (sglang.kernels.ops.attention.flash_mla_interface, which loads FlashMLA's CUDA library at import):
        get_mla_metadata, flash_mla_with_kvcache (sparse decode over 656-byte FP8 rows) and flash_mla_sparse_fwd
    SGLang's FP8 MLA quantiser (DSATokenToKVPool._write_mla_kv_buffer, a Triton kernel): ESS's reference of the
        same 656-byte row format (ess.core.layout.quantize_latent)
    the top-k v2 planner (sglang.kernels.ops.attention.dsv4.topk.plan_topk_v2, a CUDA JIT kernel): its plan only
        feeds the fused top-k kernel, which a sparse-offload coordinator (ESS) turns off in decode
    the indexer's un-fused top-k (DSATopKBackend.topk_func, which only calls sgl_kernel's fast_topk_v2): the best
        `topk` columns below each row's length, best first, -1 padded
"""

import os
import sys
import types

import pytest
import torch

from ess.core import layout
from ess.reference import flashmla


@pytest.fixture(scope="session")
def plugin():
    """SGLang's own plugin loader, restricted to ESS: its hooks then wrap the real sglang classes."""
    pytest.importorskip("sglang")
    os.environ["SGLANG_PLUGINS"] = "ess"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ess import hooks

    return hooks


FLASH_MLA_INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"


def get_mla_metadata(**kw):
    return None, None  # scheduling metadata of the CUDA kernel; the reference needs none


def flash_mla_with_kvcache(q, k_cache, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale=None, indices=None, block_table=None, is_fp8_kvcache=True,
                           kv_format="V32", **kw):
    """FlashMLA's sparse FP8 decode: q [N, 1, H, 576] bf16, k_cache [pages, 64, 1, 656] (FP8 rows), indices
    [N, 1, K] rows of the flattened cache (-1 skipped). Returns (o [N, 1, H, 512] bf16, lse [N, H, 1])."""
    assert is_fp8_kvcache and head_dim_v == 512 and indices is not None
    pool = k_cache.view(torch.uint8).reshape(-1, layout.LATENT_ROW_BYTES)
    q = q[:, 0].float()
    o, lse = flashmla.sparse_decode(q[..., :512], q[..., 512:], pool, indices[:, 0], softmax_scale, "reference")
    return o.unsqueeze(1).to(torch.bfloat16), lse.unsqueeze(-1)


def flash_mla_sparse_fwd(**kw):
    raise AssertionError("the DSA decode test runs FlashMLA's FP8 decode (flashmla_kv), not the sparse prefill kernel")


def write_mla_kv_buffer(self, dst_buffer, loc, cache_k_nope, cache_k_rope):
    """SGLang's quantiser contract: the FP8 656-byte rows of (k_nope [N, 1, 512], k_rope [N, 1, 64]) at loc."""
    rows = layout.quantize_latent(cache_k_nope.float().reshape(-1, 512), cache_k_rope.float().reshape(-1, 64))
    dst_buffer.view(torch.uint8)[loc.long(), 0] = rows


def topk_func(self, score, lengths, topk, row_starts=None):
    """The indexer's un-fused top-k: the best `topk` columns below each row's length, best first, -1 padded."""
    col = torch.arange(score.shape[1], device=score.device)
    masked = torch.where(col < lengths.reshape(-1, 1), score.float(), -torch.inf)
    vals, idx = torch.topk(masked, min(topk, score.shape[1]), dim=1)
    out = torch.where(vals > -torch.inf, idx, -1).to(torch.int32)
    return torch.nn.functional.pad(out, (0, topk - out.shape[1]), value=-1)


@pytest.fixture
def torch_kernels(monkeypatch):
    """The references below in place of SGLang's GPU kernels, for one test."""
    from sglang.kernels.ops.attention.dsv4 import topk
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    fmi = types.ModuleType(FLASH_MLA_INTERFACE)
    fmi.get_mla_metadata = get_mla_metadata
    fmi.flash_mla_with_kvcache = flash_mla_with_kvcache
    fmi.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    monkeypatch.setitem(sys.modules, FLASH_MLA_INTERFACE, fmi)
    monkeypatch.setattr(topk, "plan_topk_v2", lambda seqlens: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(DSATokenToKVPool, "_write_mla_kv_buffer", write_mla_kv_buffer)
    monkeypatch.setattr(DSATopKBackend, "topk_func", topk_func)
