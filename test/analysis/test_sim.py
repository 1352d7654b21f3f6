import json

import pytest

from ess.cli import main
from ess.analysis.sim import cost
from ess.analysis.sim.engine import load_calibration, paper_table, simulate, sweep
from ess.analysis.sim.profile import ProfileError, load_profile, misses_at, synthetic_profile
from ess.analysis.sim.specs import DSV32
from ess.analysis.sim.cost import Deployment
from ess.analysis.sim.specs import get_hardware

CAL = load_calibration()
H200 = get_hardware("H200")


def test_baseline_batch_limits_come_from_memory_arithmetic():
    dep = Deployment(ep=32)
    assert cost.max_batch(DSV32, H200, CAL, dep, 32768) == 52
    assert cost.max_batch(DSV32, H200, CAL, dep, 131072) == 13


def test_memory_is_monotone():
    dep = Deployment(ep=32)
    sizes = [cost.request_bytes(DSV32, L) for L in (4096, 32768, 131072)]
    assert sizes == sorted(sizes)
    by_ratio = [cost.request_bytes(DSV32, 32768, r) for r in (0.1, 0.2, 0.5, 1.0)]
    assert by_ratio == sorted(by_ratio)
    assert cost.request_bytes(DSV32, 32768, 0.1) < cost.request_bytes(DSV32, 32768)
    batches = [cost.max_batch(DSV32, H200, CAL, dep, 32768, r) for r in (0.1, 0.2, 0.5, None)]
    assert batches == sorted(batches, reverse=True) and batches[0] > 3 * batches[-1]
    # More experts per GPU (smaller EP) leave less room for the cache.
    assert cost.max_batch(DSV32, H200, CAL, Deployment(ep=16), 32768) < cost.max_batch(DSV32, H200, CAL, dep, 32768)


@pytest.mark.parametrize("context,batch,ratio,mtp", [(32768, 160, 0.21, 2), (131072, 54, 0.1, 2), (65536, 100, 0.15, 4), (8192, 200, 0.3, 0)])
def test_overlap_is_never_slower_than_serial_swap_in(context, batch, ratio, mtp):
    rows = {m: simulate(context=context, batch=batch, sparse_ratio=ratio, mtp=mtp, accept=1.0 + 0.7 * mtp / 2 if mtp else 1.0, overlap=m) for m in ("none", "da", "dba", "plan")}
    assert rows["plan"]["step_ms"] <= min(rows[m]["step_ms"] for m in ("none", "da", "dba")) + 1e-9
    assert rows["plan"]["exposed_transfer_ms"] <= rows["none"]["exposed_transfer_ms"]
    assert rows["none"]["exposed_transfer_ms"] > 0


def test_plan_moves_to_dba_as_misses_grow():
    low = simulate(batch=160, sparse_ratio=0.5)["plan"]
    high = simulate(batch=160, sparse_ratio=0.12)["plan"]
    assert high["dba"] > low["dba"]


def test_mtp_accounting():
    a = simulate(batch=52, mtp=2, accept=1.7)
    b = simulate(batch=52, mtp=2, accept=2.5)
    assert a["step_ms"] == b["step_ms"]  # acceptance changes output, not the work of a step
    assert b["throughput"] == pytest.approx(a["throughput"] * 2.5 / 1.7, rel=1e-3)
    assert a["throughput"] == pytest.approx(8 * 52 * 1.7 / (a["step_ms"] / 1e3), rel=1e-3)
    assert a["otps"] == pytest.approx(1.7 / (a["step_ms"] / 1e3), rel=1e-3)
    deeper = simulate(batch=52, mtp=4, accept=1.7)
    assert deeper["step_ms"] > a["step_ms"] > simulate(batch=52, mtp=0, accept=1.0)["step_ms"]
    with pytest.raises(ValueError, match="accept"):
        simulate(batch=52, mtp=2, accept=3.5)


def test_paper_table_shape_and_baseline_rows():
    rows = paper_table()
    assert len(rows) == 18
    for r in rows:
        for key in ("context", "mtp", "accept_ratio", "batch_size", "sparse_ratio", "throughput", "otps", "step_ms",
                    "exposed_transfer_ms", "max_batch_baseline"):
            assert key in r
    for r in rows[:4]:
        assert abs(r["error_vs_paper"]) < 0.02
    assert all(r["gain_vs_baseline"] > 0 for r in rows[4:])


def test_sweep_and_plot(tmp_path, capsys):
    res = sweep([32, 52, 96, 160], 32768, 2, 1.7)
    assert [r["batch_size"] for r in res["baseline"]] == [32, 52] and res["memory_wall_batch"] == 52
    assert res["ess"][-1]["throughput"] >= res["hisparse"][-1]["throughput"]
    png = tmp_path / "s.png"
    assert main(["sim", "sweep", "--batch-min", "40", "--batch-max", "120", "--batch-step", "40", "--plot", str(png), "--json"]) == 0
    assert png.stat().st_size > 10_000
    assert json.loads(capsys.readouterr().out)["memory_wall_batch"] == 52


