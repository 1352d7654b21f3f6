"""PD disaggregation on this machine, for real (docs/pd.md, "PD on one machine"): a prefill server and decode
servers (`--disaggregation-mode prefill / decode`), their KV moved by Mooncake's transfer engine over its TCP
transport, or by NIXL over UCX, on this host; SGLang's router (`sglang_router`, `--pd-disaggregation`) in front of
each pair.

Mooncake's engine links libibverbs even when it moves bytes over TCP; scripts/setup.sh copies that library (and the
libnl it needs) under the venv where the system has none, and `engine_env` puts it on the servers' library path.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from ess.harness.servers import Server, ServerError, free_port

ENGINE_LIBS = os.path.join(sys.prefix, "lib", "pd-engine")  # scripts/setup.sh's copy of libibverbs and libnl


def decode_flags(engine: str = "mooncake") -> list[str]:
    """engine: SGLang's --disaggregation-transfer-backend; run here: "mooncake" (over TCP) and "nixl" (over UCX)."""
    return ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", engine]


def prefill_flags(bootstrap_port: int, engine: str = "mooncake") -> list[str]:
    return ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", engine,
            "--disaggregation-bootstrap-port", str(bootstrap_port)]


DECODE_FLAGS = decode_flags()
# a prefill node's ESS flags here: it sends the warm-up state; no radix cache, since the tests' routers send it the same
# prompts, and a cached prefix would change its prefill batches (and their rounding) against stock's
PREFILL_ESS = ["--enable-ess", "--disable-radix-cache"]


def engine_env() -> dict[str, str]:
    """Mooncake over TCP (SGLang's default protocol is RDMA), with the copied libraries where setup made them."""
    env = {"MOONCAKE_PROTOCOL": "tcp"}
    if os.path.isdir(ENGINE_LIBS):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (ENGINE_LIBS, os.environ.get("LD_LIBRARY_PATH")) if p)
    return env


def engine_missing() -> str | None:
    """Why Mooncake's engine, NIXL or SGLang's router cannot load here (the import's last error line), or None.
    Imported in a child process: the library path must be set before the engine's import."""
    for module in ("mooncake.engine", "nixl._api", "sglang_router.launch_router"):
        run = subprocess.run([sys.executable, "-c", f"import {module}"], env=os.environ | engine_env(),
                             capture_output=True, text=True)
        if run.returncode != 0:
            return f"{module}: {(run.stderr.strip().splitlines() or ['exit %d' % run.returncode])[-1]}"
    return None


@dataclasses.dataclass
class Router(Server):
    """SGLang's router in front of one prefill server (its HTTP port and bootstrap port) and one decode server: a
    request posted to it goes to both, with the bootstrap address and room that pair them. Server's HTTP API."""

    prefill: tuple[int, int] = (0, 0)
    decode: int = 0
    metrics_port: int = dataclasses.field(default_factory=free_port)  # its Prometheus exporter's (one per router)

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(self.port), "--prefill", f"http://127.0.0.1:{self.prefill[0]}", str(self.prefill[1]),
                "--decode", f"http://127.0.0.1:{self.decode}", "--prometheus-port", str(self.metrics_port),
                "--disable-retries",  # a failed request fails once, to its client (a retry would send it again)
                "--log-level", "warn"]

    def wait_ready(self, timeout_s: float = 120) -> "Router":
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise ServerError(f"the router exited ({self.process.returncode}): {' '.join(self.command)}\n"
                                  f"{self.log_tail()}")
            try:  # ready once it has seen both servers healthy
                if self.get("/readiness").get("healthy_workers") == 2:
                    return self
            except (OSError, ServerError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"the router was not ready after {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)
