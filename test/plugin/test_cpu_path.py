"""The plugin's CPU path (sglang_ess.cpu): every patch point a real SGLang 0.5.23 target with the parameters its hook
relies on, and every torch kernel equal to the SGLang kernel it stands for: SGLang's own Triton kernels, run by
Triton's CPU interpreter in a child process (TRITON_INTERPRET must be set before Triton is imported), on the same
inputs; the indexer's logits and the sparse FP8 attention equal to ess.core.dsa_math, the reference model's math
(ess.reference.attention, equal to DeepSeek's official code)."""

import importlib
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("sglang")

from ess.core import layout  # noqa: E402
from ess.core.dsa_math import index_scores, sparse_attention  # noqa: E402
from sglang_ess.cpu import kernels  # noqa: E402


# the CPU path's, its stand-ins for SGLang's HiSparse, and its FP8 checkpoints without AMX
@pytest.mark.parametrize("table", ["patches", "hisparse", "fp8"])
def test_every_patch_target_is_a_real_sglang_target(plugin, table):
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_ess.cpu import resolution

    patches = importlib.import_module(f"sglang_ess.cpu.{table}")
    assert set(resolution.RESOLUTION_STEPS) <= _OVERRIDABLE_HOOKS
    assert {p.target for p in patches.PATCHES} == set(patches.EXPECTED_PARAMS)
    for p in patches.PATCHES:
        owner, attr = p.target.rsplit(".", 1)
        try:
            obj = importlib.import_module(owner)
        except ImportError:
            mod, cls = owner.rsplit(".", 1)
            obj = getattr(importlib.import_module(mod), cls)
        target = inspect.unwrap(getattr(obj, attr))
        params = list(inspect.signature(target.__func__ if inspect.ismethod(target) else target).parameters)
        want = patches.EXPECTED_PARAMS[p.target]
        assert params[: len(want)] == want, (p.target, params)
        assert p.target in HookRegistry._patched  # applied by SGLang's loader on this CUDA-less machine


# SGLang's kernels through Triton's interpreter, on inputs drawn from one seed; the results go back by torch.save.
SGLANG_SIDE = textwrap.dedent("""
    import sys, torch, triton
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate
    from sglang.kernels.ops.kvcache.dsa_index_k_cache import _set_k_and_s_triton, _get_k_and_s_triton
    from sglang.kernels.ops.attention.dsa.transform_index import (
        transform_index_page_table_decode, transform_index_page_table_prefill)
    from sglang.kernels.ops.attention.pad import seqlens_expand_kernel
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs

    g = torch.Generator().manual_seed(0)
    out = {}
    x = torch.randn(37, 4, 128, generator=g).bfloat16()
    out["act_quant"] = (x, act_quant(x, 128, "ue8m0"), act_quant(x, 128, None))
    nope = torch.randn(9, 1, 512, generator=g).bfloat16() * 3
    rope = torch.randn(9, 1, 64, generator=g).bfloat16()
    out["quantize_k_cache"] = (nope, rope, quantize_k_cache_separate(nope, rope))
    buf = torch.zeros(6, 64 * 132, dtype=torch.uint8)
    loc = torch.randperm(6 * 64, generator=g)[:100]
    k = (torch.randn(100, 128, generator=g) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(100, 1, generator=g)
    _set_k_and_s_triton(buf, loc, k, s, 64)
    pages = torch.tensor([[3, 1, 5], [0, 4, 2]])
    lens = torch.tensor([150, 70])
    out["index_k"] = (loc, k, s, buf.clone(), pages, lens, _get_k_and_s_triton(buf, pages, lens, 220, 150, 64, 128))
    table = torch.randint(0, 1000, (3, 300), generator=g, dtype=torch.int32)
    for width in (64, 2048):
        topk = torch.randint(-1, 300, (3, width), generator=g, dtype=torch.int32)
        out[f"decode_{width}"] = (table, topk, transform_index_page_table_decode(table, topk))
    topk = torch.randint(-1, 300, (11, 64), generator=g, dtype=torch.int32)
    out["prefill"] = (table, topk, transform_index_page_table_prefill(table, topk, [4, 7], output_num_tokens=13))
    q, kv = torch.tensor([2, 3], dtype=torch.int32), torch.tensor([40, 2], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    expanded = torch.empty(5, dtype=torch.int32)
    seqlens_expand_kernel[(2,)](q, kv, offsets, expanded, 2, BLOCK=triton.next_power_of_2(3))
    out["seqlens_expand"] = (q, kv, expanded)
    req, start, end = torch.tensor([2, 0, 1]), torch.tensor([5, 0, 9]), torch.tensor([8, 4, 10])
    tokens = torch.zeros(3, 300, dtype=torch.int32)
    new = torch.arange(100, 108, dtype=torch.int64)
    assign_req_to_token_pool[(3,)](req, tokens, start, end, new, 300, 4)
    out["assign_req"] = (req, start, end, new, tokens)
    locs = torch.empty(3 * 2, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(3,)](req, table, end, locs, 300, 1, 2, BS=3)
    out["draft_locs"] = (req, end, locs)
    ext = torch.full((3 * 4,), -7, dtype=torch.int64)
    assign_extend_cache_locs[(3,)](req, table, start, end, ext, 300, 4)
    out["extend_locs"] = (req, start, end, ext)
    torch.save(out, sys.argv[1])
""")


