"""The PD token check against servers started elsewhere (docker/compose.cpu.yaml, run by scripts/docker_pd.sh):
8 prompts of unequal lengths, each sent alone to the co-located stock server and then through SGLang's router to the
prefill and ESS decode servers (SGLang's CPU kernels are not batch-invariant: one request at a time gives both sides
the same batches). Greedy tokens must be equal, and the decode server's ESS counters must show each request's
warm-up state arrived. Prints a JSON summary; exits 1 on a mismatch.

    python -m ess.harness.pd_check --stock 30100 --router 30180 --decode 30102
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ess.harness.servers import Server, ServerError, prompts

NEW_TOKENS = 16
PROMPTS = 8


def endpoint(port: int) -> Server:
    """A server started elsewhere: only its HTTP API is used (no process, no log)."""
    return Server(model="", flags=[], log_path=os.devnull, port=port)


def wait_until(name: str, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            if ready():
                return
        except (OSError, ServerError, ValueError) as e:
            last = e
        if time.monotonic() > deadline:
            raise SystemExit(f"pd_check: {name} not ready after {timeout_s:.0f} s (last error: {last})")
        time.sleep(1)


def check(stock: Server, router: Server, decode: Server) -> dict:
    work = prompts(PROMPTS, (200, 420), seed=0)
    want = [stock.generate([p], NEW_TOKENS)[0]["output_ids"] for p in work]
    got = [router.generate([p], NEW_TOKENS)[0]["output_ids"] for p in work]
    ess = decode.state()["ess"]
    pd = ess.get("pd", {})
    equal = sum(g == w for g, w in zip(got, want))
    return {"prompts": len(work), "prompt_lengths": [len(p) for p in work], "tokens_equal": equal,
            "warm_states_loaded": pd.get("warm_states_loaded", 0), "missed_rows": ess.get("missed_rows", 0),
            "ok": equal == len(work) and pd.get("warm_states_loaded", 0) >= len(work)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ess.harness.pd_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--stock", type=int, required=True, help="the co-located stock server's HTTP port")
    p.add_argument("--router", type=int, required=True, help="SGLang's router's port (PD: prefill + ESS decode)")
    p.add_argument("--decode", type=int, required=True, help="the ESS decode server's HTTP port (its counters)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the servers to be ready")
    args = p.parse_args(argv)
    stock, router, decode = endpoint(args.stock), endpoint(args.router), endpoint(args.decode)
    wait_until(f"stock server (port {args.stock})", lambda: stock.status("/ready") == 200, args.timeout)
    # the router is ready once it has seen both of its servers healthy
    wait_until(f"router (port {args.router})", lambda: router.get("/readiness").get("healthy_workers") == 2,
               args.timeout)
    summary = check(stock, router, decode)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
