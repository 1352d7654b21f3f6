"""The GPU rig (python/ess_gpu_rig, docs/gpu-server.md): its patch targets exist in the installed SGLang with the
parameters its hooks read, its torch replacements compute what the JIT kernels they stand for compute, and its
sgl_kernel stand-in gives weak_ref_tensor and refuses the rest. The rig itself runs only on the GPU machine
(benchmark/gpu/server.sh); CI rehearses that command on the CPU path (scripts/gpu_rehearsal.sh)."""

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sglang")

from ess.core.kernels import flashtrans  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RIG = os.path.join(ROOT, "python", "ess_gpu_rig")


def _load_rig():
    """The rig as server.sh's PYTHONPATH gives it (it is not installed: pyproject.toml leaves it out)."""
    if "ess_gpu_rig" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ess_gpu_rig", os.path.join(RIG, "__init__.py"),
                                                      submodule_search_locations=[RIG])
        sys.modules["ess_gpu_rig"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return importlib.import_module("ess_gpu_rig.rig_patches")


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


def sglang_logits():
    """SGLang's own torch logits, the two the rig's rows replace (unwrapped, should a test have patched them)."""
    from sglang.srt.layers.attention.dsa import utils

    return [inspect.unwrap(getattr(utils, t.rsplit(".", 1)[1])) for t in patches.LOGITS_TARGETS]


@pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8's interpreter")
def test_the_logits_kernels_pass_the_check_they_take_on_the_device(monkeypatch):
    """ESS's kernels over SGLang's pages (decode, one and two query rows a request) and over prefill windows, against
    SGLang's own torch logits called as the rig's SGLang calls them (ess_gpu_rig.logits_check, which each scheduler
    runs on its GPU before its weights load), here in Triton's interpreter: equal at every position within each
    row's context on exact values, -inf past it (SGLang's writes 0, its top-k masks by length), SGLang's row
    stride."""
    from ess.core.kernels import indexer

    check = importlib.import_module("ess_gpu_rig.logits_check")
    monkeypatch.setattr(indexer, "kernel_backend", lambda backend, device, what: "interpret")
    assert check.check("cpu", patches.fp8_paged_mqa_logits, patches.fp8_mqa_logits, *sglang_logits()) is None
    case = check.decode_case(1)
    with pytest.raises(ValueError, match="indices"):
        patches.fp8_paged_mqa_logits(**case, indices=torch.zeros(1))
    with pytest.raises(ValueError, match="clean_logits"):
        patches.fp8_mqa_logits(**check.prefill_case(), clean_logits=True)


def test_a_logits_kernel_that_fails_its_check_gives_way_to_sglangs_torch_logits(monkeypatch, capsys):
    """A kernel that raises or differs fails the check, naming what; the scheduler then serves with SGLang's torch
    logits (the rig's rows call through to them) and says so in its log."""
    import types

    check = importlib.import_module("ess_gpu_rig.logits_check")
    decode, prefill = sglang_logits()
    wrong = lambda **kw: decode(**kw) + 1  # noqa: E731
    fault = check.check("cpu", wrong, prefill, decode, prefill)
    assert fault.startswith("decode logits, 1 query row(s): ") and "differ from SGLang's" in fault

    def broken(**kw):
        raise RuntimeError("no kernel image for this device")

    assert check.check("cpu", broken, prefill, decode, prefill) == "RuntimeError: no kernel image for this device"
    monkeypatch.setattr(patches, "fp8_paged_mqa_logits", broken)
    monkeypatch.setattr(patches, "_served", {"logits": None})
    patches.before_load_model(types.SimpleNamespace(device="cpu"))
    assert patches.served_logits() == "torch"
    assert "ESS GPU rig: indexer logits torch (ESS's kernels failed their check on cpu: RuntimeError" in \
        capsys.readouterr().err
    case = check.decode_case(1)
    sentinel = object()
    assert patches.around_paged_logits(lambda **kw: sentinel, **case) is sentinel  # SGLang's own, called through


def test_torch_logits_asked_for_skip_the_check(monkeypatch, capsys):
    import types

    ess_gpu_rig = sys.modules["ess_gpu_rig"]
    monkeypatch.setattr(patches, "_served", {"logits": None})
    monkeypatch.setenv(ess_gpu_rig.LOGITS_ENV, "torch")
    patches.before_load_model(types.SimpleNamespace(device="cpu"))
    assert patches.served_logits() == "torch" and "indexer logits torch (ESS_GPU_RIG_LOGITS=torch)" in \
        capsys.readouterr().err
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
               PYTHONPATH=os.pathsep.join([os.path.join(python, "sglang_ess", "cpu", "standin"), python, ROOT]))
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
