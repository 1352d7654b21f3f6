"""`ess sim pd`: full against progressive PD transfer (issue 36; simulated)."""

import json
import math

import pytest

from ess.analysis.sim.pd_model import goal, pd_rows, phases, step_misses, timeline, warm_rows, warmup_state_bytes
from ess.analysis.sim.profile import ProfileError
from ess.analysis.sim.specs import DSV32
from ess.cli import main

K128 = 131072


@pytest.fixture(scope="module")
def rows():
    return pd_rows([25.0, 100.0, 400.0], [32768, K128])


def test_progressive_is_never_later_than_full_and_reordering_is_what_pays(rows):
    for r in rows:
        assert r["rows_first_token_s"] <= r["progressive_first_token_s"] <= r["stream_first_token_s"] \
            <= r["full_first_token_s"]
        assert r["stream_token64_s"] <= r["full_token64_s"]
        # the blocks a step asks for are sent twice (again with their page): on a slow link the 64th token pays
        assert r["progressive_token64_s"] <= r["full_token64_s"] * (1.03 if r["link_gbps"] < 50 else 1.0)
        assert r["progressive_ready_s"] < r["full_transfer_s"]
        assert r["full_first_token_s"] >= r["floor_first_token_s"]
    for context in (32768, K128):  # more bandwidth, sooner
        firsts = [r["progressive_first_token_s"] for r in rows if r["context"] == context]
        assert firsts == sorted(firsts, reverse=True)
    assert goal(rows)["model_gives"] == next(r["first_token_speedup"] for r in rows
                                             if r["context"] == K128 and r["link_gbps"] == 100.0)


def test_at_infinite_bandwidth_both_are_the_step_time_floor():
    (r,) = pd_rows([math.inf], [K128])
    floor = r["join_ms"] / 1e3 + r["step_ms"] / 1e3
    assert r["floor_first_token_s"] == pytest.approx(floor, abs=1e-6)
    assert r["full_first_token_s"] == r["progressive_first_token_s"] == r["stream_first_token_s"] == pytest.approx(floor, abs=1e-6)
    assert r["full_token64_s"] == r["progressive_token64_s"] == pytest.approx(r["steps_to_token"] * r["step_ms"] / 1e3 + r["join_ms"] / 1e3, abs=1e-5)
    assert r["progressive_wait_ms"] == 0 and r["steps_waiting"] == 0


def test_phase_bytes_are_the_index_k_share_then_the_warm_set_then_the_rest():
    pd_warmup = pytest.importorskip("sglang_ess.pd.warmup")
    assert warmup_state_bytes(DSV32) == pd_warmup.row_ints(61, 2048) * 4
    ph = phases(DSV32, K128, 0.2)
    assert ph["phase1_bytes"] - warmup_state_bytes(DSV32) == K128 * 61 * 132  # every token's index-K
    assert ph["warm_rows_per_layer"] == 4 * 2048 == warm_rows(DSV32, K128, 0.2)  # the N entries the state names
    assert warm_rows(DSV32, 32768, 0.1) == 3277  # fewer slots than N: what the slots keep
    assert ph["phase2_bytes"] == 8192 * 61 * 656
    assert sum(ph[k] for k in ("phase1_bytes", "phase2_bytes", "phase3_bytes")) == K128 * 61 * (656 + 132) + warmup_state_bytes(DSV32)


def test_without_misses_progressive_waits_for_nothing():
    ph = phases(DSV32, K128, 0.2)
    t = timeline(100.0, ph, 656, 0.01, 0.05, [0.0] * 40, 1.7, 64, "demand")
    assert t["wait_s"] == 0 and t["first_token_s"] == pytest.approx((ph["phase1_bytes"] + ph["phase2_bytes"]) / 12.5e9 + 0.06)
    busy = timeline(100.0, ph, 656, 0.01, 0.05, [1e4] * 40, 1.7, 64, "demand")
    assert busy["wait_s"] > 0 and busy["steps_waiting"] > 0 and busy["first_token_s"] > t["first_token_s"]


def test_a_waiting_step_pays_for_whole_blocks_and_the_slice_in_flight():
    ph = phases(DSV32, K128, 0.2)
    args = (100.0, ph, 656, 0.01, 0.05, [1e3] * 40, 1.7, 64, "demand")
    rows = timeline(*args)
    blocks = timeline(*args, layers=61, block_rows=64)
    sliced = timeline(*args, layers=61, block_rows=64, slice_bytes=4 * 64 * 61 * 656)
    assert rows["first_token_s"] < blocks["first_token_s"] < sliced["first_token_s"]


def test_the_profile_shapes_misses_by_step_after_warm_up():
    assert step_misses(None, [10.0, 20.0], 3) == [30.0] * 3
    assert step_misses({"misses_by_step": {"warmup": [2, 1, 0]}}, [10.0, 20.0], 4) == [60.0, 30.0, 0.0, 30.0]
    with pytest.raises(ProfileError, match="misses_by_step.warmup"):
        step_misses({"misses_by_step": {"warmup": ["a"]}}, [1.0], 2)


def test_cli_json_rows_table_and_plot(tmp_path, capsys):
    png = tmp_path / "pd.png"
    assert main(["sim", "pd", "--progressive", "--link-gbps", "25,100", "--contexts", "32K,128k", "--plot", str(png),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 10_000
    assert [(r["context"], r["link_gbps"]) for r in doc["rows"]] == [(32768, 25.0), (32768, 100.0), (K128, 25.0), (K128, 100.0)]
    for r in doc["rows"]:
        for key in ("context", "link_gbps", "full_first_token_s", "progressive_first_token_s", "full_token64_s",
                    "progressive_token64_s", "phase1_bytes", "phase2_bytes", "phase3_bytes", "steps_waiting"):
            assert key in r
    assert doc["goal"]["context"] == K128 and isinstance(doc["goal"]["met"], bool)
    assert main(["sim", "pd", "--contexts", "131072", "--link-gbps", "100", "--tokens", "8", "--json"]) == 0
    (full,) = json.loads(capsys.readouterr().out)["rows"]
    assert "full_token8_s" in full and "progressive_first_token_s" not in full
    assert main(["sim", "pd", "--progressive", "--link-gbps", "100"]) == 0
    assert "the model gives" in capsys.readouterr().out