def test_profiles_are_validated(tmp_path):
    p = synthetic_profile(62)
    m = misses_at(p, 0.2)
    assert len(m) == 62 and min(m) == pytest.approx(16.66) and max(m) == pytest.approx(605.0)
    assert sum(misses_at(p, 0.1)) > sum(m) > sum(misses_at(p, 0.5)) > 0 == sum(misses_at(p, 1.0))
    bad = dict(p, mean_misses=[[1.0] * 10] * 5)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="mean_misses"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not a readable miss profile"):
        load_profile(path)
    short = dict(p, num_layers=10, mean_misses=[[1.0] * 10] * 5)
    with pytest.raises(ValueError, match="10 layers"):
        simulate(batch=100, sparse_ratio=0.2, profile=short)


def test_ess_needs_a_sparse_attention_model(capsys):
    assert main(["sim", "run", "--model", "dsv3", "--batch-size", "8", "--sparse-ratio", "0.2"]) == 2
    assert "DeepSeek Sparse Attention" in capsys.readouterr().err
    assert main(["sim", "run", "--hardware", "A100", "--batch-size", "8"]) == 2
    assert "--hardware" in capsys.readouterr().err


def test_the_host_memory_wall_is_counted_in_every_row():
    """ESS's Total Memory Pool holds every token's latent rows: 61 x 656 B x context per request, pinned. A 128K
    request takes 5.2 GB; the paper's 128K point (batch 54) needs 264 GiB per GPU, past an 8-GPU node of 2 TiB with
    0.8 of it pinnable (204.8 GiB per GPU)."""
    hw = get_hardware("H200")
    assert cost.host_request_bytes(DSV32, 131072) == 61 * 656 * 131072
    assert hw.host_budget_bytes() == 2048 * (1 << 30) * 0.8 / 8 and "MLCommons" in hw.source
    rows = paper_table()
    assert all("host_gib_per_gpu" in r and "fits_host_memory" in r for r in rows)
    point = next(r for r in rows if r["context"] == 131072 and r["batch_size"] == 54)
    assert point["host_gib_per_gpu"] == round(54 * 61 * 656 * 131072 / (1 << 30), 2) and not point["fits_host_memory"]
    assert all(r["fits_host_memory"] for r in rows if r["context"] == 32768)  # 160 x 1.3 GB fits 204.8 GiB
    wall = cost.max_batch_host(DSV32, hw, 131072)
    assert wall == int(hw.host_budget_bytes() // (61 * 656 * 131072)) == 41
    assert sweep([8, 64], 131072, 2, 1.7)["host_wall_batch"] == wall
    baseline = simulate(context=32768, batch=8)
    assert baseline["host_gib_per_gpu"] == 0.0 and baseline["fits_host_memory"]


def test_a_disk_tier_takes_the_pages_past_the_host_wall_and_its_reads_enter_the_step():
    """Past the host wall a disk tier holds the share of pages the host budget cannot; each miss on a disk page reads
    the page (45,056 bytes) before its layer's H2D, at the node's NVMe bandwidth shared by its 8 GPUs."""
    kw = dict(context=131072, sparse_ratio=0.2, overlap="da")
    fits = simulate(batch=40, disk_tier=True, **kw)
    assert fits["disk_share"] == 0 and fits["exposed_disk_ms"] == 0 and fits["step_ms"] == simulate(batch=40, **kw)["step_ms"]
    past = simulate(batch=54, disk_tier=True, nvme_gbps=48, **kw)
    plain = simulate(batch=54, **kw)
    share = 1 - get_hardware("H200").host_budget_bytes() / (54 * 61 * 656 * 131072)
    assert past["disk_share"] == round(share, 4) and past["fits_host_memory"] and not plain["fits_host_memory"]
    read = plain["h2d_mb_per_step"] * 1e6 / 656 * share * 45056
    assert past["disk_read_mb_per_step"] == pytest.approx(read / 1e6, rel=1e-3)
    assert past["exposed_disk_ms"] == pytest.approx(read / (48e9 / 8) * 1e3, rel=1e-3)
    assert past["step_ms"] == pytest.approx(plain["step_ms"] + past["exposed_disk_ms"], abs=2e-3)
    assert simulate(batch=54, disk_tier=True, nvme_gbps=96, **kw)["exposed_disk_ms"] < past["exposed_disk_ms"]
    swept = sweep([32, 48], 131072, 2, 1.7, disk_tier=True)
    assert [r["batch_size"] for r in swept["ess_disk"]] == [48] and swept["ess_disk"][0]["exposed_disk_ms"] > 0
