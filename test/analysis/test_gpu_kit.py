"""The GPU kit's smoke run: every part on the CPU with tiny sizes and the torch reference in place of FlashMLA."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_kit_smoke_run_writes_every_key(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    subprocess.run(["bash", str(ROOT / "benchmark" / "gpu" / "run.sh"), "--smoke", str(tmp_path)], check=True, env=env,
                   timeout=300)
    kit = json.loads((tmp_path / "kit.json").read_text())
    for key in ("device", "torch", "date", "flashtrans", "flashmla", "da_split", "cuda_graph",
                "bookkeeping_us_per_layer", "overlap"):
        assert key in kit, key
    assert "not a measurement" in kit["device"]
    ft = kit["flashtrans"]
    assert ft["exact"] and {"h2d_gbps", "d2h_gbps", "contiguous_h2d_gbps", "contiguous_d2h_gbps", "backend"} <= set(ft)
    assert kit["flashmla"]["equal"]  # ESS's slots and indices read the same rows as the whole cache
    assert kit["da_split"]["max_rel_err_vs_unsplit"] < 1e-5
    assert kit["cuda_graph"]["ok"] is None  # no CUDA graphs on the CPU, and the kit says so
    assert set(kit["overlap"]["exposed_ms"]) == {"none", "da", "dba"}
    for png in ("flashtrans.png", "da_split.png", "overlap.png"):
        assert (tmp_path / png).stat().st_size > 0
