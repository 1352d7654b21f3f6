"""The GPU runs' smoke run (`run.sh --smoke OUT --all`): every phase on the CPU with tiny sizes and the torch reference in
place of FlashMLA: the kit, decode_gpu.py twice (the second appended), bookkeeping.py, indexer_kernels.py."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_kit_smoke_run_writes_every_key(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    subprocess.run(["bash", str(ROOT / "benchmark" / "gpu" / "run.sh"), "--smoke", str(tmp_path), "--all"], check=True,
                   env=env, timeout=600)
    phases = (tmp_path / "phases.log").read_text().splitlines()
    assert [line.split(":")[0] for line in phases] == ["kit", "decode32k", "decode128k", "bookkeeping", "indexer"]
    assert all(": exit 0 after" in line for line in phases), phases
    assert len(json.loads((tmp_path / "decode.json").read_text())["commands"]) == 2
    assert json.loads((tmp_path / "bookkeeping.json").read_text())["cases"]
    indexer = json.loads((tmp_path / "indexer.json").read_text())
    want = {"scores_kernel_us", "keys_kernel_us", "topk_keys_us", "topk_float_sorted_us", "indexer_topk_us"}
    assert indexer["cases"] and all(want <= set(c) and c["topk_exact"] for c in indexer["cases"])
    if indexer["backend"] == "interpret":  # the radix selects and the pages layout beside the keys path
        assert all(c["radix_exact"] and c["split_exact"] and c["fused_exact"] and c["pages_exact"]
                   and "indexer_fused_us" in c for c in indexer["cases"])
    kit = json.loads((tmp_path / "kit.json").read_text())
    for key in ("device", "torch", "date", "flashtrans", "flashmla", "da_split", "cuda_graph",
                "bookkeeping_us_per_layer", "overlap"):
        assert key in kit, key
    assert "not a measurement" in kit["device"]
    ft = kit["flashtrans"]
    assert ft["exact"] and {"h2d_gbps", "d2h_gbps", "contiguous_h2d_gbps", "contiguous_d2h_gbps", "backend"} <= set(ft)
    assert kit["flashmla"]["equal"]  # ESS's slots and indices read the same rows as the whole cache
    da = kit["da_split"]
    assert da["max_rel_err_vs_unsplit"] < 1e-5
    # DA's Attn1 over the misses (ess.core.kernels.miss_attention, the Triton kernel through the interpreter in the smoke run)
    assert da["miss_kernel_max_rel_err_vs_unsplit"] < 1e-5
    want = {"misses_per_request", "attn0_us", "miss_us", "merge_us", "total_us"}
    assert da["miss_kernel"] and all(want <= set(r) for r in da["miss_kernel"])
    want = {"misses_per_request", "attn0_us", "copy_us", "copy_attend_us", "total_us", "exposed_us"}
    assert da["fused_copy_attend"] and all(want <= set(r) and r["landed_exact"] for r in da["fused_copy_attend"])
    assert kit["cuda_graph"]["ok"] is None  # no CUDA graphs on the CPU, and the kit says so
    assert set(kit["overlap"]["exposed_ms"]) == {"none", "da", "dba"}
    for png in ("flashtrans.png", "da_split.png", "da_miss_kernel.png", "overlap.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_a_phase_the_budget_cuts_is_named_and_bad_arguments_are_refused(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    run = ["bash", str(ROOT / "benchmark" / "gpu" / "run.sh")]
    # 3 s: the kit starts (a busy machine can take a second to get there) and is cut long before its ~20 s end
    out = subprocess.run([*run, "--smoke", str(tmp_path), "kit", "bookkeeping", "--budget-min", "0.05"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    kit, bookkeeping = (tmp_path / "phases.log").read_text().splitlines()
    assert kit.startswith("kit: cut by the budget after ")
    assert bookkeeping == "bookkeeping: not run (the budget of 0.05 min was spent)"
    for args, message in ((["--budget-min", "x"], "--budget-min must be a positive number"),
                          (["decode64k"], "unknown phase decode64k")):
        bad = subprocess.run([*run, str(tmp_path / "b"), *args], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr and not (tmp_path / "b").exists()


def test_worst_over_floor_is_the_served_paths_larger_ratio_at_esss_two_shapes(monkeypatch):
    """indexer.json's worst_over_floor (issue 48's figure): the larger of the served path's time over its byte floor
    at 32K batch 204 and 128K batch 51, beside the faster path's; nothing where the run has neither shape."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("indexer_bench", ROOT / "benchmark" / "indexer_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cases = [{"context": 32768, "batch": 204, "over_floor": 9.5, "over_floor_radix": 3.0, "over_floor_fused": 2.5},
             {"context": 131072, "batch": 51, "over_floor": 8.0, "over_floor_radix": 4.0, "over_floor_fused": 1.5},
             {"context": 32768, "batch": 1, "over_floor": 50.0, "over_floor_radix": 40.0}]
    keys = bench.worst_over_floor(cases, "keys")
    assert keys["worst_over_floor"] == 9.5 and keys["worst_over_floor_faster_path"] == 2.5
    assert bench.worst_over_floor(cases, "radix")["worst_over_floor"] == 4.0
    assert bench.worst_over_floor(cases, "fused")["worst_over_floor"] == 2.5
    assert bench.worst_over_floor(cases[2:], "keys") == {}


def test_a_leases_first_call_rehearsed(tmp_path):
    """benchmark/gpu/lease.sh --smoke: the prepared first device call's steps on the CPU (the server steps are
    scripts/gpu_rehearsal.sh's), each logged, everything in OUT/gpu.tgz alone at OUT's top; bad flags refused."""
    import tarfile

    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    lease = ["bash", str(ROOT / "benchmark" / "gpu" / "lease.sh")]
    subprocess.run([*lease, str(tmp_path), "--smoke"], check=True, env=env, timeout=600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.tgz", "lease"]
    steps = (tmp_path / "lease" / "steps.log").read_text().splitlines()
    assert [s.split(":")[0] for s in steps] == ["server", "moe", "resident", "decode47", "indexer"]
    assert all(s.endswith("not run with --smoke (scripts/gpu_rehearsal.sh rehearses it)") for s in steps[:3])
    assert all("exit 0" in s for s in steps[3:])
    names = tarfile.open(tmp_path / "gpu.tgz").getnames()
    assert {"lease/decode47/decode.json", "lease/indexer/indexer.json", "lease/steps.log"} <= set(names)
    decode = json.loads((tmp_path / "lease" / "decode47" / "decode.json").read_text())
    assert len(decode["commands"]) == 2 and {r["mode"] for r in decode["rows"]} == {"baseline", "none"}
    second = tmp_path / "second"  # a second call's steps: the 128K server step (rehearsed as the first's is), decode47
    subprocess.run([*lease, str(second), "--smoke", "--steps", "server128k,decode47"], check=True, env=env, timeout=600)
    steps = (second / "lease" / "steps.log").read_text().splitlines()
    assert steps[0].startswith("server128k: not run with --smoke") and [s.split(":")[0] for s in steps] == [
        "server128k", "decode47"]
    for args, message in ((["--budget-min", "0"], "--budget-min must be a positive"), (["--fast"], "unknown flag"),
                          (["--steps", "server,bogus"], "--steps: unknown step bogus")):
        bad = subprocess.run([*lease, str(tmp_path / "b"), *args], capture_output=True, text=True, env=env, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr and not (tmp_path / "b").exists()
