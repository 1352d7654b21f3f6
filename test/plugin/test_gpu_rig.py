"""The GPU rig (python/ess_gpu_rig, docs/gpu-server.md): its patch targets exist in the installed SGLang with the
parameters its hooks read, its torch replacements compute what the JIT kernels they stand for compute, and its
sgl_kernel stand-in gives weak_ref_tensor and refuses the rest. The rig itself runs only on the GPU machine
(benchmark/gpu/server.sh); CI rehearses that command on the CPU path (scripts/gpu_rehearsal.sh)."""

import importlib
import importlib.util
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sglang")

from ess.core import flashtrans, layout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RIG = os.path.join(ROOT, "python", "ess_gpu_rig")


def _load_rig():
    """The rig as server.sh's PYTHONPATH gives it (it is not installed: pyproject.toml leaves it out)."""
    if "ess_gpu_rig" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ess_gpu_rig", os.path.join(RIG, "__init__.py"),
                                                      submodule_search_locations=[RIG])
        sys.modules["ess_gpu_rig"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return importlib.import_module("ess_gpu_rig.patches")


patches = _load_rig()


def _resolve(target: str):
    owner, attr = target.rsplit(".", 1)
    try:
        obj = importlib.import_module(owner)
    except ImportError:
        mod, cls = owner.rsplit(".", 1)
        obj = getattr(importlib.import_module(mod), cls)
    return getattr(obj, attr)


def test_every_target_exists_with_the_parameters_its_hook_reads():
    assert {p.target for p in patches.PATCHES} == set(patches.EXPECTED_PARAMS)
    for p in patches.PATCHES:
        target = inspect.unwrap(_resolve(p.target))
        params = list(inspect.signature(target).parameters)
        want = patches.EXPECTED_PARAMS[p.target]
        assert params[: len(want)] == want, (p.target, params)
        assert p.why


def test_hadamard_transform_is_the_walsh_hadamard_transform_times_scale():
    x = torch.randn(5, 3, 128)
    h = torch.ones(1, 1)
    while h.shape[0] < 128:  # Sylvester's construction, unnormalised
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    for scale in (1.0, 128**-0.5):
        torch.testing.assert_close(patches.hadamard_transform(x, scale), x @ h * scale, rtol=1e-5, atol=1e-4)
    assert patches.hadamard_transform(x.bfloat16(), 0.5).dtype == torch.bfloat16


def test_concat_gemm_metadata_and_store():
    q_nope, q_rope = torch.randn(3, 4, 512), torch.randn(3, 4, 64)
    assert torch.equal(patches.concat_mla_absorb_q(q_nope, q_rope), torch.cat([q_nope, q_rope], -1))
    a, b = torch.randn(4, 64), torch.randn(64, 32)
    out = torch.empty(4, 32)
    assert torch.equal(patches.dsv3_fused_a_gemm(a, b), a @ b)
    assert patches.dsv3_fused_a_gemm(a, b, out) is out and torch.equal(out, a @ b)
    meta = patches.paged_mqa_logits_metadata(torch.tensor([5, 9]), 64, 132)
    assert meta.shape == (133, 2) and meta.dtype == torch.int32
    assert patches.no_fused_store(torch.bfloat16, torch.int64, 64) is False


@pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8's interpreter")
@pytest.mark.parametrize("next_n", [1, 2])
def test_the_logits_patch_equals_sglangs_torch_logits_it_replaces(monkeypatch, next_n):
    """ESS's kernel over SGLang's pages (Triton's interpreter here) against SGLang's own torch logits, called as the
    rig's SGLang calls them: equal at every position within each row's context, on values every product and sum of
    which is exact in bf16 and fp32; -inf past the context, where SGLang's writes 0 and its top-k masks by length."""
    from sglang.srt.layers.attention.dsa import utils

    from ess.core import indexer_kernel

    monkeypatch.setattr(indexer_kernel, "kernel_backend", lambda backend, device, what: "interpret")
    g = torch.Generator().manual_seed(0)
    B, H, P, S = 3, 8, 3, 11
    ternary = lambda *shape: (torch.randint(0, 3, shape, generator=g) - 1).float()  # noqa: E731
    rows = torch.zeros(S * 64, 132, dtype=torch.uint8)
    rows[:, :128] = ternary(S * 64, 128).to(torch.float8_e4m3fn).view(torch.uint8)
    rows[:, 128:] = torch.ones(S * 64).view(torch.uint8).view(-1, 4)  # scale 1.0
    kv_cache = layout.index_k_rows_to_pages(rows).view(S, 64, 1, 132)
    q_fp8 = ternary(B, next_n, H, 128).to(torch.float8_e4m3fn)
    weights = torch.randint(-2, 3, (B * next_n, H), generator=g).float()
    block_table = torch.randperm(S, generator=g)[: B * P].view(B, P).int()
    lens = torch.tensor([150, 64, 1])
    context_lens = lens.view(B, 1) + torch.arange(next_n) - next_n + 1  # each query row's own context
    got = patches.fp8_paged_mqa_logits(q_fp8, kv_cache, weights, context_lens, block_table, None, P * 64)
    # SGLang's torch logits take one query row a request: the rows of each request given their own table row
    flat_lens = context_lens.reshape(-1)
    want = utils._fp8_paged_mqa_logits_torch(q_fp8.reshape(B * next_n, 1, H, 128), kv_cache, weights, flat_lens,
                                             block_table.repeat_interleave(next_n, 0), None, P * 64)
    inside = torch.arange(P * 64) < flat_lens[:, None]
    assert got.shape == want.shape == (B * next_n, P * 64) and got.dtype == torch.float32
    assert torch.equal(got[inside], want[inside]) and bool((got[~inside] == -math.inf).all())
    with pytest.raises(ValueError, match="indices"):
        patches.fp8_paged_mqa_logits(q_fp8, kv_cache, weights, context_lens, block_table, None, P * 64,
                                     indices=torch.zeros(1))


@pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8's interpreter")
def test_the_prefill_logits_patch_equals_sglangs_torch_logits_it_replaces(monkeypatch):
    """Prefill: each query row over its window [ks, ke) of the batch's gathered index-K, against SGLang's own torch
    prefill logits on exact values: equal inside every window, -inf outside (SGLang's: 0), its padded row stride."""
    from sglang.srt.layers.attention.dsa import utils

    from ess.core import indexer_kernel

    monkeypatch.setattr(indexer_kernel, "kernel_backend", lambda backend, device, what: "interpret")
    g = torch.Generator().manual_seed(1)
    M, H, N = 6, 8, 202
    ternary = lambda *shape: (torch.randint(0, 3, shape, generator=g) - 1).float()  # noqa: E731
    k_fp8, k_scale = ternary(N, 128).to(torch.float8_e4m3fn), torch.ones(N)
    q_fp8, weights = ternary(M, H, 128).to(torch.float8_e4m3fn), torch.randint(-2, 3, (M, H), generator=g).float()
    ks, ke = torch.tensor([0, 0, 0, 120, 120, 120], dtype=torch.int32), torch.tensor([1, 60, 120, 121, 170, 202],
                                                                                   dtype=torch.int32)
    got = patches.fp8_mqa_logits(q_fp8, (k_fp8, k_scale), weights, ks, ke)
    want = utils._fp8_mqa_logits_torch(q_fp8, (k_fp8, k_scale), weights, ks, ke)
    inside = (torch.arange(N) >= ks[:, None]) & (torch.arange(N) < ke[:, None])
    assert got.shape == want.shape == (M, N) and got.stride(0) == want.stride(0) == 204
    assert torch.equal(got[inside], want[inside]) and bool((got[~inside] == -math.inf).all())
    with pytest.raises(ValueError, match="clean_logits"):
        patches.fp8_mqa_logits(q_fp8, (k_fp8, k_scale), weights, ks, ke, clean_logits=True)


def test_the_logits_rows_are_registered_unless_torch_logits_are_asked_for(monkeypatch):
    ess_gpu_rig = sys.modules["ess_gpu_rig"]
    assert set(patches.LOGITS_TARGETS) <= {p.target for p in patches.patches_for("ess")}
    assert set(patches.PATCHES) - set(patches.patches_for("torch")) == {
        p for p in patches.PATCHES if p.target in patches.LOGITS_TARGETS}
    assert ess_gpu_rig.logits() == "ess"
    monkeypatch.setenv(ess_gpu_rig.LOGITS_ENV, "deepgemm")
    with pytest.raises(ValueError, match=ess_gpu_rig.LOGITS_ENV):
        ess_gpu_rig.logits()


STANDIN_CHECK = """
import ess_gpu_rig, sgl_kernel, torch
t = torch.arange(3)
assert sgl_kernel.weak_ref_tensor(t) is t
assert ess_gpu_rig.active()
from sgl_kernel.flash_attn import flash_attn_varlen_func
try:
    sgl_kernel.rmsnorm(t)
except NotImplementedError as e:
    assert "sgl_kernel.rmsnorm" in str(e)
else:
    raise AssertionError("a kernel the rig does not give must raise")
print("ok")
"""


def test_the_standin_gives_weak_ref_tensor_and_refuses_the_rest():
    python = os.path.join(ROOT, "python")
    env = dict(os.environ, ESS_GPU_RIG="1",
               PYTHONPATH=os.pathsep.join([os.path.join(python, "ess_gpu_rig", "standin"), python, ROOT]))
    done = subprocess.run([sys.executable, "-c", STANDIN_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    env.pop("ESS_GPU_RIG")
    off = subprocess.run([sys.executable, "-c", "import ess_gpu_rig; print(ess_gpu_rig.active())"], env=env,
                         capture_output=True, text=True)
    assert off.stdout.strip() == "False", off.stderr[-2000:]  # without the variable the rig does nothing


def test_settings_name_sglang_switches_that_exist():
    from sglang.srt.environ import envs

    ess_gpu_rig = sys.modules["ess_gpu_rig"]

    for name in ess_gpu_rig.SETTINGS:
        if name.startswith("SGLANG_"):
            assert hasattr(envs, name), name
    assert ess_gpu_rig.SETTINGS["SGLANG_FORCE_FUSED_OP_BACKEND"] in {b.value for b in _kernel_backends()}


def _kernel_backends():
    from sglang.kernels.fused_op import KernelBackend

    return list(KernelBackend)
