"""Real SGLang servers on this machine: start `python -m sglang.launch_server` on a checkpoint, stock or with
`--enable-ess`, and talk to it over its HTTP API. The real-server test (test/plugin/test_server.py) and
`ess demo --server` use it; on a CPU the plugin's CPU path serves the model (docs/cpu-path.md).

The workloads are deterministic: a server's batches, and so its float rounding, depend only on the order of the calls,
because every call waits for the server to be idle (SGLang's kernels on a CPU are not batch-invariant: the same
prompt in another batch may round differently, and a random model's near-ties then flip a greedy token).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

READY = "The server is fired up and ready to roll"  # SGLang's log line once its warm-up request is done
BIND_FAILED = "error while attempting to bind on address"  # uvicorn's, when another process took the port
CPU_FLAGS = ["--device", "cpu", "--kv-cache-dtype", "fp8_e4m3"]  # everything else is the plugin's CPU default
# 96 slots with every request offloaded: a few hundred tokens overflow them every step
ESS_FLAGS = ["--enable-ess", "--ess-buffer-tokens", "96", "--ess-residency", "off"]
# residency first (the default): requests that fit the device keep every row there
ESS_RESIDENT_FLAGS = ["--enable-ess", "--ess-buffer-tokens", "96"]


def mtp_flags(steps: int) -> list[str]:
    """EAGLE over the checkpoint's MTP layer: `steps` draft tokens a step, one path (top-1: ESS's and HiSparse's
    limit), verified as steps + 1 query rows; none for 0."""
    if not steps:
        return []
    return ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1)]


MTP_FLAGS = mtp_flags(1)
ESS_MTP_FLAGS = ["--enable-ess", "--ess-buffer-tokens", "160", "--ess-residency", "off"]  # >= 2 verify rows x (64 + 1)
TOKENS = range(2, 258)  # prompt ids: the tiny checkpoint's <unk>, its characters and the first words
START_TIMEOUT_S = 300


@contextlib.contextmanager
def terminate_as_exit():
    """SIGTERM raises SystemExit inside the block (Python's default ends the process at once), so the servers the
    block started are stopped on the way out: a `timeout` or a job runner never leaves them running."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


def wait_ready_or_rebind(srv: "Server", timeout_s: float = START_TIMEOUT_S, tries: int = 2) -> "Server":
    """srv.wait_ready(timeout_s); a server whose HTTP port another process took first (servers started together pick
    ports of their own too) starts again on a new port."""
    for _ in range(tries - 1):
        try:
            return srv.wait_ready(timeout_s)
        except ServerError:
            if BIND_FAILED not in srv.log():
                raise
            srv.stop()
            srv.port = free_port()
            srv.start()
    return srv.wait_ready(timeout_s)


def start_all(servers: list["Server"]) -> None:
    """Start every server (they load together), then wait for each (wait_ready_or_rebind)."""
    for srv in servers:
        srv.start()
    for srv in servers:
        wait_ready_or_rebind(srv)


@dataclasses.dataclass
class Server:
    """One `python -m sglang.launch_server` process (and its scheduler processes), its output in log_path."""

    model: str
    flags: list[str]
    log_path: str
    port: int = dataclasses.field(default_factory=free_port)
    process: subprocess.Popen | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # beside this process's environment

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model, "--port", str(self.port),
                *self.flags]

    def start(self) -> "Server":
        env = dict(os.environ, SGLANG_PLUGINS=os.environ.get("SGLANG_PLUGINS", "ess"), PYTHONUNBUFFERED="1") | self.env
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # its own group: stop() ends the schedulers too
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "Server":
        deadline = time.monotonic() + timeout_s
        while READY not in self.log():
            if BIND_FAILED in self.log():  # uvicorn gave up its port but the scheduler lives on: never ready
                raise ServerError(f"port {self.port} was taken before the server bound it: {' '.join(self.command)}\n"
                                  f"{self.log_tail()}")
            if self.process.poll() is not None:
                raise ServerError(f"the server exited ({self.process.returncode}) before it was ready: "
                                  f"{' '.join(self.command)}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerError(f"the server was not ready after {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        """End the server and its scheduler processes at once (SIGKILL to its process group: a served workload has
        nothing to drain, and SGLang's graceful shutdown waits several seconds for GPU work that a CPU does not have)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> "Server":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:  # a server that never became ready, or a SIGTERM while it starts: stopped too
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def log_lines(self, marker: str) -> list[str]:
        return [line for line in self.log().splitlines() if marker in line]

    # -- the HTTP API --------------------------------------------------------------------------------------------
    def _connection(self, timeout_s: float = 600) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)

    def post(self, path: str, body: dict) -> dict | list:
        conn = self._connection()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise ServerError(f"POST {path}: HTTP {resp.status}: {data[:500]!r}")
        return json.loads(data) if data.strip() else {}

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = self._connection(60)
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()

    def status(self, path: str) -> int:
        """The HTTP status of GET path (SGLang's /ready: 200 once the server takes requests)."""
        return self._get(path)[0]

    def get(self, path: str) -> dict:
        status, data = self._get(path)
        if status != 200:
            raise ServerError(f"GET {path}: HTTP {status}: {data[:500]!r}")
        return json.loads(data)

    def generate(self, prompts: list[list[int]], new_tokens: int | list[int], top_logprobs: int = 0) -> list[dict]:
        """Greedy generation of every prompt (token ids) in one call (one batch in the server), exactly new_tokens
        each (or new_tokens[i] for prompt i), with the top_logprobs most likely tokens of every step if asked.
        Returns SGLang's answers: output_ids and meta_info."""
        if isinstance(new_tokens, list):
            sampling = [greedy(n) for n in new_tokens]
        else:
            sampling = greedy(new_tokens)
        logprobs = {"return_logprob": True, "top_logprobs_num": top_logprobs} if top_logprobs else {}
        return self.post("/generate", {"input_ids": prompts, "sampling_params": sampling, **logprobs})

    def benchmark(self, model: str, num_prompts: int, input_len: int, output_len: int, out_file: str,
                  extra: tuple[str, ...] = ()) -> dict:
        """`python -m sglang.benchmark.serving` against this server: random token prompts (nothing downloaded), the
        extra arguments after the rest. Returns the benchmark's result record (its output file's last line)."""
        cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
               "--port", str(self.port), "--dataset-name", "random-ids", "--num-prompts", str(num_prompts),
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--random-range-ratio", "1", "--tokenizer", model, "--model", model, "--output-file", out_file,
               "--disable-tqdm", *extra]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise ServerError(f"sglang.benchmark.serving failed: {(run.stdout + run.stderr)[-2000:]}")
        with open(out_file) as f:
            return json.loads(f.read().splitlines()[-1])

    def _stream(self, body: dict):
        """POST /generate with stream on: each chunk SGLang streams (its text and output ids so far)."""
        conn = self._connection()
        conn.request("POST", "/generate", json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServerError(f"POST /generate (stream): HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])

    def stream(self, prompt: list[int], new_tokens: int) -> list[dict]:
        """A streamed greedy generation of exactly new_tokens: every chunk, as `sglang.benchmark.serving` reads them
        (it times a chunk only when its text is not empty)."""
        return list(self._stream({"input_ids": prompt, "sampling_params": greedy(new_tokens)}))

    def generate_and_abort(self, prompt: list[int], after_tokens: int, rid: str = "ess-abort") -> dict:
        """A streamed greedy generation aborted through /abort_request once after_tokens tokens have come back.
        Returns the last answer (finish_reason abort), once the server has let the request go."""
        body = {"input_ids": prompt, "rid": rid, "sampling_params": greedy(100 * after_tokens)}
        last, aborted = None, False
        for last in self._stream(body):
            if not aborted and len(last.get("output_ids", [])) >= after_tokens:
                self.post("/abort_request", {"rid": rid})
                aborted = True
        self.flush()
        return last

    def state(self) -> dict:
        """The scheduler's state readout (the first data-parallel rank's), ESS's counters under "ess"."""
        return self.get("/get_server_info")["internal_states"][0]

    def flush(self, timeout_s: float = 60) -> None:
        """Wait until the scheduler holds no request (an aborted one is let go at its next step), then empty its
        radix cache and pools: SGLang's /flush_cache, which does nothing but wait while a request is running."""
        conn = self._connection(timeout_s + 10)
        conn.request("POST", f"/flush_cache?timeout={timeout_s}")
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        if resp.status != 200:
            raise ServerError(f"/flush_cache: HTTP {resp.status}: {text.strip()}")


def greedy(new_tokens: int) -> dict:
    """SGLang sampling parameters of a greedy generation of exactly new_tokens."""
    return {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}


def prompt_lengths(count: int, lengths: tuple[int, int]) -> list[int]:
    """count lengths spread evenly over [lo, hi]."""
    lo, hi = lengths
    return [lo + (hi - lo) * i // max(1, count - 1) for i in range(count)]


def prompts(count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """count prompts of the tiny checkpoint's token ids (TOKENS), of prompt_lengths, from one seed."""
    rng = random.Random(seed)
    return [[rng.choice(TOKENS) for _ in range(n)] for n in prompt_lengths(count, lengths)]


def shared_prefix_prompts(base: list[list[int]], prefix: int, tail: int, seed: int) -> list[list[int]]:
    """Prompts that start with the first `prefix` tokens of each base prompt (the radix cache holds them) and go on
    with `tail` fresh tokens."""
    rng = random.Random(seed)
    return [p[:prefix] + [rng.choice(TOKENS) for _ in range(tail)] for p in base]
