"""The compose file parses, and its flags are the plugin's."""

import argparse
import pathlib
import shlex

import pytest
import yaml

from sglang_ess.args import add_cli_args

ROOT = pathlib.Path(__file__).resolve().parents[2]


def plugin_flags():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}


def test_compose_flags_are_the_plugins():
    doc = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())
    flags = doc["x-flags"]
    ess = [f for f in shlex.split(flags["ESS_FLAGS"]) if f.startswith("--")]
    assert "--enable-ess" in ess and set(ess) <= plugin_flags(), set(ess) - plugin_flags()
    assert not any("ess" in f for f in shlex.split(flags["MODEL_FLAGS"]))
    assert "--kv-cache-dtype fp8_e4m3" in flags["MODEL_FLAGS"]  # the latent format ESS requires
    assert "--dsa-prefill-backend flashmla_kv --dsa-decode-backend flashmla_kv" in flags["MODEL_FLAGS"]  # its backends
    cmds = {name: " ".join(s["command"]) for name, s in doc["services"].items()}
    assert "$$ESS_FLAGS" in cmds["decode"] and "--disaggregation-mode decode" in cmds["decode"]
    assert "$$ESS_FLAGS" not in cmds["prefill"] and "--disaggregation-mode prefill" in cmds["prefill"]
    # the prefill node only sends warm-up state: the flags a prefill node accepts (sglang_ess.validate)
    assert "$$ESS_PREFILL_FLAGS" in cmds["prefill"]
    assert shlex.split(flags["ESS_PREFILL_FLAGS"]) == ["--enable-ess", "--ess-warmup-windows", "32"]
    for s in doc["services"].values():
        assert s["environment"] == flags


def test_dockerfile_builds_on_sglang_0_5_23():
    text = (ROOT / "docker/Dockerfile").read_text()
    assert "ARG BASE=lmsysorg/sglang:v0.5.23" in text and "FROM ${BASE}" in text and "SGLANG_PLUGINS=ess" in text


def test_cpu_compose_runs_the_pd_tests_servers():
    """docker/compose.cpu.yaml (scripts/docker_pd.sh) starts the servers of the CPU PD test (test_pd_servers.py) with
    their flags, on the ports ess.harness.pd_check is given."""
    from ess.harness import pd_servers as PD
    from ess.harness import servers as S

    doc = yaml.safe_load((ROOT / "docker/compose.cpu.yaml").read_text())
    flags = doc["x-flags"]
    assert shlex.split(flags["CPU_FLAGS"]) == S.CPU_FLAGS
    assert shlex.split(flags["PREFILL_FLAGS"]) == PD.prefill_flags(30103) + PD.PREFILL_ESS
    assert shlex.split(flags["DECODE_FLAGS"]) == PD.DECODE_FLAGS + S.ESS_FLAGS
    router = PD.Router("", [], "", port=30180, prefill=(30101, 30103), decode=30102, metrics_port=30190)
    assert shlex.split(flags["ROUTER_FLAGS"]) == router.command[3:]  # after python -m sglang_router.launch_router
    assert flags["MOONCAKE_PROTOCOL"] == PD.engine_env()["MOONCAKE_PROTOCOL"]
    cmds = {name: " ".join(s["command"]) for name, s in doc["services"].items()}
    assert "--port 30100 $$CPU_FLAGS" in cmds["stock"] and "PREFILL" not in cmds["stock"]
    assert "--port 30101 $$CPU_FLAGS $$PREFILL_FLAGS" in cmds["prefill"]
    assert "--port 30102 $$CPU_FLAGS $$DECODE_FLAGS" in cmds["decode"]
    assert "sglang_router.launch_router $$ROUTER_FLAGS" in cmds["router"]
    script = (ROOT / "scripts/docker_pd.sh").read_text()
    assert "pd_check --stock 30100 --router 30180 --decode 30102" in script


def test_serving_comparison_writes_csv_and_png(tmp_path):
    import json as _json

    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_compare", ROOT / "benchmark/serving_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    load_rows, write = mod.load_rows, mod.write

    lines = [{"tag": t, "max_concurrency": c, "output_throughput": 100.0 * c * (2 if t == "ess" else 1),
              "mean_tpot_ms": 20.0, "mean_itl_ms": 20.0, "mean_ttft_ms": 900.0} for t in ("baseline", "ess") for c in (8, 16)]
    (tmp_path / "r.jsonl").write_text("\n".join(_json.dumps(x) for x in lines) + "\n")
    csv_path, png = write(load_rows(str(tmp_path / "r.jsonl")), str(tmp_path / "compare"))
    assert open(csv_path).read().splitlines()[1].startswith("baseline,8,800.0")
    assert (tmp_path / "compare.png").stat().st_size > 0
    (tmp_path / "bad.jsonl").write_text('{"tag": "ess"}\n')
    with pytest.raises(SystemExit, match="missing"):
        load_rows(str(tmp_path / "bad.jsonl"))


def test_compare_serving_script_help_and_a_dying_server(tmp_path):
    import os
    import subprocess

    script = ROOT / "scripts" / "compare_serving.sh"
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "MODEL (required)" in out.stdout
    fake = tmp_path / "python"  # a "server" that fails at start-up
    fake.write_text("#!/bin/sh\necho 'loading the model'\necho 'ValueError: the last words of the server'\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "MODEL": "unused", "PY": str(fake), "OUT": str(tmp_path / "out"), "PORT": "39187"}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1
    assert "baseline server died" in out.stderr and "the last words of the server" in out.stderr
