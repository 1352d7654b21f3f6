"""PD for real on the CPU (docs/pd.md, "PD on one machine"): a prefill server and ESS decode servers
(`--disaggregation-mode`), KV and ESS's warm-up metadata moved by Mooncake's transfer engine over TCP on this host
(NIXL: test_pd_nixl.py), SGLang's router in front of each pair; greedy tokens equal to one co-located stock server's.
SGLang's CPU kernels are not batch-invariant, so every request goes alone, to stock and to each router in turn (a
prefill batch of one request on both sides, decode batches of one)."""

import contextlib
import json
import threading
import time

import psutil

import pytest

sglang = pytest.importorskip("sglang")

from ess.reference import checkpoint  # noqa: E402
from ess.harness import pd_check  # noqa: E402
from ess.harness import pd_servers as PD  # noqa: E402
from ess.harness import servers as S  # noqa: E402

MISSING = PD.engine_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no transfer engine or router here: {MISSING}")

NEW_TOKENS = 16
EXTRA: list = []
# The fault tests' prompt: two prefill chunks (the CPU path's --chunked-prefill-size is 4096)
LONG = 6000
# SGLang's own limits on a PD request waiting for its peer (300 s each by default): a lost peer ends it in 30 s; and
# its idle check of the request and token pools raising on a leak (its default, set so the test does not rest on it)
FAULT_TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
                  "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
