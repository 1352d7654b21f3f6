"""The plugin against the installed sglang 0.5.23 (CPU): entry point, flags, validation inside SGLang's own argument
resolution, and the hook targets."""

import argparse
import inspect
import json
import os
import pickle
import pathlib
import pkgutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang")
import torch  # noqa: E402


# DeepSeek-V3.2's config.json (the fields SGLang's argument resolution reads), for a model directory on the CPU
DSV32 = json.loads((pathlib.Path(__file__).parent / "dsv32_config.json").read_text())


def model_dir(tmp_path, name="dsv32", **changes):
    cfg = {**DSV32, **changes}
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


ALL_FLAGS = ["--enable-ess", "--ess-buffer-tokens", "--ess-sparse-ratio", "--ess-host-pool-gib", "--ess-overlap",
             "--ess-layer-plan", "--ess-da-attn1", "--ess-warmup-windows", "--ess-record-trace", "--ess-record-lookahead", "--ess-disk-dir",
             "--ess-disk-gib", "--ess-progressive-pd"]
NO_GRAPHS = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
PROGRESSIVE = ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768", "--ess-progressive-pd",
               "--disaggregation-mode", "decode", *NO_GRAPHS]
DISK = ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768", "--ess-host-pool-gib", "8",
        "--ess-disk-dir", "DISK"]


@pytest.fixture
def hopper(monkeypatch):
    """A GPU launch, resolved on this CPU machine: SGLang resolves DSA defaults from the GPU's compute capability
    (answered as an H100/H200 would), and the plugin's CPU path, which would set a CPU host's defaults for
    `--device cpu` (context length, token pool; test_cpu_path.py tests them), stays off. The node is a GPU server's:
    2 TiB of memory (the host pool's wall is checked at launch) and 8 TiB free on its disks."""
    from sglang_ess import sizing
    from sglang_ess.cpu import resolution

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(resolution, "is_cpu_dsa", lambda server_args: False)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (2 << 40) * 8 // 10 // ranks)
    monkeypatch.setattr(sizing, "free_disk_bytes", lambda directory: 8 << 40)


def resolve(argv):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(argv)
    sa.resolve_once()
    return sa


def base(tmp_path, *extra, **model):
    return ["--model-path", model_dir(tmp_path, **model), "--skip-tokenizer-init", "--device", "cpu", *extra]


def test_entry_point_is_registered_and_every_hook_applies(plugin):
    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "ess"]
    assert ep.value == "sglang_ess:register"
    assert plugin.check_installed() == []


def test_hooks_are_bound_to_the_real_sglang_targets(plugin):
    """Every target resolves in the installed sglang and still has the parameters its hook relies on."""
    for target, params in plugin.EXPECTED_PARAMS.items():
        owner, attr = target.rsplit(".", 1)
        obj = pkgutil.resolve_name(owner)
        fn = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
        fn = getattr(fn, "__func__", fn)
        assert hasattr(fn, "__wrapped__"), f"{target} was not patched"
        names = list(inspect.signature(inspect.unwrap(fn)).parameters)
        assert names[: len(params)] == params or all(p in names for p in params), (target, names)
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    assert plugin.RESOLUTION_STEP in _OVERRIDABLE_HOOKS


def test_launcher_help_lists_the_flags():
    """The real launcher: `python -m sglang.launch_server --help` loads plugins first, then parses."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                         env={**os.environ, "SGLANG_PLUGINS": "ess"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ALL_FLAGS:
        assert flag in out.stdout, flag


def test_refused_launch_prints_the_ess_message_alone():
    """The real launcher: a flag-only refusal comes at parsing (before the model is read), and the plugin's
    excepthook prints it as one line instead of a traceback."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "unused", "--enable-ess",
                          "--enable-hisparse"], capture_output=True, text=True,
                         env={**os.environ, "SGLANG_PLUGINS": "ess"}, timeout=300)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "sglang: error: --enable-ess and --enable-hisparse both offload the sparse KV cache; choose one")


