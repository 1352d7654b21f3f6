import json

import numpy as np
import pytest

from ess.cli import main
from ess.trace import Trace, TraceError, load_trace, save_trace

SMALL = ["--batch", "2", "--context", "96", "--steps", "3", "--layers", "2", "--topk", "16", "--quiet"]


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_json(capsys):
    doc = run_json(capsys, ["demo", *SMALL])
    for key in ("config", "batch", "context", "decode_steps", "tokens_per_s", "latent_cache_bytes", "tokens_sha256"):
        assert key in doc
    assert doc["latent_cache_bytes"] == 2 * 99 * 2 * 656


def test_demo_ess_json(capsys):
    doc = run_json(capsys, ["demo", *SMALL, "--ess", "--buffer-tokens", "24", "--device-mem-gib", "0.01"])
    assert doc["tokens_identical"] is True
    assert doc["ess"]["tokens_sha256"] == doc["tokens_sha256"]
    assert len(doc["ess"]["per_layer"]) == 2 and doc["ess"]["total_misses"] > 0
    assert doc["ess"]["gpu_latent_bytes"]["ess"] < doc["ess"]["gpu_latent_bytes"]["baseline"]
    assert doc["max_batch"]["ess"] > doc["max_batch"]["baseline"] > 0


def test_demo_buffer_below_topk_is_an_error(capsys):
    assert main(["demo", *SMALL, "--ess", "--buffer-tokens", "10"]) == 2
    assert "below top-k + 1 = 17" in capsys.readouterr().err


def _trace(tmp_path):
    rng = np.random.default_rng(0)
    R, steps, layers, K = 2, 5, 3, 4
    ctx = np.array([20, 30], dtype=np.int64)
    topk = np.full((R, steps, layers, K), -1, dtype=np.int32)
    for r in range(R):
        for t in range(steps):
            for l in range(layers):
                topk[r, t, l] = rng.choice(int(ctx[r]) + t + 1, K, replace=False)
    pre = rng.integers(0, 20, (R, 32, layers, K)).astype(np.int32)
    return Trace(topk, ctx, pre, {"source": "test"})


def test_cache_replay_cli(tmp_path, capsys):
    path = tmp_path / "t.npz"
    save_trace(path, _trace(tmp_path))
    assert load_trace(path).meta == {"source": "test"}
    doc = run_json(capsys, ["cache", "replay", str(path), "--buffer", "6", "--warmup", "--quiet"])
    misses = np.array(doc["misses"])
    assert misses.shape == (2, 5, 3) and misses[:, 0].sum() > 0


def test_corrupt_traces_are_rejected_with_the_problem_named(tmp_path, capsys):
    good = _trace(tmp_path)
    path = tmp_path / "t.npz"
    save_trace(path, good)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(TraceError, match="not a readable trace"):
        load_trace(truncated)
    np.savez(tmp_path / "shape.npz", topk=good.topk[0], context_len=good.context_len)
    with pytest.raises(TraceError, match="'topk' must be"):
        load_trace(tmp_path / "shape.npz")
    future = good.topk.copy()
    future[0, 0, 0, 0] = 21  # context 20, step 0: position 21 is in the future
    np.savez(tmp_path / "future.npz", topk=future, context_len=good.context_len)
    with pytest.raises(TraceError, match="future position"):
        load_trace(tmp_path / "future.npz")
    np.savez(tmp_path / "missing.npz", topk=good.topk)
    with pytest.raises(TraceError, match="missing field 'context_len'"):
        load_trace(tmp_path / "missing.npz")
    assert main(["cache", "replay", str(truncated), "--buffer", "6", "--quiet"]) == 2
    assert "not a readable trace" in capsys.readouterr().err
