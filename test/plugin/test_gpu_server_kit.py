"""benchmark/gpu/server.py's launch lines and plans, checked where a GPU is not needed: every flag it gives SGLang
parses in SGLang 0.5.23 (an ambiguous or unknown one would cost a device call), the batch fits one context, the gain
plan puts stock and ESS under one cache budget, and SGLang's decode log lines are read back. The servers themselves
run in the CPU rehearsal (scripts/gpu_rehearsal.sh, in CI) and on the GPU (docs/gpu-server.md)."""

import argparse
import importlib.util
import json
import os

import pytest

pytest.importorskip("sglang")

from ess.reference import checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpu_server", os.path.join(ROOT, "benchmark", "gpu", "server.py"))
server = importlib.util.module_from_spec(_spec)  # benchmark/gpu/server.py
_spec.loader.exec_module(server)


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(checkpoint.config(mtp=False, full=True)))
    return str(tmp_path)


def sglang_parser():
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p


def test_every_flag_parses_in_sglang(model):
    p = sglang_parser()
    ess_flags = {"--enable-ess", "--ess-overlap", "--ess-buffer-tokens", "--ess-residency", "none", "da", "off", "2560",
                 "6976"}
    for device in ("cuda", "cpu"):
        args = server.parse(["/tmp/out", "--model", model, "--device", device])
        ess_flags.add(str(server.fit_tokens(args)))
        plan = server.gain_plan(args)
        lines = [server.flags(n, args) for n in server.SERVERS] + \
                [server.gain_flags(n, plan, args) for n in ("stock", "ess-none", "ess-da", "ess-none-at-stock",
                                                            "hisparse")]
        for line in lines:
            ns, unknown = p.parse_known_args(["--model-path", model, *line])
            assert set(unknown) <= ess_flags, unknown  # the plugin adds --ess-* at launch
            if device == "cuda":
                assert ns.disable_prefill_cuda_graph and ns.attention_backend == "dsa"