def test_launch_error_hook_passes_other_exceptions_on(plugin, capsys):
    from sglang_ess.args import EssArgsError

    seen = []
    hook = plugin.startup.launch_error_hook(lambda *exc: seen.append(exc[1]))
    hook(EssArgsError, EssArgsError("--ess-sparse-ratio must be in (0, 1], got 2.0"), None)
    assert capsys.readouterr().err == "sglang: error: --ess-sparse-ratio must be in (0, 1], got 2.0\n" and not seen
    other = RuntimeError("not ours")
    hook(RuntimeError, other, None)
    assert seen == [other]
    # installed by the plugin's loader; torch.distributed's process-group init (other tests in this process) wraps the
    # hook it finds and calls it, so look through such wrappers
    chain, todo = [], [sys.excepthook]
    while todo:
        hook = todo.pop()
        if hook not in chain:
            chain.append(hook)
            todo += [c.cell_contents for c in (getattr(hook, "__closure__", None) or ()) if callable(c.cell_contents)]
    assert any(getattr(h, "ess", False) for h in chain), chain


def test_parsed_flags_reach_server_args_and_survive_pickling(plugin, hopper, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "ess-layer-plan/1", "num_layers": 61, "modes": ["da"] * 30 + ["dba"] * 31}))
    sa = resolve(base(tmp_path, "--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--ess-buffer-tokens", "6400",
                      "--ess-host-pool-gib", "512", "--ess-layer-plan", str(plan), "--ess-warmup-windows", "16",
                      "--ess-record-trace", str(tmp_path / "traces"), "--ess-da-attn1", "fused"))
    from sglang_ess.args import EssArgs, EssArgsError
    from sglang_ess.args import ess_args
    from sglang_ess.validate import validate_server_args
    from sglang_ess.args import EssFacts

    ess = ess_args(pickle.loads(pickle.dumps(sa)))  # as the scheduler processes receive it
    assert (ess.enable, ess.buffer_tokens, ess.host_pool_gib, ess.warmup_windows) == (True, 6400, 512.0, 16)
    assert ess.layer_plan == str(plan) and ess.record_trace == str(tmp_path / "traces") and ess.da_attn1 == "fused"
    assert EssArgs().da_attn1 == "calls"  # one FlashMLA call unless asked (docs/plugin.md, "Overlap")
    with pytest.raises(EssArgsError, match="--ess-da-attn1 must be one of"):
        EssArgs(enable=True, da_attn1="two").check()
    facts = validate_server_args(sa)
    assert facts.topk == 2048 and facts.layers == 61 and facts.buffer == 6400
    # DBA is DA over SGLang's two-batch overlap: without it the plan's dba layers run as da
    assert facts.plan == ("da",) * 61 and facts.role == "co-located"
    assert facts.residency is True and facts.fixed_step is False  # residency first by default; no CUDA graphs on a CPU
    assert ess_args(resolve(base(tmp_path, "--kv-cache-dtype", "fp8_e4m3"))).enable is False
    prefill = resolve(base(tmp_path, "--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--ess-warmup-windows", "24",
                           "--disaggregation-mode", "prefill"))
    assert validate_server_args(prefill) == EssFacts("pd-prefill", 2048, 61, 163840, windows=24)


