"""`ess demo --server`: stock SGLang and SGLang with `--enable-ess` serving the same requests, on this machine.

The tiny random DeepSeek-V3.2 checkpoint (`ess tiny-checkpoint`, made in a temporary directory unless a model is
given) is served by `python -m sglang.launch_server --device cpu --kv-cache-dtype fp8_e4m3` (the plugin's CPU path
on a machine without a GPU): first stock, then with `--enable-ess --ess-buffer-tokens 96 --ess-residency off` once per
overlap mode (every request offloaded: 96 slots against a few hundred tokens miss every step), then with residency
first (the default: these requests fit the device, so ESS keeps every row there and runs stock's step). Each
server gets the same concurrent requests through the HTTP API (one batch of unequal prompts, greedy, the two most
likely tokens of every step returned), then `python -m sglang.benchmark.serving` with a few random prompts. The
report: per mode, whether every request's tokens equal stock SGLang's (where one differs: the step, and the top-2
logprob gap of stock's choice there), ESS's misses (rows fetched from the host pool per decode step, and as a share
of the rows the steps selected), the ESS pool's own log line, and the benchmark's figures (a CPU's: they show the
server works, not what a GPU gains).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from ess.reference import checkpoint
from ess.harness import servers as S

MODES = ("none", "da")  # DBA needs SGLang's two-batch overlap (docs/plugin.md), which the CPU path does not run


@dataclasses.dataclass(frozen=True)
class ServerDemoOptions:
    model: str | None = None  # a checkpoint directory; None: the tiny checkpoint, made in a temporary directory
    modes: tuple[str, ...] = MODES
    requests: int = 8
    prompt_lengths: tuple[int, int] = (200, 420)
    new_tokens: int = 32
    bench_prompts: int = 8
    seed: int = 0
    log_dir: str | None = None  # keep the servers' logs here (default: a temporary directory, removed)
    resident: bool = True  # also a server with residency first, where these requests fit


def first_difference(stock: dict, ess: dict) -> dict | None:
    """The first step where the ESS server chose another token than stock, with stock's top-2 logprob gap there."""
    a, b = stock["output_ids"], ess["output_ids"]
    step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if step is None:
        return None
    top = stock["meta_info"]["output_top_logprobs"][step]
    gap = top[0][0] - top[1][0] if len(top) > 1 else None
    return {"step": step, "stock_token": a[step], "ess_token": b[step], "stock_top2_logprob_gap": gap}


def bench(srv: S.Server, model: str, prompts: int, out_file: str) -> dict:
    """SGLang's serving benchmark against a running server: random token prompts of 256 tokens, 16 out."""
    result = srv.benchmark(model, prompts, 256, 16, out_file)
    return {k: result[k] for k in ("completed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")}


def serve(model: str, flags: list[str], log: str, opt: ServerDemoOptions, say) -> dict:
    say(f"starting: python -m sglang.launch_server --model-path {model} {' '.join(flags)}")
    with S.Server(model, flags, log) as srv:
        before = srv.state().get("ess")
        prompts = S.prompts(opt.requests, opt.prompt_lengths, opt.seed)
        answers = srv.generate(prompts, opt.new_tokens, top_logprobs=2)
        after = srv.state().get("ess")
        out = {"answers": answers, "pool_log": srv.log_lines("ESS pool:")}
        if after is not None:
            out["ess"] = {k: after[k] - before[k] for k in after if isinstance(after[k], int)} | {"modes": after["modes"]}
        say("benchmark: python -m sglang.benchmark.serving (random-ids)")
        out["bench"] = bench(srv, model, opt.bench_prompts, log + ".bench.jsonl")
        return out


def run_server_demo(opt: ServerDemoOptions, say=lambda text: None) -> dict:
    with S.terminate_as_exit(), tempfile.TemporaryDirectory(prefix="ess-demo-") as tmp:
        logs = opt.log_dir or tmp
        os.makedirs(logs, exist_ok=True)
        model = opt.model
        if model is None:
            model = os.path.join(tmp, "tiny-dsv32")
            checkpoint.write(model, seed=opt.seed)
            say(f"tiny DeepSeek-V3.2 checkpoint: {model}")
        stock = serve(model, S.CPU_FLAGS, os.path.join(logs, "stock.log"), opt, say)
        report = {"model": opt.model or "ess tiny-checkpoint", "requests": opt.requests,
                  "prompt_lengths": list(opt.prompt_lengths), "new_tokens": opt.new_tokens,
                  "stock": {"bench": stock["bench"]}, "ess": {}}
        runs = [(mode, S.ESS_FLAGS + ["--ess-overlap", mode]) for mode in opt.modes]
        if opt.resident:
            runs.append(("resident", S.ESS_RESIDENT_FLAGS))
        for mode, ess_flags in runs:
            got = serve(model, S.CPU_FLAGS + ess_flags, os.path.join(logs, f"ess-{mode}.log"), opt, say)
            diffs = [first_difference(a, b) for a, b in zip(stock["answers"], got["answers"])]
            c = got["ess"]
            report["ess"][mode] = {
                "tokens_identical": sum(d is None for d in diffs),
                "first_differences": [d for d in diffs if d is not None],
                "decode_forwards": c["forwards"],
                "forwards_without_misses": c["forwards_without_misses"],
                "missed_rows_per_forward": round(c["missed_rows"] / max(1, c["forwards"]), 1),
                "miss_share": round(c["missed_rows"] / max(1, c["selected_rows"]), 3),
                "layer_modes": c["modes"],
                "pool_log": got["pool_log"][-1].split("] ", 1)[-1] if got["pool_log"] else None,
                "bench": got["bench"],
            }
        if opt.log_dir:
            report["logs"] = opt.log_dir
        return report