def test_the_batch_fits_one_context():
    args = server.parse(["/tmp/out", "--model", "m", "--lengths", "4096,32768", "--requests", "8"])
    prompts = [4096 + (32768 - 4096) * i // 7 for i in range(8)]
    assert server.context_length(args) >= sum(prompts) + 8 * args.new_tokens
    assert server.context_length(args) % 64 == 0


def test_gain_plan_one_budget(model):
    """Every device byte charged on both sides (the servers' own counts, which their readouts are checked against):
    at 32K in / 256 out the plan admits 22 ESS requests where the uncharged staging, scratch, location map and
    padding row let it claim 23."""
    from sglang_ess.sizing import ess_device_bytes, stock_device_bytes

    args = server.parse(["/tmp/out", "--model", model, "--gain", "--gain-stock-requests", "8", "--gain-output", "256"])
    plan = server.gain_plan(args)
    L, ctx, C, width = plan["layers"], plan["context"], plan["ess_buffer_tokens"], plan["context"] + 4
    assert plan["budget_bytes"] == stock_device_bytes(L, 8 * ctx + 64) + 9 * width * 4
    n = plan["ess_requests"]

    def ess(k):
        return ess_device_bytes(L, k * ctx + 64, k + 1, C, width, k + 1, ctx).total + (k + 1) * width * 4

    assert ess(n) <= plan["budget_bytes"] < ess(n + 1)
    assert plan["ess_buffer_tokens"] >= 2049 and n == 22 and plan["prompts"] == 24  # 3x stock's 8, all at once
    plan = server.gain_plan(server.parse(["/tmp/out", "--model", model, "--gain"]))  # 2K out: the same 22
    assert plan["context"] == 34880 and plan["ess_requests"] == 22
    assert server.gain_servers(args, plan) == ["stock", "ess-none", "ess-none-at-stock", "hisparse"]
    assert [server.gain_requests(s, plan) for s in server.gain_servers(args, plan)] == [8, 22, 8, 21]


def test_hisparse_plan_holds_as_many_requests_as_its_pool_can_under_the_budget(model):
    """SGLang's HiSparse under stock's budget: N device rows of latent and N x r of index-K hold n requests' device
    buffers (ESS's C, in pages) and one prefilling context with a chunk of margin, N x r their contexts."""
    plan = server.gain_plan(server.parse(["/tmp/out", "--model", model, "--gain"]))
    h, ctx, L = plan["hisparse"], plan["context"], plan["layers"]
    assert h["device_buffer"] == plan["ess_buffer_tokens"] == 6976 and h["device_buffer"] % 64 == 0
    n, N, r = h["requests"], h["device_tokens"], h["ratio"]
    assert N >= (n - 1) * (6976 + 64) + ctx + 8192 and N * r >= n * ctx and N % 64 == 0
    assert h["bytes"] == L * ((N + 64) * 656 + (N * r + 64) * 132) + (n + 1) * (ctx + 4) * 4 <= plan["budget_bytes"]
    more = server.hisparse_plan(plan["budget_bytes"], L, ctx, 6976, 2048)
    assert more == h and n == 21
    line = server.gain_flags("hisparse", plan, server.parse(["/tmp/out", "--model", model, "--gain"]))
    config = json.loads(line[line.index("--hisparse-config") + 1])
    assert config == {"top_k": 2048, "device_buffer_size": 6976, "host_to_device_ratio": r}
    assert {"--enable-hisparse", "--disable-radix-cache"} <= set(line)
    tiny = server.hisparse_plan(10**6, 2, 384, 128, 64)  # nothing fits: no HiSparse server
    assert tiny == {"requests": 0}


def test_the_gain_run_fails_when_esss_device_bytes_pass_stocks(model):
    plan = server.gain_plan(server.parse(["/tmp/out", "--model", model, "--gain"]))
    stock_gib = plan["stock_bytes"]["pool"] / (1 << 30)
    table = plan["ess_bytes"]["request_table"]
    servers = {"stock": {"device": {"memory_usage": {"kvcache": round(stock_gib, 3)}}},
               "ess-none": {"device": {"ess_measured": plan["ess_bytes"]["total"], "request_table": table}}}
    assert server.check_device_bytes(servers, plan) == []
    over = plan["budget_bytes"] - table + 1
    servers["ess-none"]["device"]["ess_measured"] = over
    assert server.check_device_bytes(servers, plan) == [f"ess-none: {over} + {table} device bytes, over stock's "
                                                        f"{plan['budget_bytes']}"]
    servers["stock"]["device"]["memory_usage"]["kvcache"] = round(stock_gib, 3) + 0.002  # not the plan's stock
    assert len(server.check_device_bytes(servers, plan)) == 2


def test_gain_ratios_whole_run_decode_and_overhead():
    servers = {"stock": {"bench": {"output_throughput": 100.0, "mean_ttft_ms": 50.0, "mean_itl_ms": 5.0},
                         "decode": {"median_gen_throughput": 1000.0}},
               "ess-none": {"bench": {"output_throughput": 150.0}, "decode": {"median_gen_throughput": 1400.0}},
               "ess-none-at-stock": {"bench": {"output_throughput": 99.0, "mean_ttft_ms": 51.0, "mean_itl_ms": 5.1},
                                     "decode": {"median_gen_throughput": 990.0}},
               "hisparse": {"bench": {"output_throughput": 120.0}, "decode": {"median_gen_throughput": 1100.0}}}
    got = server.gain_ratios(servers)
    assert got["over_hisparse_ess-none"] == 1.25 and "over_hisparse_ess-none-at-stock" not in got
    assert got["whole_run_gain_hisparse"] == 1.2 and got["decode_gain_hisparse"] == 1.1
    assert got["whole_run_gain_ess-none"] == 1.5 and got["decode_gain_ess-none"] == 1.4
    assert got["overhead_ess-none-at-stock"] == {"mean_ttft_ms": 1.02, "mean_itl_ms": 1.02}


def test_decode_throughput_reads_sglangs_log_lines():
    log = "\n".join([
        "[t] Decode batch, #running-req: 7, #token: 9, token usage: 1.00, cuda graph: True, gen throughput (token/s): 5.0, #queue-req: 0",
        "[t] Decode batch, #running-req: 8, #token: 9, token usage: 1.00, cuda graph: True, gen throughput (token/s): 1573.12, #queue-req: 0",
        "[t] Decode batch, #running-req: 8, #token: 9, token usage: 1.00, cuda graph: True, gen throughput (token/s): 1500.5, #queue-req: 0",
        "[t] Decode batch, #running-req: 8, #token: 9, token usage: 1.00, cuda graph: True, gen throughput (token/s): 1600, #queue-req: 0",
    ])
    got = server.decode_throughput(log, 8)
    assert got["lines_at_full_batch"] == 3 and got["median_gen_throughput"] == 1573.12


def test_bad_arguments_are_refused_naming_the_flag(capsys):
    for argv, flag in ((["--servers", "stock,bogus"], "--servers"), (["--lengths", "9"], "--lengths"),
                       (["--lengths", "10,5"], "--lengths")):
        with pytest.raises(SystemExit):
            server.parse(["/tmp/out", "--model", "m", *argv])
        assert flag in capsys.readouterr().err


def test_full_width_checkpoint_config_and_refusal(tmp_path):
    cfg = checkpoint.config(mtp=False, full=True)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]) == (7168, 128, 1536, 512)
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"], cfg["vocab_size"]) == (64, 128, 2048, 129280)
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 4  # all dense: no MoE kernel needed
    with pytest.raises(ValueError, match="--no-mtp"):
        checkpoint.write(str(tmp_path / "m"), full=True)
    assert not (tmp_path / "m").exists()