BAD = [
    ("non-dsa", dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", index_topk=None),
     ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess"], "needs a model with DeepSeek Sparse Attention"),
    ("bf16", {}, ["--enable-ess"], "--kv-cache-dtype fp8_e4m3"),
    ("buffer", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--ess-buffer-tokens", "2048"], "below top-k \\+ 1 = 2049"),
    ("ratio", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--ess-sparse-ratio", "0.01", "--context-length", "32768"],
     "--ess-sparse-ratio 0.01 of 32768 tokens: a GPU buffer of 328 tokens"),
    ("plan", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768", "--ess-layer-plan", "PLAN10"], "--ess-layer-plan: .*plan for 10 layers, the model has 61"),
    ("plan-not-utf8", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                           "--ess-layer-plan", "PLANBIN"],
     "--ess-layer-plan: .*plan.bin: not a readable layer plan \\(UnicodeDecodeError"),
    ("hisparse", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--enable-hisparse"], "--enable-hisparse both"),
    ("both", {}, ["--enable-ess", "--ess-buffer-tokens", "4096", "--ess-sparse-ratio", "0.2"], "not both"),
    ("no-enable", {}, ["--ess-buffer-tokens", "4096"], "--ess-buffer-tokens given without --enable-ess"),
    ("lookahead-alone", {}, ["--enable-ess", "--ess-record-lookahead", "64"], "--ess-record-lookahead adds ranks"),
    ("lookahead-negative", {}, ["--enable-ess", "--ess-record-trace", "T", "--ess-record-lookahead", "-1"],
     "--ess-record-lookahead must be a non-negative integer"),
    ("prefill-node-cache-flag", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--ess-buffer-tokens", "6400",
                                     "--disaggregation-mode", "prefill"], "--ess-buffer-tokens shape\\(s\\) the decode node's cache"),
    ("pd-windows", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768", "--ess-warmup-windows", "64",
                        "--disaggregation-mode", "decode"], "--ess-warmup-windows 64: PD nodes exchange at most 32"),
    ("ragged-prefill", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--dsa-prefill-backend", "flashmla_sparse"],
     "--dsa-prefill-backend flashmla_kv \(got flashmla_sparse\)"),
    ("kpool", dict(index_kpool=4), ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess"], "pools them \\(index_kpool 4\\)"),
    ("ratio-without-context", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess"],
     "--ess-sparse-ratio \\(default 0.2\\) is a share of the context length: give --context-length .*163840.* or --ess-buffer-tokens"),
    ("mixed-chunk", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--enable-mixed-chunk"], "--enable-mixed-chunk yet"),
    ("pipeline", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--pp-size", "2"], "--pp-size 2 yet"),
    ("tree-verify", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--speculative-algorithm", "EAGLE",
                         "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                         "--speculative-num-draft-tokens", "6", "--attention-backend", "triton"], "--speculative-eagle-topk 1 \\(got 2\\)"),
    ("adaptive-spec", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--speculative-algorithm", "EAGLE",
                           "--speculative-adaptive"], "--speculative-adaptive yet"),
    ("decode-offload", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--disaggregation-mode", "decode",
                            "--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend", "file"],
     "--disaggregation-decode-enable-offload-kvcache yet"),
    # refused with --enable-hisparse by SGLang for reasons that hold for ESS (docs/plugin.md, the enable_hisparse audit)
    ("decode-radix", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--disaggregation-mode", "decode",
                          "--disaggregation-decode-enable-radix-cache"], "--disaggregation-decode-enable-radix-cache yet"),
    ("dcp", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--dcp-size", "2"], "--dcp-size 2 yet"),
    ("dba-without-tbo", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                             "--ess-overlap", "dba"], "add --enable-two-batch-overlap, or use --ess-overlap da"),
    ("host-receive", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--disaggregation-mode", "decode",
                          "--disaggregation-decode-host-receive-threshold", "0.5"],
     "--disaggregation-decode-host-receive-threshold below 1 yet"),
    # residency first: not with rows that page through or land in the host pool over time (docs/plugin.md)
    ("residency-progressive", {}, [*PROGRESSIVE, "--disaggregation-transfer-backend", "mooncake", "--ess-residency",
                                   "on"], "--ess-residency on: a disk tier \\(--ess-disk-dir\\) and --ess-progressive-pd"),
    # progressive PD (docs/pd.md, "Progressive PD transfer")
    ("progressive-without-ess", {}, ["--ess-progressive-pd", "--disaggregation-mode", "decode"],
     "--ess-progressive-pd given without --enable-ess"),
    ("progressive-prefill-node", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--ess-progressive-pd",
                                      "--disaggregation-mode", "prefill"],
     "--ess-progressive-pd .*not a prefill node \\(--disaggregation-mode prefill\\)"),
    ("progressive-colocated", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                                   "--ess-progressive-pd", *NO_GRAPHS],
     "--ess-progressive-pd .*not a co-located node \\(--disaggregation-mode null\\)"),
    # only over Mooncake and NIXL do ESS's hooks send in the progressive order and report it: others are refused
    *[(f"progressive-{b}", {}, [*PROGRESSIVE, "--disaggregation-transfer-backend", b],
       f"--ess-progressive-pd needs a transfer backend whose prefill node sends a request's KV in the progressive "
       f"order and reports it as it lands: --disaggregation-transfer-backend mooncake or nixl, not {b}")
      for b in ("mori", "fake")],
    # the disk tier (docs/plugin.md, "Disk tier")
    ("disk-gib-alone", {}, ["--enable-ess", "--ess-disk-gib", "10"], "--ess-disk-gib bounds the disk tier: give --ess-disk-dir"),
    ("disk-gib-zero", {}, [*DISK, "--ess-disk-gib", "0"], "--ess-disk-gib must be positive, got 0.0"),
    ("disk-without-host-pool", {}, ["--enable-ess", "--ess-disk-dir", "DISK"], "give --ess-host-pool-gib"),
    ("disk-missing", {}, [*DISK[:-1], "NODIR"], "--ess-disk-dir .*nodir: no such directory"),
    ("disk-graphs", {}, DISK, "--ess-disk-dir reads pages from disk between layers .*\\(decode graphs are on\\): add "
     "--cuda-graph-backend-decode disabled$"),
    ("disk-pd-decode", {}, [*DISK, *NO_GRAPHS, "--disaggregation-mode", "decode"], "not supported on a PD decode node"),
    ("disk-prefill-node", {}, [*DISK, "--disaggregation-mode", "prefill"],
     "--ess-host-pool-gib, --ess-disk-dir shape\\(s\\) the decode node's cache"),
    # upper bounds from the model and the launch, and what the host and disk must hold, before the weights load
    ("lookahead-beyond-the-context", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                                          "--ess-record-trace", "T", "--ess-record-lookahead", "1000000000"],
     "--ess-record-lookahead 1000000000: the indexer ranks at most the context's 32768 positions, top-k 2048 of them "
     "selected: at most 30720 can follow"),
    ("windows-beyond-a-forward", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                                      "--chunked-prefill-size", "8192", "--ess-warmup-windows", "10000000"],
     "--ess-warmup-windows 10000000: LRU-Warmup replays the last W query rows of a prefill forward, which holds at "
     "most 8192"),
    ("trace-dir-is-a-file", {}, ["--enable-ess", "--ess-record-trace", "AFILE"], "--ess-record-trace .*afile: exists and "
     "is not a directory"),
    ("trace-dir-under-a-file", {}, ["--enable-ess", "--ess-record-trace", "UNDERFILE"], "afile is a file, not a directory"),
    ("host-pool-tiny", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                            "--ess-host-pool-gib", "1e-5"], "--ess-host-pool-gib 1e-05: room for 0 tokens, below one "
     "request of 32768"),
    ("host-pool-below-a-request", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                                       "--ess-host-pool-gib", "0.5"], "room for 13416 tokens, below one request of 32768"),
    ("host-pool-beyond-the-host", {}, ["--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768",
                                       "--ess-host-pool-gib", "5000"], "--ess-host-pool-gib 5000.0: more than this rank "
     "may pin, 1638.4 GiB"),
    ("disk-below-a-request", {}, [*DISK, *NO_GRAPHS, "--ess-disk-gib", "0.01"], "--ess-disk-gib: 0.0 GiB of disk hold "
     "192 tokens, below one request of 32768"),
    ("disk-beyond-the-free-space", {}, [*DISK, *NO_GRAPHS, "--ess-disk-gib", "100000"], "--ess-disk-gib 100000.0: more "
     "than this rank's share of the free space in .*disk, 8192.0 GiB"),
    ("frames-below-a-step", {}, [*DISK[:-3], "0.001", *DISK[-2:], *NO_GRAPHS], "--ess-host-pool-gib 0.001: a disk "
     "tier's frames must hold the 513 pages"),
]