ESS_DECODE = ["--enable-ess", "--ess-buffer-tokens", "96"]
DECODES = {  # name -> the decode server's ESS flags
    "resident": ESS_DECODE,  # residency first (the default): every request fits, its region filled from the host pool
    "offloaded": ESS_DECODE + ["--ess-residency", "off"],  # 96 slots: the prefill node's warm-up state, then misses
    "progressive": ESS_DECODE + ["--ess-progressive-pd"],  # decoding starts before every page has landed
}
# A pair whose prefill node sends no warm-up state, and whose decode node has 4 request rows (2 running, 1 in transfer,
# SGLang's padding row): 4 x 96 device rows, so one long request fills them and the next one's admission demotes it
NO_WARMUP = ["--ess-warmup-windows", "0"]
DEMOTING = ESS_DECODE + NO_WARMUP + ["--max-running-requests", "2", "--disaggregation-decode-extra-slots", "1"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Stock SGLang co-located, one prefill server (ESS on: it sends the warm-up state), a decode server of each kind
    and a router for each (prefill, decode) pair, all started together. Then every prompt alone through each."""
    tmp = tmp_path_factory.mktemp("pd")
    model = str(tmp / "model")
    checkpoint.write(model, seed=0)
    env = PD.engine_env() | FAULT_TIMEOUTS
    bootstrap = S.free_port()
    stock = S.Server(model, S.CPU_FLAGS, str(tmp / "stock.log"))
    # no radix cache on the prefill node: each router sends it the same prompts, and a cached prefix would change its
    # prefill batches (and their rounding) against stock's, which sees each prompt once
    prefill = S.Server(model, S.CPU_FLAGS + PD.prefill_flags(bootstrap) + PD.PREFILL_ESS, str(tmp / "prefill.log"),
                       env=env)
    decodes = {name: S.Server(model, S.CPU_FLAGS + PD.DECODE_FLAGS + flags, str(tmp / f"decode-{name}.log"), env=env)
               for name, flags in DECODES.items()}
    cold_bootstrap = S.free_port()
    cold = S.Server(model, S.CPU_FLAGS + PD.prefill_flags(cold_bootstrap) + PD.PREFILL_ESS + NO_WARMUP,
                    str(tmp / "prefill-no-warmup.log"), env=env)
    demoting = S.Server(model, S.CPU_FLAGS + PD.DECODE_FLAGS + DEMOTING, str(tmp / "decode-demoting.log"), env=env)
    servers = [stock, prefill, *decodes.values(), cold, demoting]
    routers = {}
    extra = EXTRA  # servers a fault test starts
    try:
        with S.terminate_as_exit():
            S.start_all(servers)
            for name, dec in decodes.items():
                routers[name] = PD.Router(model, [], str(tmp / f"router-{name}.log"), prefill=(prefill.port, bootstrap),
                                          decode=dec.port).start()
            routers["demoting"] = PD.Router(model, [], str(tmp / "router-demoting.log"),
                                            prefill=(cold.port, cold_bootstrap), decode=demoting.port).start()
            for router in routers.values():
                router.wait_ready()
            prompts = S.prompts(8, (200, 420), seed=0)
            out = {"stock": [stock.generate([p], NEW_TOKENS)[0] for p in prompts]}
            for name in DECODES:
                out[name] = [routers[name].generate([p], NEW_TOKENS)[0] for p in prompts]
                out[f"{name}_state"] = decodes[name].state()["ess"]
            # the fault tests (last in this file) stop servers of this deployment
            out["live"] = {"stock": stock, "prefill": prefill, "decodes": decodes, "routers": routers, "tmp": tmp,
                           "model": model, "bootstrap": bootstrap, "env": env,
                           "demoting": (cold, cold_bootstrap, demoting)}
            yield out
    finally:
        for proc in [*routers.values(), *servers, *extra]:
            proc.stop()


def tokens(answers):
    return [a["output_ids"] for a in answers]


@pytest.mark.parametrize("name", list(DECODES))
def test_pd_through_a_real_engine_and_router_gives_colocated_stock_tokens(deployment, name):
    assert tokens(deployment[name]) == tokens(deployment["stock"])


def test_the_decode_counters_show_what_arrived(deployment):
    """Resident: each request's region filled from the host pool the engine wrote, no miss. Offloaded: each loaded the
    prefill node's warm-up state, then missed. Progressive: offloaded, and served while its pages landed."""
    resident, offloaded, progressive = (deployment[f"{n}_state"] for n in DECODES)
    assert resident["pd"]["resident_regions_filled"] >= 8 and resident["missed_rows"] == 0, resident
    for state in (offloaded, progressive):
        assert state["pd"]["warm_states_loaded"] >= 8 and state["missed_rows"] > 0, state


def test_the_docker_runs_check_passes_here(deployment, capsys):
    """ess.harness.pd_check (the check scripts/docker_pd.sh runs against docker/compose.cpu.yaml's servers) on this
    deployment's stock server and offloaded pair, as those flags are: it passes, every token equal. Stock's radix
    cache is emptied first, so stock prefills the prompts whole again, as the first time."""
    live = deployment["live"]
    live["stock"].flush()
    code = pd_check.main(["--stock", str(live["stock"].port), "--router", str(live["routers"]["offloaded"].port),
                          "--decode", str(live["decodes"]["offloaded"].port), "--timeout", "60"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["tokens_equal"] == 8 and summary["warm_states_loaded"] >= 16, summary


# -- faults: a server killed while a request is in flight between the two; each costs only that request ----------------
# Each fault is set up without a race: the prefill server's scheduler process is paused (SIGSTOP; its HTTP server and
# PD bootstrap server serve on), the request is sent, and the fault comes once the decode server holds the request's
# slots waiting for its KV (SGLang's /v1/loads): the request cannot have finished, however fast the machine.
@contextlib.contextmanager
def scheduler_paused(srv):
    procs = [p for p in psutil.Process(srv.process.pid).children(recursive=True)
             if "sglang::scheduler" in " ".join(p.cmdline())]
    assert procs, f"no scheduler process under {srv.process.pid}"
    for proc in procs:
        proc.suspend()
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()


def loads(decode, key, part=None):
    """One figure of SGLang's /v1/loads (of its disaggregation part), summed over the ranks."""
    return sum((load[part] if part else load)[key] for load in decode.get("/v1/loads?include=disagg")["loads"])


def wait_until(check, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)


def wait_for_transfer(decode, timeout_s=60, requests=1):
    """Until the decode server holds the slots of `requests` requests, waiting for their KV."""
    wait_until(lambda: loads(decode, "decode_transfer_queue_reqs", "disaggregation") >= requests,
               f"{requests} request(s) waiting for their KV on {decode.log_path}", timeout_s)


def in_flight(router, body):
    """Post a /generate body through router in a thread; returns (thread, result dict: "answer" or "error")."""
    result = {}

    def post():
        try:
            result["answer"] = router.post("/generate", body)
        except Exception as e:  # noqa: BLE001 (the fault under test: any error the client sees)
            result["error"] = str(e)

    thread = threading.Thread(target=post)
    thread.start()
    return thread, result


def long_request(seed, rid=None):
    body = {"input_ids": S.prompts(1, (LONG, LONG), seed=seed)[0],
            "sampling_params": S.greedy(64)}
    return body | ({"rid": rid} if rid else {})


def fault_in_flight(live, pair, body, fault):
    """Post body through the router of `pair` (a DECODES name) with the prefill scheduler paused; once that decode
    server holds the request's slots, fault(); then the scheduler resumes. Returns the client's result."""
    with scheduler_paused(live["prefill"]):
        thread, result = in_flight(live["routers"][pair], body)
        wait_for_transfer(live["decodes"][pair])
        fault()
    thread.join(120)
    return result


def demotion_then_landing(live, a_prompt, b_length, room, while_paused=lambda: None):
    """Through the demoting pair, residency first and no warm-up state: with its prefill server paused, request A is
    given its decode rows, then request B (posted to the decode server alone, with a room no prefill server has: it
    never lands); while_paused() runs; the prefill resumes and A decodes alone. B is then aborted. Returns A's answer
    and the decode server's ESS state after A, having checked that B cost only itself and the pair serves on."""
    cold, _, decode = live["demoting"]
    router = live["routers"]["demoting"]
    held = {"input_ids": S.prompts(1, (b_length, b_length), seed=room)[0], "rid": f"ess-pd-never-lands-{room}",
            "sampling_params": S.greedy(NEW_TOKENS), "bootstrap_host": "127.0.0.1",
            "bootstrap_port": live["demoting"][1], "bootstrap_room": room}
    with scheduler_paused(cold):
        thread_a, result_a = in_flight(router, {"input_ids": a_prompt, "sampling_params": S.greedy(NEW_TOKENS)})
        wait_for_transfer(decode)
        thread_b, result_b = in_flight(decode, held)
        wait_for_transfer(decode, requests=2)
        while_paused()
    thread_a.join(120)
    state = decode.state()["ess"]
    decode.post("/abort_request", {"rid": held["rid"]})
    thread_b.join(60)
    answer_b = result_b.get("answer", {})
    assert "error" in result_b or answer_b.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort"
    got, want = stock_tokens_through(router, live["stock"], seed=room + 1)
    assert got == want and not leaks(cold, decode)
    return result_a["answer"], state


def test_a_request_demoted_while_its_transfer_waits_gives_stock_tokens(deployment):
    """Request D decodes (offloaded: its reach passes the device rows). A is given its rows, then B, the prefill
    paused; D's next forward admits A resident (A's reach takes every row D's C slots leave) and B, which demotes A
    while A's transfer has not begun. D is aborted, and once the decode server runs nothing the prefill resumes: A
    lands, decodes alone, and gives stock's tokens (its held slots fetched when it landed)."""
    live = deployment["live"]
    decode, router, C = live["demoting"][2], live["routers"]["demoting"], 96
    before = decode.state()["ess"]
    rows = before["residency"]["device_rows"]
    a_prompt = S.prompts(1, (rows - 2 * C + 8 - NEW_TOKENS - 1,) * 2, seed=24)[0]
    long = {"input_ids": S.prompts(1, (200, 200), seed=25)[0], "rid": "ess-pd-decoding",
            "sampling_params": S.greedy(1000)}
    thread_d, _ = in_flight(router, long)
    wait_until(lambda: loads(decode, "num_running_reqs") >= 1, "request D to decode")

    def demote_then_drain():
        wait_until(lambda: decode.state()["ess"]["residency"]["demoted"] > before["residency"]["demoted"],
                   "D's forward to demote A")
        decode.post("/abort_request", {"rid": long["rid"]})
        wait_until(lambda: loads(decode, "num_running_reqs") == 0, "D to be let go")

    answer, state = demotion_then_landing(live, a_prompt, 150, 7_777_701, demote_then_drain)
    thread_d.join(60)
    assert answer["output_ids"] == live["stock"].generate([a_prompt], NEW_TOKENS)[0]["output_ids"]
    # A was not promoted back before it landed (its region would then be filled whole)
    assert state["pd"]["resident_regions_filled"] == before["pd"]["resident_regions_filled"], state


def test_a_request_demoted_in_the_forward_its_kv_lands_gives_stock_tokens(deployment):
    """Nothing decodes: the forward that takes A's landing admits A first (its reach takes every device row) and then
    B, whose admission demotes A before its region was filled; A gives stock's tokens."""
    live = deployment["live"]
    rows = live["demoting"][2].state()["ess"]["residency"]["device_rows"]
    a_prompt = S.prompts(1, (rows - 96 + 8 - NEW_TOKENS - 1,) * 2, seed=21)[0]  # reach: every row, less than C short
    before = live["demoting"][2].state()["ess"]["residency"]["demoted"]
    answer, state = demotion_then_landing(live, a_prompt, 60, 7_777_711)
    assert answer["output_ids"] == live["stock"].generate([a_prompt], NEW_TOKENS)[0]["output_ids"]
    assert state["residency"]["demoted"] > before, state


def stock_tokens_through(router, stock, seed):
    prompts = S.prompts(2, (200, 300), seed=seed)
    return (tokens([router.generate([p], NEW_TOKENS)[0] for p in prompts]),
            tokens([stock.generate([p], NEW_TOKENS)[0] for p in prompts]))


def leaks(*servers):
    """SGLang's idle check's reports (it raises with the strict check set above: the server would be gone too)."""
    return [line for srv in servers for line in srv.log_lines("memory leak detected")]


@pytest.mark.parametrize("pair,seed", [("resident", 15), ("offloaded", 35)])
def test_a_request_aborted_in_flight_costs_only_itself(deployment, pair, seed):
    """A request aborted by its client while in flight (SGLang's /abort_request with its rid, on both servers, while
    the decode node holds its slots): it ends with an abort, and both servers serve on, the next requests through the
    same pair giving stock's tokens; with residency first and without."""
    live = deployment["live"]
    prefill, decode, router = live["prefill"], live["decodes"][pair], live["routers"][pair]
    rid = f"ess-pd-abort-{pair}"
    result = fault_in_flight(live, pair, long_request(seed, rid=rid),
                             lambda: [srv.post("/abort_request", {"rid": rid}) for srv in (prefill, decode)])
    answer = result.get("answer", {})
    assert "error" in result or answer.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort", result
    got, want = stock_tokens_through(router, live["stock"], seed=seed + 1)
    assert got == want and prefill.process.poll() is None and decode.process.poll() is None
    assert not leaks(prefill, decode)


def test_a_decode_server_killed_with_a_request_in_flight_costs_only_that_request(deployment):
    """The progressive decode server is killed while its request is in flight (the decode node holds its slots; the
    prefill node then runs the request and its transfer fails): the client gets an error, and the prefill server serves
    on, its next requests through another decode server giving stock's tokens."""
    live = deployment["live"]
    prefill, decode = live["prefill"], live["decodes"]["progressive"]
    result = fault_in_flight(live, "progressive", long_request(11), decode.stop)
    assert "error" in result, result
    got, want = stock_tokens_through(live["routers"]["resident"], live["stock"], seed=12)
    assert got == want and prefill.process.poll() is None and not leaks(prefill)


def test_a_prefill_server_killed_with_a_request_in_flight_costs_only_that_request(deployment):
    """The prefill server is killed while a request is in flight to the offloaded decode server and one to the resident
    one (each decode node holds its slots, waiting for the KV): each client gets an error, and each decode server,
    paired with a new prefill server, serves the next requests with stock's tokens (its slots of the lost request were
    freed: SGLang's own leak check runs on idle)."""
    live = deployment["live"]
    prefill, pairs = live["prefill"], ("offloaded", "resident")
    with scheduler_paused(prefill):
        flights = [in_flight(live["routers"][pair], long_request(13 + 20 * i)) for i, pair in enumerate(pairs)]
        for pair in pairs:
            wait_for_transfer(live["decodes"][pair])
        prefill.stop()
    for thread, result in flights:
        thread.join(120)
        assert "error" in result, result
    bootstrap = S.free_port()
    fresh = S.Server(live["model"], S.CPU_FLAGS + PD.prefill_flags(bootstrap) + PD.PREFILL_ESS,
                     str(live["tmp"] / "prefill-2.log"), env=live["env"])
    EXTRA.append(fresh.start())
    S.wait_ready_or_rebind(fresh)
    for i, pair in enumerate(pairs):
        decode = live["decodes"][pair]
        router = PD.Router(live["model"], [], str(live["tmp"] / f"router-2-{pair}.log"),
                           prefill=(fresh.port, bootstrap), decode=decode.port)
        EXTRA.append(router.start())
        router.wait_ready()
        got, want = stock_tokens_through(router, live["stock"], seed=14 + 20 * i)
        assert got == want and decode.process.poll() is None and not leaks(decode), pair
