"""PD for real over NIXL (docs/pd.md, "PD on one machine"): a prefill server and an ESS decode server (every
request offloaded: the warm-up state path; or residency first: each request's region filled from the host pool NIXL
wrote) with `--disaggregation-transfer-backend nixl`, KV and ESS's warm-up metadata moved by NIXL's UCX backend on
this host, SGLang's router in front; greedy tokens equal to a co-located stock server's, each request sent alone. A
module of its own, one deployment at a time: NIXL's progress threads keep the CPU busy while its servers live, so they
live only for these requests (test_pd_servers.py runs the Mooncake pairs and the faults)."""

import pytest

sglang = pytest.importorskip("sglang")

from ess.reference import checkpoint  # noqa: E402
from ess.harness import pd_servers as PD  # noqa: E402
from ess.harness import servers as S  # noqa: E402

MISSING = PD.engine_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no transfer engine or router here: {MISSING}")
TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


@pytest.mark.parametrize("decode_flags", [S.ESS_FLAGS, S.ESS_RESIDENT_FLAGS], ids=["offloaded", "resident"])
def test_pd_over_nixl_gives_colocated_stock_tokens(tmp_path, decode_flags):
    model = str(tmp_path / "model")
    checkpoint.write(model, seed=0)
    env = PD.engine_env() | TIMEOUTS
    bootstrap = S.free_port()
    stock = S.Server(model, S.CPU_FLAGS, str(tmp_path / "stock.log"))
    prefill = S.Server(model, S.CPU_FLAGS + PD.prefill_flags(bootstrap, "nixl") + PD.PREFILL_ESS,
                       str(tmp_path / "prefill.log"), env=env)
    decode = S.Server(model, S.CPU_FLAGS + PD.decode_flags("nixl") + decode_flags, str(tmp_path / "decode.log"),
                      env=env)
    procs = [stock, prefill, decode]
    try:
        with S.terminate_as_exit():
            S.start_all(procs)
            # its ports picked now, not before the servers (and NIXL's listeners) took theirs
            router = PD.Router(model, [], str(tmp_path / "router.log"), prefill=(prefill.port, bootstrap),
                               decode=decode.port)
            procs.append(router.start())
            router.wait_ready()
            prompts = S.prompts(4, (200, 420), seed=0)
            want = [stock.generate([p], 16)[0]["output_ids"] for p in prompts]
            got = [router.generate([p], 16)[0]["output_ids"] for p in prompts]
            state = decode.state()["ess"]
    finally:
        for proc in procs:
            proc.stop()
    assert got == want
    if decode_flags is S.ESS_FLAGS:
        assert state["pd"]["warm_states_loaded"] >= 4 and state["missed_rows"] > 0, state
    else:
        assert state["pd"]["resident_regions_filled"] >= 4 and state["missed_rows"] == 0, state
    assert not [line for srv in (prefill, decode) for line in srv.log_lines("memory leak detected")]