@pytest.mark.parametrize("name,model,flags,message", BAD, ids=[b[0] for b in BAD])
def test_bad_launches_fail_with_their_message(plugin, hopper, tmp_path, name, model, flags, message):
    from sglang_ess.args import EssArgsError

    plan = tmp_path / "plan10.json"
    plan.write_text(json.dumps({"format": "ess-layer-plan/1", "num_layers": 10, "modes": ["da"] * 10}))
    (tmp_path / "plan.bin").write_bytes(b"\xff\xfe\x00 not UTF-8")
    (tmp_path / "disk").mkdir()
    (tmp_path / "afile").write_text("")
    places = {"PLAN10": str(plan), "PLANBIN": str(tmp_path / "plan.bin"), "DISK": str(tmp_path / "disk"),
              "NODIR": str(tmp_path / "nodir"), "AFILE": str(tmp_path / "afile"),
              "UNDERFILE": str(tmp_path / "afile" / "traces"), "T": str(tmp_path / "traces")}
    flags = [places.get(f, f) for f in flags]
    with pytest.raises(EssArgsError, match=message):
        resolve(base(tmp_path, *flags, **model))


def test_progressive_pd_is_off_by_default(plugin, hopper, tmp_path):
    """Without --ess-progressive-pd a PD decode node's record says so."""
    from sglang_ess.args import ess_args

    assert ess_args(resolve(base(tmp_path, *PROGRESSIVE[:5], *PROGRESSIVE[6:]))).progressive_pd is False


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize("graphs", [[], NO_GRAPHS], ids=["decode-graphs-on", "graphs-off"])
def test_progressive_pd_resolves_over_mooncake_and_nixl(plugin, hopper, tmp_path, graphs, backend):
    """A PD decode node with --ess-progressive-pd over Mooncake or NIXL: SGLang's resolution keeps it, decode CUDA
    graphs on or off (on: a batch holding a request still landing runs eagerly)."""
    from sglang_ess.args import ess_args
    from sglang_ess.validate import validate_server_args

    sa = resolve(base(tmp_path, *PROGRESSIVE[:-4], *graphs, "--disaggregation-transfer-backend", backend))
    assert ess_args(pickle.loads(pickle.dumps(sa))).progressive_pd is True
    facts = validate_server_args(sa)
    assert facts.role == "pd-decode" and facts.residency is False  # rows land over time: every request offloaded
    plain = resolve(base(tmp_path, *PROGRESSIVE[:5], *PROGRESSIVE[6:-4], *graphs, "--disaggregation-transfer-backend", backend))
    assert validate_server_args(plain).residency is True  # a PD decode node without it: residency first


