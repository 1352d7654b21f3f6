"""The real server on a GPU: stock SGLang and SGLang with `--enable-ess`, launched together on one GPU, the same batch
of long requests sent to each, greedy tokens compared (docs/gpu-server.md). Run by benchmark/gpu/server.sh, which
installs the carried packages and the GPU rig (python/ess_gpu_rig) and writes the checkpoint first.

    python benchmark/gpu/server.py OUT --model DIR [--servers stock,ess-none,...] [--lengths 4096,32768]

Every server in --servers starts at once (each its own process group, its share of the GPU's memory): a start or
launch failure costs only that server, and the report says why. Then each gets the same requests in one /generate
call (one batch: SGLang's kernels are batch-dependent), and each ESS server's tokens are compared with the stock
server of the same graph setting. OUT gets server.json (the comparison, timings, ESS's counters) and every log.
On a CPU (--device cpu) the same runs on the CPU path: how CI rehearses the GPU command.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import sys
import time

from ess.core import layout
from ess.core.settings import PAGE_TOKENS
from ess.reference import checkpoint
from ess.harness import servers as S
from ess.harness.server_demo import first_difference

# name -> flags beyond the common ones. "eager": --disable-cuda-graph; the others capture SGLang's CUDA graphs.
SERVERS = {
    "stock-eager": ["--disable-cuda-graph"],
    "ess-none-eager": ["--disable-cuda-graph", "--enable-ess", "--ess-overlap", "none"],
    "stock": [],
    "ess-none": ["--enable-ess", "--ess-overlap", "none"],
    "ess-da": ["--enable-ess", "--ess-overlap", "da"],
    "ess-offload": ["--enable-ess", "--ess-overlap", "none", "--ess-residency", "off"],
    "ess-fit": ["--enable-ess", "--ess-overlap", "none"],
    "hisparse-eager": ["--disable-cuda-graph", "--enable-hisparse", "--disable-radix-cache"],
    "hisparse": ["--enable-hisparse", "--disable-radix-cache"],
}
# Residency first (docs/design.md) is on by default: with --buffer-tokens C the short requests of the batch are
# resident and the long ones offloaded, in one batch. "ess-offload" turns it off (every request offloaded, as before
# 2026-11-27); "ess-fit" gets C = the longest request's reach, so every request is resident (ESS where stock fits).
# "hisparse": SGLang's own HiSparse (which needs the radix cache off), --buffer-tokens rows a request (hisparse_flags).
# Which stock server each ESS server is compared with (the same graph setting); "exact": tokens must be identical.
PAIRS = {"ess-none-eager": ("stock-eager", True), "ess-none": ("stock", True), "ess-da": ("stock", False),
         "ess-offload": ("stock", True), "ess-fit": ("stock", True), "hisparse-eager": ("stock-eager", True),
         "hisparse": ("stock", True)}
RIG_FLAGS = ["--attention-backend", "dsa", "--kv-cache-dtype", "fp8_e4m3", "--dsa-topk-backend", "torch",
             "--sampling-backend", "pytorch"]  # SGLang's torch paths (docs/gpu-server.md, the GPU rig)
FP8_RIG_FLAGS = ["--fp8-gemm-backend", "triton", "--moe-runner-backend", "triton"]  # not DeepGEMM's, nor flashinfer's


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory for server.json and the logs")
    p.add_argument("--model", required=True, help="checkpoint directory (ess tiny-checkpoint [--full-width])")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--lengths", default="4096,32768", help="shortest,longest prompt (spread evenly)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--buffer-tokens", type=int, default=2560,
                   help="--ess-buffer-tokens (at least top-k + 1; small enough that long requests miss every step)")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="--mem-fraction-static of each server. SGLang leaves (1 - it) x the free memory it measured at"
                        " its start for activations; the servers start together, so each measures the others' weights"
                        " as used: a high fraction, with --max-total-tokens bounding each KV pool")
    p.add_argument("--max-total-tokens", type=int, default=300000)
    p.add_argument("--context-length", type=int, default=None,
                   help="every server's --context-length (default: the batch's tokens in one context, context_length); "
                        "the workload's own (one request's reach) times the step as a deployment sized for it would")
    p.add_argument("--bench", default="stock,ess-fit,ess-none",
                   help="servers that then run SGLang's serving benchmark: --requests prompts of the longest length, "
                        "all at once (the same concurrency for each: ESS's cost, not its gain); '' for none")
    p.add_argument("--bench-output", type=int, default=128, help="output tokens per benchmark request")
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--gain", action="store_true",
                   help="instead of the token check: stock against ESS under one device cache budget (gain_plan)")
    p.add_argument("--gain-input", type=int, default=32768)
    p.add_argument("--gain-output", type=int, default=2048,
                   help="output tokens per request (2K: the long outputs of SGLang's HiSparse reports)")
    p.add_argument("--gain-stock-requests", type=int, default=8,
                   help="the budget: this many whole requests of stock's cache (latent and index-K rows)")
    p.add_argument("--gain-prompts", type=int, default=None,
                   help="prompts each server gets, all at once (default: 3x stock's requests, at least ESS's)")
    p.add_argument("--gain-ratio", type=float, default=0.2, help="ESS's latent slots as a share of the context")
    p.add_argument("--gain-modes", default="none", help="ESS overlap modes to run (comma-separated)")
    p.add_argument("--gain-at-stock", action=argparse.BooleanOptionalAction, default=True,
                   help="also the first mode's ESS server at stock's concurrency: ESS's own cost on the same work")
    p.add_argument("--gain-hisparse", action=argparse.BooleanOptionalAction, default=True,
                   help="also SGLang's HiSparse under the same budget (hisparse_plan)")
    p.add_argument("--mtp", type=int, choices=(0, 1, 3), default=0,
                   help="every server with EAGLE (MTP) of this many draft steps, top-1 (issue 57: 1 and 3); the "
                        "checkpoint needs its MTP layer; 0: none")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    args.bench = [s for s in args.bench.split(",") if s]
    args.gain_modes = [s for s in args.gain_modes.split(",") if s]
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        p.error(f"--servers: unknown {', '.join(unknown)} (choose from {', '.join(SERVERS)})")
    try:
        lo, hi = (int(x) for x in args.lengths.split(","))
    except ValueError:
        p.error(f"--lengths must be two integers 'shortest,longest', got {args.lengths!r}")
    if not 0 < lo <= hi:
        p.error(f"--lengths must satisfy 0 < shortest <= longest, got {args.lengths!r}")
    args.lengths = (lo, hi)
    if args.mtp and args.gain:
        p.error("--mtp: the gain plan (--gain) does not charge the draft model's cache yet; run --mtp without --gain")
    if args.mtp and not model_config(args).get("num_nextn_predict_layers"):
        p.error(f"--mtp {args.mtp}: the checkpoint {args.model} has no MTP layer (ess tiny-checkpoint without --no-mtp)")
    return args


def context_length(args) -> int:
    """--context-length, or room for every request of the batch in one context: ESS stages at most one context of
    tokens per prefill batch (sglang_ess.hooks.forward.around_add_one_req), so with less its prefill batches (and their
    float rounding) could differ from stock's (not with 8K chunks of prompts longer than them: one request a batch)."""
    if args.context_length is not None:
        return args.context_length
    total = sum(S.prompt_lengths(args.requests, args.lengths))
    return whole_pages(total + args.requests * args.new_tokens + PAGE_TOKENS)


