"""The disk benchmarks' smoke runs (tiny sizes): each writes its JSON and leaves no scratch file behind."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_disk_pages_smoke_run(tmp_path):
    out = tmp_path / "disk.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "disk_pages.py"), "--smoke", "--dir", str(tmp_path),
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    if run.returncode and "direct I/O (O_DIRECT) refused" in run.stderr:
        pytest.skip("this filesystem refuses direct I/O")
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert {r["op"] for r in doc["rows"]} == {"read", "write"} and all(r["mb_per_s"] > 0 for r in doc["rows"])
    assert not list(tmp_path.glob("ess_disk_pages_*"))


def test_disk_tier_calls_smoke_run(tmp_path):
    """benchmark/disk_tier_calls.py: the tier's three kinds of call, timed on a small file."""
    out = tmp_path / "calls.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "disk_tier_calls.py"), "--smoke", "--dir", str(tmp_path),
                          "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["pages_per_call"] == 64 and set(doc["median_ms"]) == {"fresh_ms", "held_ms", "faults_ms"}
    assert not [p for p in tmp_path.iterdir() if p.name != "calls.json"]  # the page file went with the tier