def test_moe_fp8_mtp_checkpoint_flags_parse_and_report_its_layer_mix(tmp_path, capsys):
    """The full-width MoE / FP8 checkpoint with its MTP layer (issue 57): SGLang's Triton FP8 and MoE runners on the
    rig, EAGLE of 1 and 3 draft steps (top-1), ESS's buffer at least each verify row's top-k set and token; every line
    parses in SGLang; server.json's layer_mix says what the checkpoint holds. --mtp is refused with --gain (its plan
    does not charge the draft's cache) and on a checkpoint without an MTP layer, naming the flag."""
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(checkpoint.config(full=True, fp8=True, moe_layers=4)))
    p = sglang_parser()
    for steps in (1, 3):
        args = server.parse(["/tmp/out", "--model", str(model), "--mtp", str(steps), "--buffer-tokens", "2560"])
        line = server.flags("ess-none", args)
        ns, unknown = p.parse_known_args(["--model-path", str(model), *line])
        assert (ns.speculative_algorithm, ns.speculative_num_steps, ns.speculative_eagle_topk,
                ns.speculative_num_draft_tokens) == ("EAGLE", steps, 1, steps + 1)
        assert (ns.fp8_gemm_runner_backend, ns.moe_runner_backend) == ("triton", "triton")
        assert ns.speculative_dsa_topk_backend == ns.dsa_topk_backend == "torch"  # the draft's on the rig too
        buffer = int(line[line.index("--ess-buffer-tokens") + 1])
        assert buffer == max(2560, (steps + 1) * 2049)
        assert set(unknown) <= {"--enable-ess", "--ess-overlap", "none", "--ess-buffer-tokens", str(buffer)}
    assert server.layer_mix(server.model_config(args)) == {
        "layers": 7, "dense": 3, "moe": 4, "routed_experts": 32, "experts_per_token": 1, "shared_experts": 1,
        "fp8": True, "mtp_layers": 1}
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(checkpoint.config(mtp=False, full=True)))
    assert server.layer_mix(server.model_config(server.parse(["/tmp/out", "--model", str(dense)])))["moe"] == 0
    assert "--fp8-gemm-backend" not in server.flags("stock", server.parse(["/tmp/out", "--model", str(dense)]))
    for argv in (["--model", str(model), "--mtp", "1", "--gain"], ["--model", str(dense), "--mtp", "1"]):
        with pytest.raises(SystemExit):
            server.parse(["/tmp/out", *argv])
        assert "--mtp" in capsys.readouterr().err
