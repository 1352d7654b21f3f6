"""PD for real on the CPU (docs/plugin.md, "PD on one machine"): a prefill server and ESS decode servers
(`--disaggregation-mode`), KV and ESS's warm-up metadata moved by Mooncake's transfer engine over TCP on the loopback,
SGLang's router in front of each pair; greedy tokens equal to one co-located stock server's. SGLang's CPU kernels are
not batch-invariant, so every request goes alone, to stock and to each router in turn (a prefill batch of one request
on both sides, decode batches of one)."""

import pytest

sglang = pytest.importorskip("sglang")

from ess.reference import checkpoint  # noqa: E402
from ess.reference import pd_servers as PD  # noqa: E402
from ess.reference import server as S  # noqa: E402

MISSING = PD.engine_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no transfer engine or router here: {MISSING}")

NEW_TOKENS = 16
ESS_DECODE = ["--enable-ess", "--ess-buffer-tokens", "96"]
DECODES = {  # name -> the decode server's ESS flags
    "resident": ESS_DECODE,  # residency first (the default): every request fits, its region filled from the host pool
    "offloaded": ESS_DECODE + ["--ess-residency", "off"],  # 96 slots: the prefill node's warm-up state, then misses
    "progressive": ESS_DECODE + ["--ess-progressive-pd"],  # decoding starts before every page has landed
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Stock SGLang co-located, one prefill server (ESS on: it sends the warm-up state), a decode server of each kind
    and a router for each (prefill, decode) pair, all started together. Then every prompt alone through each."""
    tmp = tmp_path_factory.mktemp("pd")
    model = str(tmp / "model")
    checkpoint.write(model, seed=0)
    env = PD.engine_env()
    bootstrap = S.free_port()
    stock = S.Server(model, S.CPU_FLAGS, str(tmp / "stock.log"))
    # no radix cache on the prefill node: each router sends it the same prompts, and a cached prefix would change its
    # prefill batches (and their rounding) against stock's, which sees each prompt once
    prefill = S.Server(model, S.CPU_FLAGS + PD.prefill_flags(bootstrap) + ["--enable-ess", "--disable-radix-cache"],
                       str(tmp / "prefill.log"), env=env)
    decodes = {name: S.Server(model, S.CPU_FLAGS + PD.DECODE_FLAGS + flags, str(tmp / f"decode-{name}.log"), env=env)
               for name, flags in DECODES.items()}
    servers = [stock, prefill, *decodes.values()]
    routers = {}
    try:
        with S.terminate_as_exit():
            for srv in servers:
                srv.start()
            for srv in servers:
                srv.wait_ready()
            for name, dec in decodes.items():
                routers[name] = PD.Router(model, [], str(tmp / f"router-{name}.log"), prefill=(prefill.port, bootstrap),
                                          decode=dec.port).start()
            for router in routers.values():
                router.wait_ready()
            prompts = S.prompts(8, (200, 420), seed=0)
            out = {"stock": [stock.generate([p], NEW_TOKENS)[0] for p in prompts]}
            for name, router in routers.items():
                out[name] = [router.generate([p], NEW_TOKENS)[0] for p in prompts]
                out[f"{name}_state"] = decodes[name].state()["ess"]
            yield out
    finally:
        for proc in [*routers.values(), *servers]:
            proc.stop()


def tokens(answers):
    return [a["output_ids"] for a in answers]


@pytest.mark.parametrize("name", list(DECODES))
def test_pd_through_a_real_engine_and_router_gives_colocated_stock_tokens(deployment, name):
    assert tokens(deployment[name]) == tokens(deployment["stock"])


def test_the_decode_counters_show_what_arrived(deployment):
    """Resident: each request's region filled from the host pool the engine wrote, no miss. Offloaded: each loaded the
    prefill node's warm-up state, then missed. Progressive: offloaded, and served while its pages landed."""
    resident, offloaded, progressive = (deployment[f"{n}_state"] for n in ("resident", "offloaded", "progressive"))
    assert resident["pd"]["resident_regions_filled"] >= 8 and resident["missed_rows"] == 0, resident
    for state in (offloaded, progressive):
        assert state["pd"]["warm_states_loaded"] >= 8 and state["missed_rows"] > 0, state