@pytest.fixture(scope="module")
def sglang_side(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "sglang.pt"
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", SGLANG_SIDE, str(path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(path)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3 rounded to nearest even, as a GPU's cvt.rn.satfinite (and torch) round. Triton 3.8's CPU
    interpreter casts float32 to FP8 wrongly (-1.998 becomes -1.0, 28 of 1,024 values in [-3, 3]), so the kernels'
    FP8 outputs are checked through their scales, which the interpreter computes in float32 exactly, and the kernel's
    own formula with this cast."""
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def test_act_quant_equals_sglangs_kernel(sglang_side):
    x, (_, s), (_, s_plain) = sglang_side["act_quant"]
    for fmt, want_s in (("ue8m0", s), (None, s_plain)):
        got, got_s = kernels.act_quant(x, 128, fmt)
        assert torch.equal(got_s, want_s)
        blocks = x.float().reshape(37, 4, 1, 128)  # the kernel: y = clamp(x / scale, -448, 448)
        want = to_fp8((blocks / want_s.unsqueeze(-1)).clamp(-448, 448)).reshape(x.shape)
        assert torch.equal(got.view(torch.uint8), want)


def test_latent_quantiser_equals_sglangs_kernel_and_the_row_format(sglang_side):
    nope, rope, (want_nope, want_rope) = sglang_side["quantize_k_cache"]
    got_nope, got_rope = kernels.quantize_k_cache_separate(nope, rope)
    assert torch.equal(got_rope, want_rope)
    scale = want_nope[:, 0, 512:].contiguous().view(torch.float32)  # [9, 4]
    assert torch.equal(got_nope[:, 0, 512:], want_nope[:, 0, 512:])
    tiles = nope[:, 0].float().reshape(9, 4, 128)  # the kernel: y = clamp(x * (1 / scale), -448, 448)
    want = to_fp8((tiles * (1.0 / scale).unsqueeze(-1)).clamp(-448, 448)).reshape(9, 512)
    assert torch.equal(got_nope[:, 0, :512], want)
    # the 656-byte row ESS moves: ess.core.layout's format, SGLang 0.5.23's "amax" scales
    rows = torch.cat([got_nope, got_rope], -1)[:, 0]
    assert torch.equal(rows, layout.quantize_latent(nope[:, 0].float(), rope[:, 0].float()))


def test_index_k_store_and_gather_equal_sglangs_kernels(sglang_side):
    loc, k, s, want_buf, pages, lens, (want_k, want_s) = sglang_side["index_k"]

    class Pool:
        index_page_size, index_head_dim = 64, 128

    buf = torch.zeros_like(want_buf)
    kernels.set_k_and_s(None, Pool, buf, loc, k, s)
    assert torch.equal(buf, want_buf)
    got_k, got_s = kernels.get_k_and_s(None, Pool, buf, pages, lens, 220, 150)
    assert torch.equal(got_k, want_k) and torch.equal(got_s, want_s)


def test_top_k_to_location_maps_equal_sglangs_kernels(sglang_side):
    for width in (64, 2048):
        table, topk, want = sglang_side[f"decode_{width}"]
        assert torch.equal(kernels.transform_index_page_table_decode(table, topk), want)
    table, topk, want = sglang_side["prefill"]
    assert torch.equal(kernels.transform_index_page_table_prefill(table, topk, [4, 7], output_num_tokens=13), want)


def test_mtp_bookkeeping_equals_sglangs_kernels(sglang_side):
    q, kv, want = sglang_side["seqlens_expand"]
    assert torch.equal(kernels.seqlens_expand(q, kv, 5, 3), want)
    req, start, end, new, want = sglang_side["assign_req"]
    tokens = torch.zeros_like(want)
    kernels.assign_req_to_token_pool(req, tokens, start, end, new, 3)
    assert torch.equal(tokens, want)
    table = sglang_side["decode_64"][0]
    req, end, want = sglang_side["draft_locs"]
    locs = torch.empty_like(want)
    kernels.assign_draft_cache_locs_contiguous(req, table, end, locs, 1, 2)
    assert torch.equal(locs, want)
    req, start, end, want = sglang_side["extend_locs"]
    got = kernels.assign_extend_cache_locs(req, table, start, end, 3, 4, "cpu")
    n = int((end - start).sum())
    assert torch.equal(got[:n], want[:n])  # the rest is unset by both


def test_indexer_logits_equal_the_reference_scores():
    """The CPU path's MQA logits over SGLang's paged index-K equal the reference's index_scores: FP8 queries with
    their scales folded into the head weights (as SGLang folds them) against the dequantised keys."""
    g = torch.Generator().manual_seed(1)
    H, T = 4, 150
    rows = layout.quantize_index_k(torch.randn(T + 42, 128, generator=g))  # 3 pages of 64
    buf = layout.index_k_rows_to_pages(rows)
    table = torch.tensor([[2, 0, 1], [1, 2, 0]])
    q = torch.randn(2, H, 128, generator=g)
    q_fp8, q_scale = kernels.act_quant(q.contiguous(), 128, "ue8m0")
    w = torch.rand(2, H, generator=g)
    keys = kernels.index_rows_of(buf, table, 64)  # [2, 192, 132]
    got = torch.stack([kernels.mqa_logits(q_fp8[b:b + 1], (w * q_scale[..., 0])[b:b + 1],
                                          layout.dequantize_index_k(keys[b]))[0] for b in range(2)])
    want = index_scores(layout.dequantize_index_k(layout.quantize_index_k(q)), w, keys)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys[0, :64], rows[128:192]) and torch.equal(keys[1, 64:128], rows[128:192])


def test_flashmla_interface_equals_the_reference_sparse_attention():
    """FlashMLA's sparse FP8 decode, as the CPU path computes it: the reference attention over the rows the indices
    name, heads padded with zeros as SGLang pads them (their output: the mean of the valid rows), lse in natural log,
    +inf for a row with no valid entry (the kernel's convention)."""
    from sglang_ess.cpu.flash_mla_interface import flash_mla_with_kvcache

    g = torch.Generator().manual_seed(2)
    N, H, live, K = 5, 64, 4, 16
    pool = layout.quantize_latent(torch.randn(256, 512, generator=g), torch.randn(256, 64, generator=g))
    idx = torch.randint(0, 256, (N, 1, K), generator=g, dtype=torch.int32)
    idx[1, 0, 5:] = -1
    idx[3] = -1  # no valid entry
    q = torch.zeros(N, 1, H, 576, dtype=torch.bfloat16)
    q[:, :, :live] = torch.randn(N, 1, live, 576, generator=g).bfloat16()
    o, lse = flash_mla_with_kvcache(q, pool.view(-1, 64, 1, 656), None, None, 512, None, softmax_scale=0.07,
                                    indices=idx, is_fp8_kvcache=True)
    assert o.shape == (N, 1, H, 512) and o.dtype == torch.bfloat16 and lse.shape == (N, H, 1)
    qf = q[:, 0, :live].float()
    valid = idx[:, 0] >= 0
    want, want_lse = sparse_attention(qf[..., :512], qf[..., 512:], pool[idx[:, 0].long().clamp(min=0)], valid, 0.07)
    ok = valid.any(1)
    assert torch.equal(o[ok, 0, :live], want[ok].bfloat16()) and torch.equal(lse[ok, :live, 0], want_lse[ok])
    assert (lse[3] == torch.inf).all() and (o[3] == 0).all()
    mean = layout.dequantize_latent(pool[idx[0, 0].long()])[0].mean(0)
    torch.testing.assert_close(o[0, 0, live:].float(), mean.bfloat16().float().expand(H - live, -1))


def test_sglangs_row_writer_on_the_cpu_never_writes_row_0(plugin):
    """SGLang's MLA row writer (DSATokenToKVPool._write_mla_kv_buffer: the FP8 quantiser, then its scatter) skips
    destination row 0, the location SGLang reserves for CUDA-graph padding; on the CPU path it is SGLang's own torch
    scatter with the CPU quantiser. ESS hands it rows of its own buffers, from row 1 on (sglang_ess.sizing.FIRST_ROW)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from sglang_ess.sizing import FIRST_ROW

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        pool = DSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                                qk_rope_head_dim=64, layer_num=1, device="cpu", index_head_dim=128,
                                enable_memory_saver=False, kv_cache_dim=656, start_layer=0, end_layer=1)
        buf = torch.zeros(4, 1, 656, dtype=torch.uint8)
        nope, rope = torch.randn(3, 1, 512).bfloat16(), torch.randn(3, 1, 64).bfloat16()
        pool._write_mla_kv_buffer(buf, torch.tensor([0, 1, 2]), nope, rope)
    assert (buf[0] == 0).all() and (buf[1:3] != 0).any(dim=-1).all()  # row 0 never written
    assert torch.equal(buf[1:3, 0], layout.quantize_latent(nope[1:, 0].float(), rope[1:, 0].float()))
    assert FIRST_ROW == 1


def test_a_nodes_ranks_count_data_parallel_replicas():
    """Each rank pins its own host pool: a node's ranks are its tensor x pipeline ranks, times the DP replicas unless
    DP attention keeps them inside the tensor ranks."""
    import types

    from sglang_ess.sizing import node_ranks

    args = dict(tp_size=4, pp_size=1, nnodes=1, dp_size=2)
    assert node_ranks(types.SimpleNamespace(**args, enable_dp_attention=False)) == 8
    assert node_ranks(types.SimpleNamespace(**args, enable_dp_attention=True)) == 4
    assert node_ranks(types.SimpleNamespace(tp_size=16, pp_size=1, nnodes=2, dp_size=16, enable_dp_attention=True)) == 8


def test_the_nixl_agent_on_the_cpu_is_asked_for_host_memory():
    """SGLang asks NIXL for "VRAM" (its KV and state buffers); on the CPU the wrapped agent is asked for "DRAM", in
    positional and keyword arguments, and everything else (arrays, names, attributes) passes unchanged. The real agent
    runs in test_pd_nixl.py; this stand-in only records calls."""
    import numpy as np

    from sglang_ess.cpu.patches import _HostMemoryAgent

    class Recorder:
        name = "agent-0"

        def register_memory(self, *args, **kwargs):
            return args, kwargs

    agent = _HostMemoryAgent(Recorder())
    descs = np.array([[1, 2, 0]])
    args, kwargs = agent.register_memory(descs, "VRAM", backends=["UCX"], mem_type="VRAM")
    assert args[0] is descs and args[1] == "DRAM" and kwargs == {"backends": ["UCX"], "mem_type": "DRAM"}
    assert agent.register_memory("DRAM")[0] == ("DRAM",) and agent.name == "agent-0"
