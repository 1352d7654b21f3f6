import json
import os

import numpy as np
import pytest

from ess.cli import main
from ess.core.trace import Trace, TraceError, load_trace, save_trace

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
    doc = run_json(capsys, ["demo", *SMALL, "--ess", "--ess-buffer-tokens", "24", "--device-mem-gib", "0.01"])
    assert doc["tokens_identical"] is True
    assert doc["ess"]["tokens_sha256"] == doc["tokens_sha256"]
    assert len(doc["ess"]["per_layer"]) == 2 and doc["ess"]["total_misses"] > 0
    assert doc["ess"]["gpu_latent_bytes"]["ess"] < doc["ess"]["gpu_latent_bytes"]["baseline"]
    assert doc["max_batch"]["ess"] > doc["max_batch"]["baseline"] > 0


def test_demo_buffer_below_topk_is_an_error(capsys):
    assert main(["demo", *SMALL, "--ess", "--ess-buffer-tokens", "10"]) == 2
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


SYNTH = ["--requests", "1", "--steps", "2", "--layers", "2", "--topk", "16", "--context", "64", "--window", "4",
         "--sinks", "2", "--pool", "32", "--churn-min", "1", "--churn-max", "2"]


def _fail(capsys, argv) -> str:
    """Runs a command that must refuse: exit code 2, one line on stderr (no traceback); returns that line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.fixture
def bad_files(tmp_path, capsys):
    good = tmp_path / "good.npz"
    assert main(["trace", "synth", "--out", str(good), *SYNTH]) == 0
    raw = good.read_bytes()
    (tmp_path / "corrupt.npz").write_bytes(raw[: len(raw) // 2] + b"\0" * 100 + raw[len(raw) // 2 + 100 :])
    (tmp_path / "text.npz").write_text("hello")
    np.save(tmp_path / "array.npy", np.zeros(3))
    (tmp_path / "plan.json").write_bytes(b"\xff\xfe\x00not utf-8")
    fields = dict(np.load(good))
    np.savez(tmp_path / "meta_list.npz", **{**fields, "meta": np.array("[1, 2]")})
    np.savez(tmp_path / "no_steps.npz", **{**fields, "topk": fields["topk"][:, :0]})
    capsys.readouterr()
    return tmp_path


DEMO = ["demo", "--quiet", "--steps", "1", "--context", "64"]
BAD = [  # (argv, with {d} the files' folder; what the one line must name)
    (DEMO + ["--layers", "0"], "--layers"),
    (DEMO + ["--topk", "0"], "--topk"),
    (DEMO + ["--device-mem-gib", "-1"], "--device-mem-gib"),
    (DEMO + ["--ess", "--ess-buffer-tokens", "3"], "--ess-buffer-tokens"),
    (DEMO + ["--overlap", "da", "--ess-buffer-tokens", "30"], "used only with --ess"),
    (DEMO + ["--no-warmup"], "--no-warmup"),
    (DEMO + ["--ess", "--overlap", "plan"], "--layer-plan"),
    (DEMO + ["--ess", "--overlap", "plan", "--layer-plan", "{d}/plan.json"], "plan.json"),
    (["cache", "replay", "{d}/corrupt.npz", "--buffer", "20"], "corrupt.npz"),
    (["cache", "replay", "{d}/text.npz", "--buffer", "20"], "text.npz"),
    (["cache", "replay", "{d}/array.npy", "--buffer", "20"], "array.npy"),
    (["cache", "replay", "{d}/good.npz", "--buffer", "20", "--warmup-windows", "-3"], "--warmup-windows"),
    (["profile", "{d}/meta_list.npz", "--quiet"], "meta_list.npz"),
    (["profile", "{d}/no_steps.npz", "--quiet"], "no_steps.npz"),
    (["profile", "{d}/good.npz", "--buffer-tokens", "100", "--quiet"], "--buffer-tokens"),
    (["sim", "run", "--profile", "{d}/good.npz", "--batch-size", "8", "--sparse-ratio", "0.2"], "good.npz"),
    (["sim", "run", "--ep", "0", "--batch-size", "8"], "--ep"),
    (["sim", "sweep", "--batch-step", "0"], "--batch-step"),
]


@pytest.mark.parametrize("argv, names", BAD, ids=[" ".join(a[:2] + a[-2:]) for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_flag_or_file(bad_files, capsys, argv, names):
    line = _fail(capsys, [a.format(d=bad_files) for a in argv])
    assert names in line and "Traceback" not in line


def test_outputs_go_exactly_where_asked_folders_created(tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "trace"  # no .npz: written as given, not as trace.npz
    assert main(["trace", "synth", "--out", str(out), *SYNTH]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    assert load_trace(out).topk.shape == (1, 2, 2, 16)
    plot = tmp_path / "plots" / "sweep.png"
    assert main(["sim", "sweep", "--batch-max", "16", "--plot", str(plot), "--json"]) == 0
    assert plot.stat().st_size > 0


def test_sim_tables_say_which_system_and_why_a_batch_does_not_fit(capsys):
    assert main(["sim", "sweep", "--batch-min", "48", "--batch-max", "56", "--batch-step", "8"]) == 0
    table = capsys.readouterr().out
    assert "baseline" in table and "hisparse" in table and "ess" in table
    assert "0.9999999" not in table
    assert main(["sim", "paper"]) == 0
    assert "no (max " in capsys.readouterr().out
    doc = run_json(capsys, ["sim", "paper"])
    assert len(doc["rows"]) == 18 and doc["dsv3_check"]["throughput"] > 0


def test_sim_calibrate_prints_a_table_and_saves_with_out(tmp_path, capsys):
    out = tmp_path / "cal" / "fit.json"
    assert main(["sim", "calibrate", "--out", str(out)]) == 0
    assert "written to" in capsys.readouterr().out
    assert json.loads(out.read_text())["eta_compute"] > 0


def test_tiny_checkpoint_is_deterministic_and_never_overwrites(tmp_path, capsys):
    pytest.importorskip("safetensors")
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["tiny-checkpoint", str(a)]) == 0 and main(["tiny-checkpoint", str(b)]) == 0
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32" and config["index_topk"] == 64 and config["kv_lora_rank"] == 512
    assert config["num_nextn_predict_layers"] == 1 and config["vocab_size"] >= 256
    assert main(["tiny-checkpoint", str(a)]) == 2
    assert "already holds config.json" in capsys.readouterr().err
    assert main(["tiny-checkpoint", str(tmp_path / "c"), "--seed", "1"]) == 0
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


@pytest.mark.parametrize("argv, message", [
    (["--server", "--ess"], "--ess: options of the mini-model demo"),
    (["--server", "--server-modes", "dba"], "--server-modes: a comma-separated list of none and da"),
    (["--server", "--server-model", "/nonexistent"], "--server-model /nonexistent: no config.json there"),
])
def test_server_demo_refuses_bad_flags_before_starting_anything(capsys, argv, message):
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def places(tmp_path):
    """A trace, a directory, a file and a trace with no requests, for the bad-input cases."""
    from ess.core.trace import Trace

    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "similarity.png").write_bytes(b"an earlier run's plot")
    assert main(["trace", "synth", "--out", str(tmp_path / "t.npz"), "--steps", "2", "--layers", "2"]) == 0
    np.savez(tmp_path / "empty.npz", topk=np.zeros((0, 3, 2, 4), np.int32), context_len=np.zeros(0, np.int64),
             meta=np.array(json.dumps({})))
    assert Trace  # the format the empty one breaks
    return {k: str(tmp_path / v) for k, v in dict(T="t.npz", DIR="adir", FILE="afile", UNDER="afile/x.npz",
                                                   EMPTY="empty.npz", MISSING="missing", NEW="new.npz",
                                                   TXT="plot.txt", PLOTS="plots",
                                                   PNG="plots/similarity.png").items()}


BAD_INPUTS = [  # argv (placeholders from `places`), the message; every one refused before any work
    (["trace", "synth", "--out", "DIR"], "argument --out: .*adir: is a directory, not a file"),
    (["trace", "synth", "--out", "UNDER"], "afile is a file, not a directory"),
    (["trace", "record", "--out", "DIR"], "argument --out: .*: is a directory, not a file"),
    (["profile", "T", "--plot", "FILE"], "argument --plot: .*afile: exists and is not a directory"),
    (["profile", "T", "--out", "DIR"], "argument --out: .*: is a directory, not a file"),
    (["sim", "sweep", "--plot", "DIR"], "argument --plot: .*adir: is a directory, not a file"),
    (["sim", "calibrate", "--out", "UNDER"], "is a file, not a directory"),
    (["plan", "--profile", "T", "--batch-size", "8", "--out", "DIR"], "argument --out: .*: is a directory, not a file"),
    (["cache", "replay", "T", "--buffer", "4096", "--policy", "lru", "--lookahead", "4"],
     "--lookahead is the prefetch policy's; --policy lru would ignore it"),
    (["cache", "replay", "T", "--buffer", "4096", "--decay-shift", "3"], "--decay-shift is the score policy's"),
    (["trace", "record", "--out", "NEW", "--lookahead", "100000"],
     "--lookahead 100000: the indexer ranks at most --context \\+ --steps = 2080 positions, top-k 64 of them selected: "
     "at most 2016 can follow"),
    (["sim", "run", "--batch-size", "8", "--nvme-gbps", "5"], "--nvme-gbps is the disk tier's drive bandwidth"),
    (["sim", "sweep", "--batch-min", "64", "--batch-max", "8"], "--batch-min 64 is above --batch-max 8"),
    (["sim", "run", "--batch-size", "8", "--context", "1000000000000"], "dsv32 serves at most 163840 positions"),
    (["trace", "synth", "--out", "NEW", "--context", "1000000000000"], "a trace's positions are int32"),
    (["demo", "--context", "1000000000000"], "the mini model serves at most 65536 positions"),
    (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["demo", "--ess", "--disk-dir", "MISSING", "--host-budget-mib", "64"], "--disk-dir .*missing: no such directory"),
    (["cache", "replay", "EMPTY", "--buffer", "8"], "'topk' holds no requests"),
    # outputs: an existing file only with --force, never an input; empty paths; a plot's format
    (["trace", "synth", "--out", "T"], "--out .*t.npz: exists; give --force to overwrite it"),
    (["profile", "T", "--out", "T", "--force"], "--out .*t.npz: that is an input of this command"),
    (["trace", "synth", "--out", ""], "argument --out: an empty path"),
    (["sim", "sweep", "--plot", "TXT"], "a plot's name ends in one of matplotlib's formats"),
    (["tiny-checkpoint", "UNDER"], "afile is a file, not a directory"),
    (["profile", "T", "--plot", "PLOTS"], "--plot .*plots: holds similarity.png already; give --force"),
    # bounds from the machine, the hardware, the trace, the model
    (["trace", "synth", "--out", "NEW", "--seed", "-1"], "argument --seed: a seed is an integer from 0 to 2\\^63 - 1"),
    (["trace", "synth", "--out", "NEW", "--requests", "1000000000000"], "GiB of memory free here"),
    (["sim", "sweep", "--batch-max", "1000000000000"], "hold the index-K rows of at most"),
    (["sim", "run", "--batch-size", "64", "--sparse-ratio", "1e-9"], "below top-k \\+ 1 = 2049"),
    (["sim", "calibrate", "--hardware", "H20"], "measured on H200"),
    (["sim", "run", "--batch-size", "8", "--ep", "1000"], "--ep 1000: dsv32 has 256 routed experts"),
    (["sim", "run", "--batch-size", "8", "--mtp", "1000000000000"], "draft tokens go past the --context 32768"),
    (["trace", "synth", "--out", "NEW", "--layers", "1", "--churn-min", "1"], "with --layers 1 the one layer takes"),
    (["cache", "replay", "T", "--buffer", "1000000000000"], "--buffer-tokens 1000000000000: more slots than the trace"),
    (["demo", "--batch", "1000000000000", "--device", "cpu"], "of caches beside"),
    (["demo", "--ess", "--ess-buffer-tokens", "100000"], "more slots than the --context \\+ --steps"),
    (["demo", "--device-mem-gib", "inf"], "must be a positive, finite number"),
    (["demo", "--ess", "--disk-dir", "DIR", "--host-budget-mib", "1e-12"], "hold no 41984-byte page"),
    (["trace", "record", "--out", "NEW", "--topk", "5000", "--context", "128"], "--topk 5000: more than the --context 128"),
    # `ess sim pd`: bandwidths, contexts, the profile, the ratio's slots at each context
    (["sim", "pd", "--link-gbps", "100,0"], "argument --link-gbps: a link's bandwidth must be a positive, finite"),
    (["sim", "pd", "--link-gbps", "-25"], "argument --link-gbps: a link's bandwidth must be a positive, finite"),
    (["sim", "pd", "--link-gbps", "inf"], "argument --link-gbps: a link's bandwidth must be a positive, finite"),
    (["sim", "pd", "--contexts", "32Q"], "argument --contexts: expected contexts like 32K,128K or 131072, got '32Q'"),
    (["sim", "pd", "--contexts", "1000K"], "--contexts 1024000: dsv32 serves at most 163840 positions"),
    (["sim", "pd", "--profile", "MISSING"], "--profile .*missing: not a readable miss profile"),
    (["sim", "pd", "--profile", "T"], "--profile .*t.npz: not a readable miss profile"),
    (["sim", "pd", "--sparse-ratio", "0.01"], "--sparse-ratio 0.01 of 32768 tokens: .*below top-k \\+ 1"),
    (["sim", "pd", "--accept", "5"], "--accept 5.0: between 1 and --mtp \\+ 1 = 3"),
    (["sim", "pd", "--plot", "TXT"], "a plot's name ends in one of matplotlib's formats"),
    # flags another flag would make meaningless
    (["sim", "run", "--batch-size", "8", "--disk-tier"], "--disk-tier: ESS settings; give --sparse-ratio"),
    (["sim", "run", "--batch-size", "8", "--sparse-ratio", "0.2", "--no-tbo", "--overlap", "dba"],
     "needs two-batch overlap"),
    (["cache", "replay", "T", "--buffer", "100", "--warmup-windows", "5"], "give --warmup too"),
    (["cache", "replay", "T", "--buffer", "100", "--policy", "belady", "--kernel", "fused"], "--kernel chooses"),
    (["profile", "T", "--ratios", "0.3", "--buffer-tokens", "100"], "give one"),
    (["demo", "--server-modes", "da"], "options of `ess demo --server`; give --server too"),
    (["demo", "--server", "--context", "5"], "--context: options of the mini-model demo"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a[:2]) + f" {i}" for i, (a, _) in enumerate(BAD_INPUTS)])
def test_bad_inputs_are_refused_before_any_work(places, capsys, argv, message):
    import re

    capsys.readouterr()
    before = {p: os.path.getmtime(p) for p in places.values() if os.path.exists(p)}
    try:
        rc = main([places.get(a, a) for a in argv])
    except SystemExit as e:  # argparse's own refusal of a flag's value
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert before == {p: os.path.getmtime(p) for p in places.values() if os.path.exists(p)}  # nothing written over


def test_a_disk_that_cannot_hold_the_page_file_is_refused_before_the_model_runs(tmp_path, capsys, monkeypatch):
    """`ess demo --disk-dir D`: the disk tier's page file (every page of the batch) is compared with D's free space
    before any work, and a disk too small is refused naming the flag."""
    import types

    from ess.reference.model import MiniModel

    def ran(*args, **kwargs):
        raise AssertionError("the model ran before the refusal")

    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=1, f_frsize=4096))  # 4 KiB free
    monkeypatch.setattr(MiniModel, "generate", ran)
    line = _fail(capsys, ["demo", *SMALL, "--ess", "--ess-buffer-tokens", "24", "--host-budget-mib", "1",
                          "--disk-dir", str(tmp_path)])
    assert f"--disk-dir {tmp_path}: the disk tier's page file needs" in line and "free there" in line


@pytest.mark.parametrize("requests, context, message", [
    (1, 10**12, "a trace's positions are int32, at most 2147483647"),  # the allocator's message before
    (1024, 2**30, "of memory free here"),  # int32 positions, but 1024 requests' tables take 4 TiB a layer
])
def test_a_trace_too_long_to_replay_or_profile_is_refused_naming_the_file_and_its_field(tmp_path, capsys, requests, context,
                                                                               message):
    path = tmp_path / "long.npz"
    topk = np.broadcast_to(np.arange(4, dtype=np.int32), (requests, 2, 1, 4)).copy()
    save_trace(path, Trace(topk, np.full(requests, context, dtype=np.int64)))
    for command in (["cache", "replay", str(path), "--buffer", "8"], ["profile", str(path), "--buffer-tokens", "8"]):
        line = _fail(capsys, [*command, "--quiet"])
        assert f"{path}: 'context_len' {context} + 2 decode steps: " in line and message in line, command
