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
out = torch.empty(2, 4)
sgl_kernel.moe_sum_reduce(torch.ones(2, 3, 4), out, 2.0)
assert bool((out == 6).all())
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


def test_the_standin_gives_weak_ref_tensor_and_moe_sum_reduce_and_refuses_the_rest():
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


# -- the FP8 MoE and MTP path's stand-ins (ess_gpu_rig.rig_moe; benchmark/gpu/moe-fp8-kernel-map.md) -------------------
moe = importlib.import_module("ess_gpu_rig.rig_moe")

# SGLang's Triton kernels, run by Triton's CPU interpreter in a child process (TRITON_INTERPRET must be set before Triton
# is imported): its single-launch align (exact under the same "+1" buffer contract as sgl_kernel's; SGLang's wrapper
# takes it only for <= 64 pairs and > 64 experts, but it stays correct above), its MoE combine and the rig's FP8
# activation quantiser, which is SGLang's Triton kernel, with row- and column-major scales.
SGLANG_MOE_SIDE = """
import sys, torch, triton
from sglang.kernels.ops.moe.moe_align_small_numel import moe_align_small_numel
from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton
from ess_gpu_rig import rig_moe
g = torch.Generator().manual_seed(0)
out = {}
for name, (T, K, E, bs) in {"decode": (5, 1, 32, 16), "top8": (7, 8, 256, 64), "wide": (25, 4, 32, 16)}.items():
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[-2:] = -1  # rows masked out (CUDA-graph padding)
    pairs = ids.numel()
    size = (pairs * bs if pairs < E + 1 else pairs + (E + 1) * (bs - 1) + 3) // 4 * 4  # SGLang's wrapper's sizes
    sorted_ids, expert_ids = torch.empty(size, dtype=torch.int32), torch.empty(triton.cdiv(size, bs), dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    moe_align_small_numel(ids, E + 1, bs, sorted_ids, expert_ids, total)
    out[name] = (ids, E, bs, size, sorted_ids, expert_ids, total)
x = torch.randn(9, 3, 256, generator=g)
combined = torch.empty(9, 256)
moe_sum_reduce_triton(x, combined, 2.5)
out["combine"] = (x, combined)
x = (torch.randn(6, 512, generator=g) * 3).bfloat16()
q, s = torch.empty(6, 512, dtype=torch.float8_e4m3fn), torch.empty(6, 4)
qc, sc = torch.empty(6, 512, dtype=torch.float8_e4m3fn), torch.empty(4, 6).t()
for a, b in ((q, s), (qc, sc)):
    rig_moe.per_token_group_quant(x, a, b, 128, 1e-10, -448.0, 448.0, scale_ue8m0=False, fuse_silu_and_mul=False,
                                  masked_m=None)
out["quant"] = (x, q, s, qc, sc)
from ess_gpu_rig import moe_check  # the check each scheduler runs on its device, here in the interpreter
out["check"] = [moe_check.check_quantiser("cpu", rig_moe.per_token_group_quant),
                moe_check.check_combine("cpu", moe_sum_reduce_triton),
                moe_check.check_align("cpu", rig_moe.moe_align_block_size, moe_align_small_numel)]
torch.save(out, sys.argv[1])
"""