def whole_pages(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS


def device_flags(args, batch: int) -> list[str]:
    """The flags of the machine: the CPU path's, or the GPU rig's with decode graphs up to the batch and prefill's
    breakable graphs off (dozens of token buckets to capture, and ESS's step runs in decode); an FP8 checkpoint's
    block GEMMs and MoE on SGLang's Triton runners (the rig's FP8 path, ess_gpu_rig.rig_moe); MTP's flags."""
    spec = S.mtp_flags(args.mtp)
    if args.device == "cpu":
        return S.CPU_FLAGS + spec
    fp8 = FP8_RIG_FLAGS if layer_mix(model_config(args))["fp8"] else []
    spec += ["--speculative-dsa-topk-backend", "torch"] if spec else []  # the draft's indexer top-k, as the target's
    return RIG_FLAGS + fp8 + spec + ["--mem-fraction-static", str(args.mem_fraction), "--cuda-graph-max-bs-decode",
                                     str(batch), "--disable-prefill-cuda-graph"]


def layer_mix(config: dict) -> dict:
    """What the checkpoint holds (server.json's layer_mix): dense and MoE layers, routed experts and those a token
    reaches, the shared experts, whether its projections are FP8, its MTP layers."""
    layers = config["num_hidden_layers"]
    dense = min(config.get("first_k_dense_replace", layers), layers) if config.get("n_routed_experts") else layers
    return {"layers": layers, "dense": dense, "moe": layers - dense,
            "routed_experts": config.get("n_routed_experts", 0) if dense < layers else 0,
            "experts_per_token": config.get("num_experts_per_tok", 0) if dense < layers else 0,
            "shared_experts": config.get("n_shared_experts", 0) if dense < layers else 0,
            "fp8": "quantization_config" in config, "mtp_layers": config.get("num_nextn_predict_layers", 0)}


def ess_buffer(args, tokens: int) -> int:
    """--ess-buffer-tokens: at least what a step reads, each verify row's top-k set and its own token."""
    return max(tokens, (args.mtp + 1) * (model_config(args)["index_topk"] + 1))


def flags(name: str, args) -> list[str]:
    common = ["--context-length", str(context_length(args)), "--max-total-tokens", str(args.max_total_tokens),
              "--max-running-requests", str(args.requests), "--chunked-prefill-size", "8192"]
    extra = SERVERS[name]
    if "--enable-ess" in extra:
        extra = extra + ["--ess-buffer-tokens",
                         str(ess_buffer(args, fit_tokens(args) if name == "ess-fit" else args.buffer_tokens))]
    if "--enable-hisparse" in extra:
        extra = extra + hisparse_flags(model_config(args)["index_topk"], args.buffer_tokens)
    return common + ["--decode-log-interval", "8"] + device_flags(args, args.requests) + extra


def model_config(args) -> dict:
    with open(os.path.join(args.model, "config.json")) as f:
        return json.load(f)


def hisparse_flags(top_k: int, buffer: int, ratio: int | None = None) -> list[str]:
    """--hisparse-config as SGLang documents it: top-k, the device buffer's rows per request (a multiple of the page:
    its allocator asserts it), and host_to_device_ratio (SGLang's default 2 where None)."""
    config = {"top_k": top_k, "device_buffer_size": whole_pages(max(buffer, top_k))}
    if ratio is not None:
        config["host_to_device_ratio"] = ratio
    return ["--hisparse-config", json.dumps(config)]


def fit_tokens(args) -> int:
    """ess-fit's C: the reach of the longest request, of the batch or of the benchmark (prompt, output, a page)."""
    return whole_pages(args.lengths[1] + max(args.new_tokens, args.bench_output) + PAGE_TOKENS)


def start(flags_: list[str], log: str, args) -> dict:
    """Start one server and wait for it; a failure is recorded, not raised. A server whose port another took (servers
    started together pick ports of their own too) starts again on a new port (S.wait_ready_or_rebind)."""
    t0 = time.monotonic()
    srv = S.Server(args.model, flags_, log)
    srv.start()
    try:
        S.wait_ready_or_rebind(srv, args.start_timeout)
        # the GPU rig's indexer logits as this server's scheduler chose them (ESS's kernels, checked on the device, or
        # SGLang's torch logits); none on the CPU path
        rig = (srv.log_lines("ESS GPU rig: indexer logits") or [None])[-1]
        # and its MoE / FP8 stand-ins' check on the device (an MoE or FP8 checkpoint only)
        moe = (srv.log_lines("ESS GPU rig: MoE stand-ins") or [None])[-1]
        return {"server": srv, "ready_s": round(time.monotonic() - t0, 1), "rig_logits": rig, "rig_moe": moe}
    except S.ServerError as e:
        srv.stop()
        return {"server": None, "error": str(e)[-3000:], "ready_s": round(time.monotonic() - t0, 1)}


@contextlib.contextmanager
def servers_up(named_flags: dict[str, list[str]], prefix: str, args, entries: dict, say):
    """Every server of named_flags started at once, each logging to OUT/<prefix><name>.log, and all stopped on
    leaving. entries[name] gets each one's flags, start time and rig logits, or why it did not start (said too).
    Yields the servers that started, by name."""
    with concurrent.futures.ThreadPoolExecutor(len(named_flags)) as pool:
        got = pool.map(lambda item: start(item[1], os.path.join(args.out, f"{prefix}{item[0]}.log"), args),
                       named_flags.items())
        started = dict(zip(named_flags, got))
    up = {name: got["server"] for name, got in started.items() if got["server"] is not None}
    try:
        for name, got in started.items():
            entry = entries[name] = {"flags": named_flags[name], "ready_s": got["ready_s"],
                                     "rig_logits": got.get("rig_logits"), "rig_moe": got.get("rig_moe")}
            if got["server"] is None:
                entry["error"] = got["error"]
                say(f"{prefix}{name}: did not start ({got['ready_s']} s): {got['error'][-800:]}")
        yield up
    finally:
        for srv in up.values():
            srv.stop()


def generate(srv: S.Server, prompts, new_tokens) -> tuple[list[dict], float]:
    t0 = time.monotonic()
    answers = srv.generate(prompts, new_tokens, top_logprobs=2)
    return answers, time.monotonic() - t0


def bench(srv: S.Server, args, prompts: int, length: int, output: int) -> dict:
    """SGLang's serving benchmark against srv: `prompts` random token prompts of `length`, all at once."""
    out_file = os.path.join("/tmp", f"ess-bench-{srv.port}.jsonl")
    # token ids as drawn (the checkpoint's character-level tokenizer would re-encode their text to several ids each)
    extra = ("--max-concurrency", str(prompts), "--seed", str(args.seed), "--tokenize-prompt")
    t0 = time.monotonic()
    try:
        result = srv.benchmark(args.model, prompts, length, output, out_file, extra)
    except S.ServerError as e:
        return {"error": str(e)[-3000:]}
    os.unlink(out_file)
    keys = ("completed", "total_output_tokens", "output_throughput", "input_throughput", "mean_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "duration")
    return {"seconds": round(time.monotonic() - t0, 1), "num_prompts": prompts, "input_len": length,
            "output_len": output} | {k: result.get(k) for k in keys}


REQUEST_TABLE_EXTRA = 4  # positions SGLang's request table has beyond the context (no speculative decoding)


def request_table_bytes(requests: int, context: int) -> int:
    """SGLang's request table on the device: a row of int32 locations for each request and its padding row."""
    return (requests + 1) * (context + REQUEST_TABLE_EXTRA) * 4


def gain_plan(args) -> dict:
    """Stock and ESS under the same device cache budget, every byte of it charged as each server allocates it: stock
    holds --gain-stock-requests whole requests (latent and index-K rows of every location: sizing.stock_device_bytes),
    ESS as many as fit that many bytes with all it allocates (sizing.ess_device_bytes: index-K of every location,
    ratio x context latent slots and LRU tables for every request-table row, SGLang's padding row included, step
    state, the decode scratch, the staging buffer and its location map); both with their request tables. One GPU,
    no two-batch overlap or DP attention: SGLang pads a batch to no more than the table's rows."""
    from sglang_ess.sizing import ess_device_bytes, stock_device_bytes

    ctx = whole_pages(args.gain_input + args.gain_output + PAGE_TOKENS)
    config = model_config(args)
    layers = config["num_hidden_layers"]
    width = ctx + REQUEST_TABLE_EXTRA
    buffer = max(int(args.gain_ratio * ctx), config["index_topk"] + 1)  # at least a whole top-k set and the new row

    def table(n: int) -> int:
        return request_table_bytes(n, ctx)

    def ess(n: int):
        return ess_device_bytes(layers, n * ctx + PAGE_TOKENS, n + 1, buffer, width, n + 1, ctx)

    stock_n = args.gain_stock_requests
    budget = stock_device_bytes(layers, stock_n * ctx + PAGE_TOKENS) + table(stock_n)
    n = 0
    while ess(n + 1).total + table(n + 1) <= budget:
        n += 1
    if n < 1:
        raise SystemExit(f"--gain-stock-requests {stock_n}: one ESS request ({ess(1).total + table(1)} bytes) does not "
                         f"fit stock's {budget}")
    hisparse = hisparse_plan(budget, layers, ctx, buffer, config["index_topk"])
    prompts = args.gain_prompts or max(3 * stock_n, n, hisparse["requests"])
    return {"context": ctx, "layers": layers, "budget_bytes": budget, "ess_buffer_tokens": buffer,
            "stock_requests": stock_n, "ess_requests": n, "prompts": prompts,
            "ess_bytes": dataclasses.asdict(ess(n)) | {"total": ess(n).total, "request_table": table(n)},
            "stock_bytes": {"pool": budget - table(stock_n), "request_table": table(stock_n)}, "hisparse": hisparse}


def hisparse_plan(budget: int, layers: int, ctx: int, buffer: int, top_k: int) -> dict:
    """SGLang's HiSparse under the same budget, configured for as many requests as it can hold there. Its pool
    (srt/mem_cache/hisparse_memory_pool.py, allocator/hisparse.py) has N device token rows (--max-total-tokens) of
    latent and N x r of index-K (r = host_to_device_ratio, an integer: the logical token space); a decoding request
    keeps its device buffer (the same C rows as ESS's slots, in whole pages) and a page for its newest token, and a
    prefilling one takes device rows for its whole prompt until its staging ends (SGLang's admission sees the fewer of
    its device and logical rows). So n requests need N >= (n - 1)(C + page) + the context, and a prefill batch's
    chunk (at most a context) of margin, and N x r >= n x context. Its coordinator's own tables are not charged
    (ESS's are). requests 0: none fit."""
    device_buffer = whole_pages(max(buffer, top_k))
    best = {"requests": 0}
    for n in range(1, 4097):
        N = whole_pages((n - 1) * (device_buffer + PAGE_TOKENS) + ctx + min(CHUNK, ctx))
        ratio = -(-n * ctx // N)
        used = layers * ((N + PAGE_TOKENS) * layout.LATENT_ROW_BYTES
                         + (N * ratio + PAGE_TOKENS) * layout.INDEX_ROW_BYTES) + request_table_bytes(n, ctx)
        if used <= budget:
            best = {"requests": n, "device_tokens": N, "ratio": ratio, "device_buffer": device_buffer,
                    "top_k": top_k, "bytes": used}
    return best


CHUNK = 8192  # --chunked-prefill-size of every server


def gain_servers(args, plan: dict) -> list[str]:
    names = ["stock"] + [f"ess-{m}" for m in args.gain_modes]
    names += [f"ess-{args.gain_modes[0]}-at-stock"] if args.gain_at_stock and args.gain_modes else []
    return names + (["hisparse"] if args.gain_hisparse and plan["hisparse"]["requests"] else [])


def gain_requests(name: str, plan: dict) -> int:
    """The requests a gain server runs at once: stock's, HiSparse's, or ESS's except at stock's concurrency."""
    if name == "hisparse":
        return plan["hisparse"]["requests"]
    return plan["stock_requests"] if name == "stock" or name.endswith("-at-stock") else plan["ess_requests"]


def gain_flags(name: str, plan: dict, args) -> list[str]:
    n = gain_requests(name, plan)
    tokens = plan["hisparse"]["device_tokens"] if name == "hisparse" else n * plan["context"]
    flags_ = ["--context-length", str(plan["context"]), "--max-total-tokens", str(tokens),
              "--max-running-requests", str(n), "--chunked-prefill-size", str(CHUNK), "--decode-log-interval", "8"]
    flags_ += device_flags(args, n)
    if name == "hisparse":
        h = plan["hisparse"]
        flags_ += ["--enable-hisparse", "--disable-radix-cache"] + hisparse_flags(h["top_k"], h["device_buffer"],
                                                                                  h["ratio"])
    elif name != "stock":
        flags_ += ["--enable-ess", "--ess-overlap", name.split("-")[1], "--ess-buffer-tokens",
                   str(plan["ess_buffer_tokens"])]
    return flags_


def device_bytes(srv: S.Server, name: str, plan: dict) -> dict:
    """A started server's device bytes as it reports them: SGLang's memory_usage (its KV cache in GiB to 3 places,
    weights, CUDA graphs) and, for ESS, its pool's and runtime's bytes measured from their tensors with sizing's
    count beside them; plus the request table the plan charged."""
    readout = srv.state()
    out = {"memory_usage": readout.get("memory_usage"),
           "request_table": request_table_bytes(gain_requests(name, plan), plan["context"])}
    if "ess" in readout:
        out |= {"ess_measured": readout["ess"]["device"]["measured"], "ess_charged": readout["ess"]["device"]["charged"]}
    return out


def check_device_bytes(servers: dict, plan: dict) -> list[str]:
    """The budget held: stock's KV cache as SGLang reports it matches the plan's count of it (to the readout's
    0.001 GiB), and each ESS server's measured bytes with its request table are within stock's. Returns the faults."""
    faults = []
    stock = servers.get("stock", {}).get("device")
    if stock is None:
        return ["stock's device bytes were not read"]
    reported = stock["memory_usage"]["kvcache"] * (1 << 30)
    if abs(reported - plan["stock_bytes"]["pool"]) > 0.0005 * (1 << 30):
        faults.append(f"stock's KV cache: SGLang reports {reported:.0f} bytes, the plan counted {plan['stock_bytes']['pool']}")
    limit = plan["stock_bytes"]["pool"] + plan["stock_bytes"]["request_table"]
    for name, entry in servers.items():
        got = entry.get("device", {})
        if "ess_measured" in got and got["ess_measured"] + got["request_table"] > limit:
            faults.append(f"{name}: {got['ess_measured']} + {got['request_table']} device bytes, over stock's {limit}")
        elif name == "hisparse" and got.get("memory_usage"):  # its pool as SGLang reports it (to 0.001 GiB)
            low = (got["memory_usage"]["kvcache"] - 0.0005) * (1 << 30)
            if low + got["request_table"] > limit:
                faults.append(f"{name}: {low:.0f} + {got['request_table']} device bytes at least, over stock's {limit}")
    return faults


def decode_throughput(log: str, requests: int) -> dict:
    """SGLang's own decode log lines at the full batch (`requests` running; else the largest batch the log shows,
    named in `batch`): gen throughput (token/s) of each, and their median."""
    import re
    import statistics

    lines = [(int(m.group(1)), float(m.group(2))) for m in
             re.finditer(r"#running-req: (\d+),.*?gen throughput \(token/s\): ([\d.]+)", log)]
    batch = requests if any(n == requests for n, _ in lines) else max((n for n, _ in lines), default=requests)
    rates = [rate for n, rate in lines if n == batch]
    return {"batch": batch, "lines_at_full_batch": len(rates),
            "median_gen_throughput": statistics.median(rates) if rates else None, "gen_throughputs": rates}


def ess_counters(srv: S.Server, before: dict | None) -> dict | None:
    """ESS's step counters over a run (the state readout's, after less before) with the share of selected rows that
    missed, and the pool's device bytes and residency; None for a stock server or one that no longer answers."""
    try:
        after = srv.state().get("ess")
    except (OSError, S.ServerError):
        return None
    if after is None or before is None:
        return None
    sizes = ("device_bytes", "host_bytes")  # the pool's, not counts
    out = {k: after[k] - before[k] for k in after if isinstance(after[k], int) and k not in sizes}
    out["miss_share"] = round(out["missed_rows"] / out["selected_rows"], 4) if out.get("selected_rows") else None
    return out | {k: after.get(k) for k in (*sizes, "residency")}


def run_gain(args, say, save) -> dict:
    """Each server alone on the GPU in turn (all started together, then benchmarked one after the other), after
    the device-byte check: SGLang's serving benchmark with the same prompts for each, all at once; decode throughput
    from SGLang's own log lines once every request it admits decodes; ESS's counters over the run. save(out) after
    each server, so a run cut at its deadline keeps the servers that ran."""
    plan = gain_plan(args)
    say(f"gain plan: {plan}")
    out = {"plan": plan, "servers": {}}
    save(out)
    names = gain_servers(args, plan)
    named_flags = {name: gain_flags(name, plan, args) for name in names}
    with servers_up(named_flags, "gain-", args, out["servers"], say) as up:
        for name, srv in up.items():
            out["servers"][name]["device"] = device_bytes(srv, name, plan)
        out["device_faults"] = check_device_bytes(out["servers"], plan)
        say(f"gain device bytes: {({n: e.get('device') for n, e in out['servers'].items()})}; "
            f"faults {out['device_faults']}")
        save(out)
        for name, srv in up.items():
            entry, n = out["servers"][name], gain_requests(name, plan)
            if any(f.startswith(f"{name}:") for f in out["device_faults"]):
                continue
            before = srv.state().get("ess")
            entry["bench"] = bench(srv, args, plan["prompts"], args.gain_input, args.gain_output)
            entry["decode"] = decode_throughput(srv.log(), n)
            entry["ess"] = ess_counters(srv, before)
            say(f"gain {name} ({n} at once of {plan['prompts']}): {json.dumps(entry['bench'])[-400:]} "
                f"decode {entry['decode']['median_gen_throughput']}; ESS {entry['ess']}")
            save(out)
    out |= gain_ratios(out["servers"])
    save(out)
    return out


def gain_ratios(servers: dict) -> dict:
    """Each ESS server over stock: the benchmark's whole-run output throughput and the decode throughput of SGLang's
    log (gain_*), and at stock's concurrency its TTFT and ITL (overhead_*: ESS's own cost on the same work)."""
    def get(name: str, *keys):
        value = servers.get(name, {})
        for k in keys:
            value = (value or {}).get(k)
        return value

    out = {}
    hisparse = get("hisparse", "bench", "output_throughput")
    for name in servers:
        ess = get(name, "bench", "output_throughput")
        if name.startswith("ess-") and not name.endswith("-at-stock") and hisparse and ess:
            out[f"over_hisparse_{name}"] = round(ess / hisparse, 3)
        if name == "stock":
            continue
        for key, path in (("whole_run_gain", ("bench", "output_throughput")),
                          ("decode_gain", ("decode", "median_gen_throughput"))):
            ess, stock = get(name, *path), get("stock", *path)
            if ess and stock:
                out[f"{key}_{name}"] = round(ess / stock, 3)
        if name.endswith("-at-stock"):
            out[f"overhead_{name}"] = {k: round(get(name, "bench", k) / get("stock", "bench", k), 3)
                                       for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms")
                                       if get(name, "bench", k) and get("stock", "bench", k)}
    return out


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    say = lambda text: print(f"[server.py {time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([sys.executable, *sys.argv]),
              "device": args.device, "model": args.model, "requests": args.requests, "lengths": list(args.lengths),
              "new_tokens": args.new_tokens, "buffer_tokens": args.buffer_tokens, "servers": {}, "pairs": {},
              # the checkpoint's top-k locality (ess.reference.locality's noise share; None: the random checkpoint)
              "checkpoint_locality": checkpoint.locality_of(args.model),
              "layer_mix": layer_mix(model_config(args)), "mtp_draft_steps": args.mtp}
    if args.device == "cuda":
        import torch

        report["gpu"] = torch.cuda.get_device_name(0)
        report["torch"] = torch.__version__
        report["rig_logits_asked"] = os.environ.get("ESS_GPU_RIG_LOGITS", "ess")  # each server's choice: its entry
    if args.gain:
        def save(gain: dict) -> None:
            report["gain"] = gain
            with open(os.path.join(args.out, "gain.json"), "w") as f:
                json.dump(report, f, indent=1)

        with S.terminate_as_exit():
            gain = run_gain(args, say, save)
        say(f"gain: {({k: v for k, v in gain.items() if k.split('_')[0] in ('whole', 'decode', 'overhead')})}")
        return 1 if gain["device_faults"] else 0
    prompts = S.prompts(args.requests, args.lengths, args.seed)
    with S.terminate_as_exit():
        say(f"starting {len(args.servers)} servers at once: {', '.join(args.servers)}")
        named_flags = {name: flags(name, args) for name in args.servers}
        answers = {}
        with servers_up(named_flags, "", args, report["servers"], say) as up:
            for name, srv in up.items():
                entry = report["servers"][name]
                say(f"{name}: ready in {entry['ready_s']} s; sending {args.requests} requests as one batch")
                before = srv.state().get("ess")
                try:
                    answers[name], seconds = generate(srv, prompts, args.new_tokens)
                except S.ServerError as e:
                    entry["error"] = str(e)[-3000:] + "\n" + srv.log_tail(40)
                    say(f"{name}: the batch failed: {entry['error'][-1500:]}")
                    continue
                entry["batch_s"] = round(seconds, 2)
                counters = ess_counters(srv, before)
                if counters is not None:
                    entry["ess"], entry["residency"] = counters, counters["residency"]
                    entry["ess_pool_log"] = (srv.log_lines("ESS pool:") or [None])[-1]
                say(f"{name}: the batch took {seconds:.1f} s; ESS {entry.get('ess')} {entry.get('residency')}")
                if name in args.bench:
                    seen = len(srv.log())
                    entry["bench"] = bench(srv, args, args.requests, args.lengths[1], args.bench_output)
                    entry["decode"] = decode_throughput(srv.log()[seen:], args.requests)
                    say(f"{name}: sglang.benchmark.serving: {json.dumps(entry['bench'])[-600:]} "
                        f"decode {entry['decode']['median_gen_throughput']}")
    for ess, (stock, exact) in PAIRS.items():
        if ess not in answers or stock not in answers:
            continue
        diffs = [first_difference(a, b) for a, b in zip(answers[stock], answers[ess])]
        report["pairs"][f"{ess} vs {stock}"] = {
            "exact_required": exact, "requests_identical": sum(d is None for d in diffs),
            "tokens_identical": all(d is None for d in diffs), "first_differences": [d for d in diffs if d]}
        say(f"{ess} vs {stock}: {sum(d is None for d in diffs)} of {len(diffs)} requests' tokens identical")
    stock_rate = report["servers"].get("stock", {}).get("decode", {}).get("median_gen_throughput")
    for name in args.bench:  # decode throughput at the same batch over stock's: ESS's cost where no gain is sought
        rate = report["servers"].get(name, {}).get("decode", {}).get("median_gen_throughput")
        if name != "stock" and rate and stock_rate:
            report[f"decode_ratio_{name}"] = round(rate / stock_rate, 3)
    if "decode_ratio_ess-fit" in report:  # every request resident: ESS's cost where stock fits (issue 58)
        report["resident_over_stock"] = {"ratio": report["decode_ratio_ess-fit"], "requests": args.requests,
                                         "context_length": context_length(args), "prompt_tokens": args.lengths[1]}
    exact_pairs = [v for v in report["pairs"].values() if v["exact_required"]]
    report["tokens_identical"] = bool(exact_pairs) and all(v["tokens_identical"] for v in exact_pairs)
    report["cuda_graph"] = any(v["tokens_identical"] for k, v in report["pairs"].items()
                               if v["exact_required"] and "eager" not in k)
    if args.mtp:  # issue 57's field: every server verified MTP's drafts
        report["mtp_tokens_identical"] = report["tokens_identical"]
    with open(os.path.join(args.out, "server.json"), "w") as f:
        json.dump(report, f, indent=1)
    say(f"tokens_identical {report['tokens_identical']}, with CUDA graphs {report['cuda_graph']}: "
        f"{os.path.join(args.out, 'server.json')}")
    return 0 if report["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
