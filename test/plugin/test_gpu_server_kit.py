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

from ess.core.memory import cache_bytes  # noqa: E402
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
                 "6617"}
    for device in ("cuda", "cpu"):
        args = server.parse(["/tmp/out", "--model", model, "--device", device])
        ess_flags.add(str(server.fit_tokens(args)))
        plan = server.gain_plan(args)
        lines = [server.flags(n, args) for n in server.SERVERS] + \
                [server.gain_flags(n, plan, args) for n in ("stock", "ess-none", "ess-da")]
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
    args = server.parse(["/tmp/out", "--model", model, "--gain", "--gain-stock-requests", "8"])
    plan = server.gain_plan(args)
    per_token = plan["layers"] * (656 + 132)
    assert plan["budget_bytes"] == 8 * plan["context"] * per_token
    ess = cache_bytes(plan["layers"], plan["context"], 656, 132, plan["ess_buffer_tokens"])  # slots, tables, index-K
    assert plan["ess_requests"] * ess <= plan["budget_bytes"] < (plan["ess_requests"] + 1) * ess
    assert plan["ess_buffer_tokens"] >= 2049 and plan["ess_requests"] == 23  # 32K, ratio 0.2: as on the H200


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