def _standin_sgl_kernel():
    """The stand-in package's module, under a name of its own (this process may hold SGLang's real sgl_kernel)."""
    name = "ess_standin_sgl_kernel"
    if name not in sys.modules:
        path = os.path.join(ROOT, "python", "sglang_ess", "cpu", "standin", "sgl_kernel", "__init__.py")
        spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[])
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def sglang_moe_side(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "moe.pt"
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.path.join(ROOT, "python")}
    run = subprocess.run([sys.executable, "-c", SGLANG_MOE_SIDE, str(path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(path)


def test_every_moe_target_exists_with_the_parameters_its_hook_reads():
    assert {p.target for p in moe.PATCHES} == set(moe.EXPECTED_PARAMS)
    for p in moe.PATCHES:
        params = list(inspect.signature(inspect.unwrap(_resolve(p.target))).parameters)
        assert params[: len(p.params)] == list(p.params), (p.target, params)
        assert p.why


@pytest.mark.parametrize("case", ["decode", "top8", "wide"])
def test_moe_align_equals_sglangs_triton_align(sglang_moe_side, case):
    """Every pair in its expert's block-padded segment, in the same order, pads holding numel, each block's expert,
    the padded total: equal to SGLang's Triton align on top-1 of 32 experts, top-8 of 256, and 100 pairs; blocks past
    the total -1 (inactive), the buckets' padded offsets in cumsum_buffer."""
    ids, E, bs, size, want_sorted, want_experts, want_total = sglang_moe_side[case]
    sorted_ids, expert_ids = torch.full((size,), -5, dtype=torch.int32), torch.full(want_experts.shape, -5,
                                                                                     dtype=torch.int32)
    total, cumsum = torch.zeros(1, dtype=torch.int32), torch.full((E + 2,), -5, dtype=torch.int32)
    moe.moe_align_block_size(ids, E + 1, bs, sorted_ids, expert_ids, total, cumsum, True)
    n = int(want_total)
    assert torch.equal(total, want_total) and n % bs == 0
    assert torch.equal(sorted_ids[:n], want_sorted[:n]) and bool((sorted_ids[n:] == ids.numel()).all())
    assert torch.equal(expert_ids[: n // bs], want_experts[: n // bs]) and bool((expert_ids[n // bs :] == -1).all())
    counts = torch.bincount(ids.flatten().long() + 1, minlength=E + 1)
    assert torch.equal(cumsum[: E + 2].long(), torch.cat([torch.zeros(1), ((counts + bs - 1) // bs * bs).cumsum(0)
                                                          ]).long())
    with pytest.raises(ValueError, match="ignore_invalid_expert"):
        moe.moe_align_block_size(ids, E + 1, bs, sorted_ids, expert_ids, total, cumsum, True, True)


def test_moe_combine_equals_sglangs_triton_and_torch(sglang_moe_side):
    """sgl_kernel's moe_sum_reduce as the stand-in gives it on the CPU: SGLang's Triton combine exactly in float32
    (Triton's interpreter truncates bf16, so the kernel is compared in float32); in bf16, the float32 sum rounded once,
    within a bf16 step of SGLang's torch combine (moe_sum_reduce_torch_compile's arithmetic, which rounds twice)."""
    sgl_kernel = _standin_sgl_kernel()
    x, want = sglang_moe_side["combine"]
    got = torch.empty_like(want)
    sgl_kernel.moe_sum_reduce(x, got, 2.5)
    assert torch.equal(got, want)
    xb, out = x.bfloat16(), torch.empty(9, 256, dtype=torch.bfloat16)
    sgl_kernel.moe_sum_reduce(xb, out, 2.5)
    assert torch.equal(out, (xb.float().sum(1) * 2.5).bfloat16())
    sglang = torch.empty_like(out)
    torch.sum(xb, dim=1, out=sglang)
    torch.testing.assert_close(out, sglang.mul_(2.5), rtol=2**-7, atol=0)


def test_fp8_activation_quantiser_is_sglangs_triton_kernel(sglang_moe_side):
    """The rig's quantiser (SGLang's Triton kernel) writes each 128-group's scale max(absmax, 1e-10) / 448 into the
    caller's scales, row- or column-major, and the same FP8 values either way (Triton 3.8's interpreter casts float32
    to FP8 wrongly for a few values, test_cpu_path.to_fp8, so the values are compared with each other, not with
    torch's cast). The variants off the rig's path are refused, naming them."""
    x, q, s, qc, sc = sglang_moe_side["quant"]
    want = x.float().reshape(6, 4, 128).abs().amax(-1).clamp(min=1e-10) / 448
    assert torch.equal(s, want) and torch.equal(sc, want) and sc.stride() == (1, 6)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), qc.view(torch.uint8))
    with pytest.raises(ValueError, match="scale_ue8m0"):
        moe.per_token_group_quant(x, q, s, 128, 1e-10, -448.0, 448.0, scale_ue8m0=True, fuse_silu_and_mul=False,
                                  masked_m=None)


def test_per_token_quant_is_a_group_of_the_whole_row(monkeypatch):
    seen = {}
    monkeypatch.setattr(moe, "per_token_group_quant", lambda *a, **kw: seen.update(a=a, kw=kw))
    x, q, s = torch.randn(3, 256), torch.empty(3, 256, dtype=torch.float8_e4m3fn), torch.empty(3)
    moe.per_token_quant_fp8(x, q, s)
    assert seen["a"][3:] == (256, 1e-10, -448.0, 448.0) and seen["a"][2].shape == (3, 1)


def test_activation_mask_and_mtp_norms_equal_sglangs_torch():
    """silu_and_mul equals SGLang's SiluAndMul.forward_native; the padding mask equals SGLang's CPU branch of
    _mask_topk_ids_padded_region, also through the uncompiled post-process; fused_eh_norm equals the MTP layer's
    off-CUDA branch, cat(enorm(embeds), hnorm(previous)) with SGLang's RMSNorm modules."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.moe import topk

    x = torch.randn(5, 2 * 96).bfloat16()
    out = torch.empty(5, 96, dtype=torch.bfloat16)
    assert moe.silu_and_mul(x, out) is out and torch.equal(out, SiluAndMul().forward_native(x))
    with pytest.raises(ValueError, match="row filter"):
        moe.silu_and_mul(x, out, torch.zeros(1))
    ids = torch.randint(0, 32, (6, 2), dtype=torch.int32)
    n = torch.tensor([4], dtype=torch.int32)
    want = ids.clone()
    topk._mask_topk_ids_padded_region(want, n)
    got = ids.clone()
    moe.mask_topk_ids(got, n)
    assert torch.equal(got, want) and bool((got[4:] == -1).all()) and torch.equal(got[:4], ids[:4])
    assert torch.equal(moe.biased_grouped_topk_postprocess(ids.clone(), None, n), want)
    assert moe.no_tiny_gemm(32, 7168, max_m=16) is False
    e, h = torch.randn(3, 256).bfloat16(), torch.randn(3, 256).bfloat16()
    enorm, hnorm = RMSNorm(256, eps=1e-6), RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        enorm.weight.copy_(torch.rand(256) + 0.5)
        hnorm.weight.copy_(torch.rand(256) + 0.5)
    enorm, hnorm = enorm.bfloat16(), hnorm.bfloat16()
    want = torch.cat((enorm.forward_native(e), hnorm.forward_native(h)), -1)
    assert torch.equal(moe.fused_eh_norm(e, h, enorm.weight, hnorm.weight, 1e-6), want)


def test_eagle_tree_kernels_are_sglangs_triton_ones(monkeypatch):
    """The tree build and greedy verify call SGLang's Triton versions (its XPU branch; the CPU path serves EAGLE
    through the same kernels, test_server.py's MTP tests) with every argument, and verify returns what SGLang's does."""
    from sglang.kernels.ops.speculative import spec_tree

    calls = []
    monkeypatch.setattr(spec_tree, "sgl_build_tree_kernel_triton", lambda *a, **kw: calls.append(("build", a, kw)))
    monkeypatch.setattr(spec_tree, "verify_tree_greedy_triton", lambda **kw: calls.append(("verify", kw)))
    moe.build_tree(*range(12))
    assert calls[0] == ("build", tuple(range(12)), {})
    names = ("predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
             "retrieve_next_sibling", "target_predict")
    assert moe.verify_tree_greedy(*names, topk=1) == names[:3]
    assert calls[1] == ("verify", dict(zip(names, names)))


def test_moe_stand_ins_are_graph_safe():
    """Each torch stand-in runs on meta tensors: no value read on the host, no size taken from data, as a CUDA graph
    needs (the MoE layers and the MTP layer are captured; the tree kernels run outside the graphs)."""
    m = torch.device("meta")
    ids = torch.empty(7, 8, dtype=torch.int32, device=m)
    buf = lambda n: torch.empty(n, dtype=torch.int32, device=m)  # noqa: E731
    moe.moe_align_block_size(ids, 257, 64, buf(2048 + 64 * 257), buf(300), buf(1), buf(258), True)
    x = torch.empty(5, 256, dtype=torch.bfloat16, device=m)
    assert moe.silu_and_mul(x).shape == (5, 128)
    moe.mask_topk_ids(torch.empty(5, 1, dtype=torch.int32, device=m), torch.empty(1, dtype=torch.int32, device=m))
    w = torch.empty(256, dtype=torch.bfloat16, device=m)
    assert moe.fused_eh_norm(x, x, w, w, 1e-6).shape == (5, 512)


def test_moe_stand_ins_pass_the_check_they_take_on_the_device(sglang_moe_side):
    """ess_gpu_rig.moe_check as each scheduler of an MoE or FP8 model runs it before its weights load, here with SGLang's
    Triton kernels in the interpreter (exact on its values): the quantiser, the combine, the align all pass; the torch
    quantiser (the fallback) and the stand-in's torch combine pass it too."""
    check = importlib.import_module("ess_gpu_rig.moe_check")
    assert sglang_moe_side["check"] == [None, None, None]
    torch_quantiser = lambda x, q, s, g, eps, lo, hi, **kw: moe.quantise_torch(x, q, s, g, eps, lo, hi)  # noqa: E731
    assert check.check_quantiser("cpu", torch_quantiser) is None
    # CUDA's float32 division in Triton is within 2 ulp (div.full.f32): a scale a unit below its power of two passes
    nudged = lambda x, q, s, *a, **kw: (torch_quantiser(x, q, s, *a), s.mul_(1 - 2**-24))  # noqa: E731
    assert check.check_quantiser("cpu", nudged) is None
    assert check.check_combine("cpu", _standin_sgl_kernel().moe_sum_reduce) is None


def test_a_quantiser_that_fails_its_check_gives_way_to_torchs(monkeypatch, capsys):
    """A quantiser that differs or raises fails the check, naming what; the scheduler then quantises in torch (the same
    arithmetic) and says so in its log. A dense bf16 model skips the check."""
    import types

    check = importlib.import_module("ess_gpu_rig.moe_check")
    off_by_one = lambda x, q, s, *a, **kw: (moe.quantise_torch(x, q, s, *a[:4]), s.mul_(2))  # noqa: E731
    assert check.check_quantiser("cpu", off_by_one).startswith("FP8 quantiser (row-major scales): 148 of 148 scales")
    assert check.check_combine("cpu", lambda x, out, f: out.zero_()).startswith("MoE combine: ")
    monkeypatch.setattr(moe, "_served", {"quantiser": "triton"})
    monkeypatch.setattr(check, "check_quantiser", lambda device, fn: "FP8 quantiser: RuntimeError: no kernel image")
    monkeypatch.setattr(check, "check_combine", lambda device, fn: None)
    monkeypatch.setattr(check, "check_align", lambda device, fn, sglang: None)
    monkeypatch.setitem(sys.modules, "sgl_kernel", _standin_sgl_kernel())
    hf = types.SimpleNamespace(n_routed_experts=32, first_k_dense_replace=3, num_hidden_layers=7)
    runner = types.SimpleNamespace(device="cpu", model_config=types.SimpleNamespace(hf_config=hf, quantization="fp8"))
    moe.before_load_model(runner)
    assert "FP8 quantiser FAULT: FP8 quantiser: RuntimeError" in capsys.readouterr().err
    assert moe._served["quantiser"] == "torch"
    x, want_q, want_s = check.quant_case()
    q, s = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(37, 4)
    moe.per_token_group_quant(x, q, s, 128, 1e-10, -448.0, 448.0, scale_ue8m0=False, fuse_silu_and_mul=False,
                              masked_m=None)  # the torch quantiser, served
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    dense = types.SimpleNamespace(n_routed_experts=4, first_k_dense_replace=4, num_hidden_layers=4)
    runner.model_config = types.SimpleNamespace(hf_config=dense, quantization=None)
    moe.before_load_model(runner)
    assert "MoE stand-ins" not in capsys.readouterr().err