def test_a_disk_tier_launch_resolves(plugin, hopper, tmp_path):
    """--ess-disk-dir with CUDA graphs off on a co-located node: SGLang's resolution keeps the flags for the pool."""
    from sglang_ess.args import ess_args
    from sglang_ess.validate import validate_server_args

    (tmp_path / "disk").mkdir()
    sa = resolve(base(tmp_path, *DISK[:-1], str(tmp_path / "disk"), "--ess-disk-gib", "100", *NO_GRAPHS))
    ess = ess_args(pickle.loads(pickle.dumps(sa)))
    assert (ess.disk_dir, ess.disk_gib, ess.host_pool_gib) == (str(tmp_path / "disk"), 100.0, 8.0)
    facts = validate_server_args(sa)
    assert facts.role == "co-located" and facts.residency is False  # a disk tier keeps every request offloaded


def sparse_checkpoint(directory, tensors):
    """A safetensors file whose header declares `tensors` (name -> bytes) over a sparse file of their size: a
    checkpoint of any size on this disk, its header the only bytes written (the format: an 8-byte little-endian
    header length, a JSON header of each tensor's dtype, shape and data_offsets)."""
    header, at = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(directory, "model-00001-of-00001.safetensors")
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + at)
    return path


def test_weights_are_counted_from_the_safetensors_headers(tmp_path):
    """SGLang's own writer (safetensors) makes the files; the MTP layer's tensors count only for an MTP launch; a
    file that is not safetensors is named."""
    from safetensors.torch import save_file

    from sglang_ess.weights import CheckpointError, checkpoint_weight_bytes

    tensors = {"model.embed_tokens.weight": torch.zeros(10, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.w": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
               "model.layers.1.mlp.w": torch.zeros(3, dtype=torch.float32)}  # layer 1 of a 1-layer model: MTP
    save_file(tensors, str(tmp_path / "a.safetensors"))
    assert checkpoint_weight_bytes(str(tmp_path), 1, with_mtp=False) == 160 + 16
    assert checkpoint_weight_bytes(str(tmp_path), 1, with_mtp=True) == 160 + 16 + 12
    assert checkpoint_weight_bytes(str(tmp_path / "absent"), 1, with_mtp=False) is None  # a hub name: not on disk
    (tmp_path / "b.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="b.safetensors: not a safetensors file"):
        checkpoint_weight_bytes(str(tmp_path), 1, with_mtp=False)


DEVICE_MIB = 81559  # an H100's capacity as nvidia-smi reports it


@pytest.mark.parametrize("spare_mib", [-1, 1])
def test_weights_that_leave_no_room_for_one_request_are_refused_before_the_load(plugin, hopper, tmp_path, monkeypatch,
                                                                                spare_mib):
    """Inside SGLang's resolution, before anything loads: the device's capacity x --mem-fraction-static less the
    checkpoint's weights (a sparse 70 GiB checkpoint, its MTP layer not counted) must hold one request's slots,
    index-K, staging and scratch; one MiB short is refused naming the flags, one MiB over resolves. The scheduler
    checks again before its load, with the free memory SGLang measured there."""
    import types

    from sglang.srt.utils import common

    from sglang_ess import sizing
    from sglang_ess.args import EssArgsError
    from sglang_ess.validate import MIB

    monkeypatch.setattr(common, "get_device_memory_capacity", lambda device=None: float(DEVICE_MIB))
    need = sizing.one_request_device_bytes(61, 32768, 4096, 1)
    weights = int(DEVICE_MIB * MIB * 0.9) - need - spare_mib * MIB
    d = model_dir(tmp_path)
    sparse_checkpoint(d, {"model.layers.0.mlp.w": weights, "model.layers.61.mlp.w": 10 << 30})  # 61: MTP
    argv = ["--model-path", d, "--skip-tokenizer-init", "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3",
            "--enable-ess", "--context-length", "32768", "--ess-buffer-tokens", "4096", "--mem-fraction-static", "0.9"]
    if spare_mib < 0:
        with pytest.raises(EssArgsError, match=r"one request of 32768 tokens with 4096 GPU slots needs .* GiB of device "
                                               r"memory .* --mem-fraction-static 0.9 less the weights' .* GiB on this "
                                               r"rank .* over --tp-size 1\)\. Lower --context-length"):
            resolve(argv)
        return
    sa = resolve(argv)
    runner = types.SimpleNamespace(server_args=sa, device="cuda", is_draft_worker=False,
                                   pre_model_load_memory=DEVICE_MIB / 1024)  # GB, as SGLang measures it
    plugin.startup.before_load_model(runner)  # the whole device free: fits
    runner.pre_model_load_memory -= 2 / 1024  # another process holds 2 MiB of it
    with pytest.raises(EssArgsError, match="the free memory of cuda before the load"):
        plugin.startup.before_load_model(runner)


def test_mtp_verify_rows_need_room_for_every_row(plugin, tmp_path):
    """With speculative decoding, a verify step holds S query rows of one request at once."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ess.args import EssArgs, EssArgsError
    from sglang_ess.validate import validate_model

    hf = ModelConfig(model_dir(tmp_path)).hf_config
    cfg = argparse.Namespace(enable_hisparse=False, kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv",
                             dsa_prefill_backend="flashmla_kv", disaggregation_mode="decode", context_length=32768, speculative_algorithm="EAGLE",
                             speculative_num_draft_tokens=3, chunked_prefill_size=8192, tp_size=1, pp_size=1, nnodes=1)
    with pytest.raises(EssArgsError, match="3 verify rows x \\(top-k \\+ 1\\) = 6147"):
        validate_model(EssArgs(enable=True, buffer_tokens=6144), cfg, hf)
    facts = validate_model(EssArgs(enable=True, buffer_tokens=6400), cfg, hf)
    assert facts.query_rows == 3


CAPTURE_CASES = {  # launch flags, parallel sizes of one rank (what SGLang's process groups would publish)
    "single": ([], {}),
    "tbo": (["--enable-two-batch-overlap"], {}),
    "dp-attention-deepep": (["--tp-size", "8", "--dp-size", "4", "--enable-dp-attention", "--moe-a2a-backend", "deepep"],
                            {"attn_tp_size": 2}),
    "dp-attention-deepep-tbo": (["--tp-size", "8", "--dp-size", "4", "--enable-dp-attention", "--moe-a2a-backend",
                                 "deepep", "--enable-two-batch-overlap"], {"attn_tp_size": 2}),
}


@pytest.mark.parametrize("case", CAPTURE_CASES)
def test_ess_target_workers_build_the_ess_pool_with_a_scratch_for_every_captured_batch(plugin, hopper, tmp_path, case):
    """The KV cache configurator hook: an ESS target worker gets ESS's pool class, whose decode scratch holds the
    rows of the largest batch SGLang captures (its own get_batch_sizes_to_capture over the request table: padded to
    even sizes with two-batch overlap, to attention-TP multiples with DeepEP's gathered buffers) and of its eager
    padding; the MTP draft worker and a launch without ESS keep SGLang's."""
    import types

    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
    from sglang.srt.utils.common import get_eager_max_batch_size

    from sglang_ess.pool import EssDSATokenToKVPool

    flags, parallel = CAPTURE_CASES[case]
    running = 28  # SGLang's request table: 28 requests + its padding row
    build = lambda kvc, **kw: kw["dsa_pool_class"]  # noqa: E731  (SGLang's builder, reduced to the class it gets)
    sa = resolve(base(tmp_path, "--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--context-length", "32768", *flags))
    ctx = runtime_context.create_context(sa, role="test")
    with runtime_context.use_context(ctx), runtime_context.get_parallel().override(**parallel):
        # SGLang passes its request table's rows here (KVCacheConfigurator: req_to_token.shape[0])
        cls = plugin.startup.around_build_dsa_kv_pool(build, types.SimpleNamespace(server_args=sa, is_draft_worker=False),
                                              max_total_num_tokens=1 << 20, max_running_requests=running + 1,
                                              dsa_pool_class=DSATokenToKVPool)
        table = types.SimpleNamespace(req_to_token_pool=types.SimpleNamespace(size=running + 1), server_args=sa)
        largest = max(max(get_batch_sizes_to_capture(table)[0]), get_eager_max_batch_size(running + 1))
    # the staging rows: one context, or with DP attention a relabelled decode step's selected and own rows
    relabelled = (running + 1) * (2048 + 1) if "dp-attention" in case else 0
    assert issubclass(cls, EssDSATokenToKVPool) and cls.stage_rows == max(32768, relabelled)
    assert cls.scratch_rows == largest  # one query row per request without speculative decoding
    if case == "dp-attention-deepep-tbo":
        assert largest == 32 > running  # SGLang captures 32 for 29 rows (the scratch once held 28)
    draft = types.SimpleNamespace(server_args=sa, is_draft_worker=True)
    assert plugin.startup.around_build_dsa_kv_pool(build, draft, max_total_num_tokens=1, max_running_requests=9,
                                           dsa_pool_class=DSATokenToKVPool) is DSATokenToKVPool
    off = types.SimpleNamespace(server_args=resolve(base(tmp_path, "--kv-cache-dtype", "fp8_e4m3")), is_draft_worker=False)
    assert plugin.startup.around_build_dsa_kv_pool(build, off, max_total_num_tokens=1, max_running_requests=9,
                                           dsa_pool_class=DSATokenToKVPool) is DSATokenToKVPool


def test_a_prefill_node_keeps_sglangs_pool_and_sends_warmup(plugin, hopper, tmp_path, monkeypatch):
    """--enable-ess on a PD prefill node: SGLang's own pool class, no runtime, a warm-up sender for the target model
    (not for its MTP draft worker), and the PD metadata row sized by the model."""
    import types

    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from sglang_ess.pd import warmup as pd_warmup

    monkeypatch.setattr(plugin.state, "runtime", None)
    for name in ("sender", "sender_pool", "wire"):
        monkeypatch.setattr(plugin.state.pd, name, None)
    build = lambda kvc, **kw: kw["dsa_pool_class"]  # noqa: E731
    sa = resolve(base(tmp_path, "--kv-cache-dtype", "fp8_e4m3", "--enable-ess", "--disaggregation-mode", "prefill"))
    kvc = types.SimpleNamespace(server_args=sa, is_draft_worker=False)
    assert plugin.startup.around_build_dsa_kv_pool(build, kvc, max_total_num_tokens=1, max_running_requests=9,
                                           dsa_pool_class=DSATokenToKVPool) is DSATokenToKVPool
    pool = types.SimpleNamespace(size=4096, page_size=64, start_layer=0)
    runner = types.SimpleNamespace(server_args=sa, is_draft_worker=True, token_to_kv_pool=pool,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(4, 64, dtype=torch.int32)))
    plugin.startup.after_init_sparse_coordinator(None, runner)
    assert plugin.state.pd.sender is None  # the draft worker
    runner.is_draft_worker = False
    plugin.startup.after_init_sparse_coordinator(None, runner)
    assert isinstance(plugin.state.pd.sender, pd_warmup.WarmupSender) and plugin.state.pd.sender_pool is pool \
        and plugin.state.runtime is None
    assert plugin.state.pd.wire == (61, 2048) and pd_warmup.row_ints(61, 2048) * 4 == 32 + 61 * 8192 * 4
    other = types.SimpleNamespace(token_to_kv_pool=object(), use_fused_topk=False)  # the draft worker's backend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([1]),
                                  seq_lens_cpu=torch.tensor([5]), extend_prefix_lens_cpu=[0])
    plugin.forward.after_init_forward_metadata(None, other, batch)
    assert not plugin.state.pd.sender._forwards
    plugin.forward.after_init_forward_metadata(None, types.SimpleNamespace(token_to_kv_pool=pool, use_fused_topk=False), batch)
    assert len(plugin.state.pd.sender._forwards) == 1


def test_an_unwritable_disk_dir_is_refused(tmp_path, monkeypatch):
    """(As root every directory is writable: the permission answer is the test's.)"""
    from sglang_ess.args import EssArgs, EssArgsError

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(EssArgsError, match=f"--ess-disk-dir {tmp_path}: not writable"):
        EssArgs(enable=True, host_pool_gib=8, disk_dir=str(tmp_path)).check()
