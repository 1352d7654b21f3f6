"""The decode-throughput benchmark's smoke run on the CPU: every mode, the keys decode.json promises, the plot."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = {"context", "mode", "ratio", "batch", "step_ms", "tokens_per_s", "exposed_transfer_ms",
        "misses_per_request_layer", "simulator_step_ms"}


def test_decode_gpu_smoke_run(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.png").exists() and doc["date"] and "smoke" in doc["machine"]
    assert {r["mode"] for r in doc["rows"]} == {"baseline", "none", "da", "dba", "plan", "hisparse"}
    hisparse = [r for r in doc["rows"] if r["mode"] == "hisparse"]  # SGLang's default: 2 x top-k slots, decode only
    assert {r["query_rows"] for r in hisparse} == {1} and all(r["buffer_tokens"] == 2 * 64 for r in hisparse)
    assert doc["gain_vs_hisparse_max_batch"] > 0 and doc["hisparse_max_batch"]["batch"] == max(r["batch"] for r in hisparse)
    assert all(KEYS <= set(r) for r in doc["rows"])
    assert doc["gain_32k_max_batch"] > 0 and doc["ratio_small_batch"] > 0
    ess = [r for r in doc["rows"] if r["mode"] != "baseline"]
    assert all(r["misses_per_request_layer"] >= 0 and r["exposed_transfer_ms"] >= 0 for r in ess)
    assert {r["batch"] for r in doc["rows"]} >= {1, 2}
    assert "SYNTHETIC" in doc["topk_label"]
    assert {r["query_rows"] for r in ess} == {1, 2}  # decode, and MTP verify (2 rows in the smoke run)
    common = {"q_a", "kv_a", "indexer_topk", "pre_attn", "flashmla", "modelled_rest"}
    for r in doc["rows"]:  # decode rows: layer 0 part by part, beside the modelled rest
        if r["query_rows"] == 1:
            want = common if r["mode"] == "baseline" else common | {"lru_step", "h2d", "d2h"}
            assert set(r["parts_ms"]) == want and all(v >= 0 for v in r["parts_ms"].values()), r
            if r["mode"] != "baseline" and r.get("resident_requests") != r["batch"]:  # the misses' H2D beside the
                # same lists over a small buffer (none moves when every request is resident)
                p = r["h2d_probe"]
                assert p["rows"] >= 0 and p["small_buffer_ms"] >= 0 and p["host_pool_gib"] > 0, p
    # residency first: a batch of resident requests runs mode none, without a miss; one past the room mixes both
    # kinds in one attention call; the ratio to the baseline at every batch both ran
    ess_decode = [r for r in ess if r["mode"] != "hisparse"]
    for r in ess_decode:
        if r["resident_requests"] == r["batch"]:
            assert r["misses_per_request_layer"] == 0 and [x["mode"] for x in ess_decode if
                                                           (x["batch"], x["query_rows"]) == (r["batch"], r["query_rows"])] == ["none"]
    assert any(0 < r["resident_requests"] < r["batch"] for r in ess_decode)
    assert [x["batch"] for x in doc["ratio_by_batch"]] == [1, 2, 3] and doc["residency"] is True
    # the whole layer measured (the network modelled): every row's rest, part by part, beside the simulator's
    assert doc["whole_layer"] is True and doc["ep"] == 32 and doc["modelled_parts"][0].startswith("the EP all-to-all")
    assert doc["indexer_select"] == "keys"
    for r in doc["rows"]:
        rest = r["rest_ms"]
        assert {"moe_layer", "dense_layer", "comm_wait", "comm_modelled", "lm_head", "routed_experts", "attn_output",
                "modelled_rest"} <= set(rest) and rest["experts_gemm"] == "fp8 loop (the CPU's)" and rest["routed_pairs"] > 0, r
        assert r["step_ms"] >= r["attention_step_ms"] and r["model_step_ms"] > 0
    assert 0 <= doc["exposed_transfer_share"] < 1 and doc["exposed_transfer_mode"] == "plan"
    verify = [r for r in doc["rows"] if r["query_rows"] > 1 and r["mode"] != "hisparse"]
    assert verify and all(r["draft"].startswith("measured") and r["draft_ms"] > 0 for r in verify)
    assert len(doc["modelled_parts"]) == 1  # the draft passes measured too: only the network is left
    # the indexer against its byte floor at ESS's largest decode batch (CPU figures: the keys, not the values)
    assert doc["worst_over_floor"] > 0 and set(doc["indexer_over_floor"]) == {"256"}
    # lossless: every ESS mode gives the baseline's attention outputs (the split modes up to their log-sum-exp merge)
    for r in ess:
        assert r["max_abs_diff_vs_baseline"] <= (0.0 if r["mode"] == "none" else 1e-4), r


def test_the_summary_names_each_longer_context_and_the_hisparse_gain(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_gpu", ROOT / "benchmark" / "decode_gpu.py")
    D = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_gpu", D)  # its dataclasses look their module up there
    spec.loader.exec_module(D)

    def row(context, mode, batch, tps, ratio=None, query_rows=1):
        return {"context": context, "mode": mode, "ratio": ratio, "batch": batch, "query_rows": query_rows,
                "tokens_per_s": tps, "buffer_tokens": 4096}

    rows = [row(c, "baseline", b, 10.0 * b) for c in (32768, 131072) for b in (1, 2, 4)]
    rows += [row(c, "da", b, 9.0 * b, 0.2) for c in (32768, 131072) for b in (1, 2, 12)]
    rows += [row(32768, "hisparse", b, 8.0 * b) for b in (1, 2, 6)]
    rows += [row(131072, "baseline", 4, 20.0, query_rows=3), row(131072, "none", 12, 50.0, 0.2, query_rows=3)]
    out = D.summary(rows, D.smoke_setup())
    assert out["gain_32k_max_batch"] == 108 / 40 and out["gain_128k_max_batch"] == 108 / 40
    assert out["gain_128k_max_batch_mtp"] == 50 / 20  # MTP verify at the longer context, under its own key
    assert out["gain_vs_hisparse_max_batch"] == 108 / 48 and out["hisparse_gain_over_baseline"] == 48 / 40
    assert out["ratio_small_batch"] == 0.9


def test_a_bf16_stack_stays_lossless_and_a_failing_configuration_is_recorded(tmp_path, monkeypatch):
    """--dtype bf16 (the GPU default since the H200's float32 run): every ESS mode still gives the baseline's outputs;
    a configuration that raises is kept in decode.json's errors while the others run (one GPU lease is all there is)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_gpu", ROOT / "benchmark" / "decode_gpu.py")
    decode_gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_gpu", decode_gpu)  # its dataclasses look their module up there
    spec.loader.exec_module(decode_gpu)
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--dtype", "bf16",
                          "--modes", "baseline,none", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["dtype"] == "bfloat16" and doc["complete"] and doc["errors"] == []
    assert all(r["max_abs_diff_vs_baseline"] == 0.0 for r in doc["rows"] if r["mode"] == "none")
    real = decode_gpu.measure

    def measure(s, modes, batch, context, ratio, *rest):
        if ratio == 0.6 and batch == 2:
            raise RuntimeError("CUDA out of memory (planted)")
        return real(s, modes, batch, context, ratio, *rest)

    monkeypatch.setattr(decode_gpu, "measure", measure)
    assert decode_gpu.main(["--smoke", "--modes", "baseline,none", "--out", str(tmp_path / "e")]) == 1
    doc = json.loads((tmp_path / "e" / "decode.json").read_text())  # the smoke run: decode and a 2-row verify
    assert [(e["ratio"], e["batch"], e["query_rows"]) for e in doc["errors"]] == [(0.6, 2, 1), (0.6, 2, 2)]
    assert all("planted" in e["error"] for e in doc["errors"]) and doc["complete"]
    assert {(r["batch"], r["query_rows"]) for r in doc["rows"] if r["mode"] == "none"} == {(1, 1), (3, 1), (1, 2), (3, 2)}


def test_plan_on_measured_costs_and_a_bad_file_refused_before_any_stack(tmp_path):
    """--measured: mode plan chooses on a GPU run's ESS terms (the committed H200 files), and says so; a file that is
    not there is refused by name before anything runs or is written."""
    h200 = ROOT / "benchmark" / "results" / "gpu" / "h200"
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--modes", "none,plan",
                          "--measured", str(h200 / "kit.json"), str(h200 / "bookkeeping.json"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["plan_costs"]["device"] == "NVIDIA H200" and any(r["mode"] == "plan" for r in doc["rows"])
    bad = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--measured",
                          str(tmp_path / "nope.json"), "--out", str(tmp_path / "b")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--measured" in bad.stderr and "nope.json" in bad.stderr
    assert not (tmp_path / "b").exists()


def test_da_with_each_attn1_stays_lossless(tmp_path):
    """--attn1: DA's Attn1 in decode rows as the fused copy-attend or a second FlashMLA call (the plugin's default),
    not only the miss kernel: the smoke run's check still finds the baseline's outputs, and decode.json names it."""
    for kind in ("fused", "calls"):
        run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--attn1", kind,
                              "--modes", "baseline,da", "--out", str(tmp_path / kind)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        doc = json.loads((tmp_path / kind / "decode.json").read_text())
        assert doc["attn1"] == kind and doc["errors"] == []
        assert all(r["max_abs_diff_vs_baseline"] <= 1e-4 for r in doc["rows"] if r["mode"] == "da")


def test_the_hybrid_figures_stay_a_flag_away(tmp_path):
    """--rest modelled: the attention path measured and the simulator's rest of each layer (the figures before the
    whole layer was measured), and decode.json says so."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--rest", "modelled",
                          "--modes", "baseline,none", "--select", "fused", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["whole_layer"] is False and doc["indexer_select"] == "fused"  # how the indexer picked (GPU runs)
    assert doc["modelled_parts"][0] == "w_vc, o_proj, the MoE, the dense FFN and the EP all-to-all: the simulator's"
    assert all("rest_ms" not in r for r in doc["rows"])


def test_locality_fitted_to_real_traces_beside_the_papers(tmp_path):
    """--fit: ESS's largest batches again with the locality fitted to the real SmolLM2 traces (the committed fit,
    scaled to the stack's top-k and context), labelled, with their own summary against the same baseline; a file that
    is no fit report is refused by name."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--fit",
                          "--modes", "baseline,none", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "decode.json").read_text())
    fit = [r for r in doc["rows"] if r["locality"] == "fit"]
    top = max(r["batch"] for r in doc["rows"] if r["mode"] == "none")
    assert fit and {(r["mode"], r["batch"]) for r in fit} == {("none", top)} and set(doc["localities"]) == {"paper", "fit"}
    assert doc["locality_fit"]["gain_32k_max_batch"] > 0 and all(r["locality"] == "paper" for r in doc["rows"]
                                                                 if r["mode"] == "baseline")
    bad = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--fit",
                          str(ROOT / "README.md"), "--out", str(tmp_path / "b")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--fit" in bad.stderr and "README.md" in bad.stderr


def test_two_batch_overlap_runs_every_arm_lossless(tmp_path):
    """--tbo: from batch 2 every arm runs as two micro-batches in SGLang's two-batch overlap order; every ESS mode
    still gives the baseline's outputs (dba there one attention call: exactly), decode.json says which rows; without
    the measured rest it is refused (nothing to overlap the all-to-all with)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--tbo",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["tbo"] is True and doc["errors"] == []
    assert all(r["tbo"] == (r["batch"] >= 2) for r in doc["rows"])
    for r in doc["rows"]:
        if r["mode"] not in ("baseline",):
            exact = r["mode"] in ("none", "hisparse") or (r["mode"] == "dba" and r["query_rows"] == 1)
            assert r["max_abs_diff_vs_baseline"] <= (0.0 if exact else 1e-4), r
    bad = subprocess.run([sys.executable, str(ROOT / "benchmark" / "decode_gpu.py"), "--smoke", "--tbo", "--rest",
                          "modelled", "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tbo" in bad.stderr and not (tmp_path / "b").exists()
