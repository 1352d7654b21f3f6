import dataclasses
import math
import json

import pytest

from ess.cli import main
from ess.analysis.sim import cost
from ess.analysis.sim.engine import load_calibration, paper_headlines, paper_table, simulate, sweep
from ess.analysis.sim.profile import ProfileError, load_profile, misses_at, synthetic_profile, validate_profile
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
    """Past the host wall a disk tier holds the share of pages the host budget cannot; a miss on a disk page reads the
    4 KiB sectors that hold its row before its layer's H2D, bounded by the node's NVMe bandwidth and IOPS shared by
    its 8 GPUs."""
    kw = dict(context=131072, sparse_ratio=0.2, overlap="da")
    fits = simulate(batch=40, disk_tier=True, **kw)
    assert fits["disk_share"] == 0 and fits["exposed_disk_ms"] == 0 and fits["step_ms"] == simulate(batch=40, **kw)["step_ms"]
    past = simulate(batch=54, disk_tier=True, nvme_gbps=48, **kw)
    plain = simulate(batch=54, **kw)
    share = 1 - get_hardware("H200").host_budget_bytes() / (54 * 61 * 656 * 131072)
    assert past["disk_share"] == round(share, 4) and past["fits_host_memory"] and not plain["fits_host_memory"]
    rows = plain["h2d_mb_per_step"] * 1e6 / 656 * share  # no page_access in the synthetic profile: uniform
    assert past["disk_rows_per_step"] == pytest.approx(rows, rel=1e-3)
    # a 656-byte row spans one 4 KiB sector, or two where it straddles a boundary: 10 of a page's 64 rows do
    assert cost.sectors_per_row(656) == 74 / 64 and past["read_amplification"] == pytest.approx(74 / 64 * 4096 / 656, abs=1e-3)
    read = rows * 74 / 64 * 4096
    assert past["disk_read_mb_per_step"] == pytest.approx(read / 1e6, rel=1e-3)
    assert past["exposed_disk_ms"] == pytest.approx(max(read / 6e9, rows / 1e6) * 1e3, rel=1e-3)  # 48 GB/s, 8M IOPS
    assert past["step_ms"] == pytest.approx(plain["step_ms"] + past["exposed_disk_ms"], abs=2e-3)
    assert simulate(batch=54, disk_tier=True, nvme_gbps=96, **kw)["exposed_disk_ms"] <= past["exposed_disk_ms"]
    swept = sweep([32, 48], 131072, 2, 1.7, disk_tier=True)
    assert [r["batch_size"] for r in swept["ess_disk"]] == [48] and swept["ess_disk"][0]["exposed_disk_ms"] > 0


def test_with_page_access_the_disk_reads_the_cold_pages_accesses_only():
    """A profile's page_access curve: the host keeps the hot pages; a step reads at most the accesses of the coldest
    disk_share of pages (and never more than its misses)."""
    prof = synthetic_profile(62) | {"page_access": {"disk_share": [0.0, 0.5, 1.0], "access_share": [0.0, 0.01, 1.0]}}
    kw = dict(context=131072, sparse_ratio=0.2, overlap="da", batch=54, disk_tier=True)
    uniform, placed = simulate(**kw), simulate(profile=prof, **kw)
    share = placed["disk_share"]
    cold = (0.01 * share / 0.5) * 2048  # accesses per request-layer-step on disk pages
    misses = misses_at(prof, 0.2) + [sum(misses_at(prof, 0.2)) / 61]
    expect = sum(54 * min(m, cold) * (1 if i < 61 else 2) for i, m in enumerate(misses[:62]))
    assert placed["disk_rows_per_step"] == pytest.approx(expect, rel=1e-3)
    assert placed["exposed_disk_ms"] < uniform["exposed_disk_ms"] and "access frequency" in placed["disk_placement"]
    bad = prof | {"page_access": {"disk_share": [0.0, 1.0], "access_share": [0.5, 0.2]}}
    with pytest.raises(ProfileError, match="page_access"):
        validate_profile(bad, "p.json")


KIT = "benchmark/results/gpu/h100/kit.json"
BOOK = "benchmark/results/gpu/h100/bookkeeping.json"


def test_measured_costs_read_the_kit_and_interpolate():
    from ess.analysis.sim.measured import load_measured

    m = load_measured([KIT, BOOK])
    kit, book = json.load(open(KIT)), json.load(open(BOOK))
    # FlashTrans: at a measured row count, exactly its GB/s; between two, between them
    r = kit["flashtrans"]["rows"][2]
    assert m.h2d(r["rows"]) == pytest.approx(r["rows"] * 656 / (r["triton_h2d_gbps"] * 1e9))
    mid = (kit["flashtrans"]["rows"][1]["rows"] * r["rows"]) ** 0.5
    assert kit["flashtrans"]["rows"][1]["triton_h2d_gbps"] < mid * 656 / m.h2d(mid) / 1e9 < r["triton_h2d_gbps"]
    # the LRU step by batch and query rows, from bookkeeping.json's largest buffer
    case = next(c for c in book["cases"] if c["batch"] == 160 and c["rows_per_step"] == 3 and c["buffer_tokens"] == 6554)
    assert m.lru(160, 3) == pytest.approx(case["fused_us"] * 1e-6)
    assert m.lru(48, 1) == pytest.approx((42.9 + (45.7 - 42.9) * 16 / 32) * 1e-6)
    assert m.lru(160, 5) == pytest.approx(m.lru(160, 3) * 5 / 3) and "scaled" in m.assumed[0]
    # DA's cost from one layer at 0 misses, scaled with the attention by batch; DBA adds its constant
    rows = {x["mode"]: x["median_ms"] for x in kit["overlap"]["rows"] if x["misses_per_request"] == 0}
    assert m.split("da", 32) == pytest.approx((rows["da"] - rows["none"]) * 1e-3)
    assert m.split("da", 128) == pytest.approx(m.split("da", 32) * 315.0 / 117.9)
    assert m.split("dba", 32) == pytest.approx((rows["dba"] - rows["none"]) * 1e-3)
    assert m.split("none", 64) == 0
    # without bookkeeping.json, the kit's own LRU figures (one query row)
    assert load_measured([KIT]).lru(32, 1) == pytest.approx(34.9e-6)


def test_measured_costs_enter_the_step_and_the_paper_table():
    from ess.analysis.sim.measured import load_measured

    m = load_measured([KIT, BOOK])
    kw = dict(context=32768, batch=160, sparse_ratio=0.21)
    mod, mea = simulate(**kw), simulate(measured=m, **kw)
    slots = math.ceil(0.21 * 32768)  # the LRU step at the step's own slots per request
    assert mod["lru_ms"] == 0 and mea["lru_ms"] == pytest.approx(
        (61 * 2 * m.lru(80, 3, slots) + 2 * m.lru(160, 1, slots)) * 1e3, abs=2e-3)
    # linear in slots at the slope of the two decode buffers (2,049 and 6,554), at every S; the measured buffer as is
    per_slot = (89.6 - 69.4) / (6554 - 2049)
    assert m.lru(160, 1, 6554) == pytest.approx(89.6e-6)
    assert m.lru(160, 1, 13108) == pytest.approx((89.6 + per_slot * 6554) * 1e-6)
    assert m.lru(160, 3, 6554 + 1000) == pytest.approx((226.5 + per_slot * 1000) * 1e-6)
    assert any("linear in slots" in note for note in m.assumed)
    assert mea["ess_costs"].startswith("measured") and "H100" in mea["ess_costs"] and mod["ess_costs"] == "modelled"
    assert simulate(measured=m, context=32768, batch=52)["step_ms"] == simulate(context=32768, batch=52)["step_ms"]
    rows = paper_table(measured=m)
    ess = [r for r in rows if r["sparse_ratio"]]
    assert all("measured" in r and r["differs_most"]["term"] in ("exposed_transfer_ms", "lru_ms", "split_ms") for r in ess)
    heads = paper_headlines(rows)
    assert [h["paper_gain"] for h in heads] == [0.694, 0.458, 1.23]
    assert all("modelled" in h and "measured" in h for h in heads)


def test_measured_da_cost_from_the_miss_kernel_by_misses(tmp_path):
    """A kit.json with da_split.miss_kernel (issue 33): DA adds Attn0 + miss kernel + merge - one call, interpolated
    by misses per request and scaled with the attention by batch; without it (the committed H100 run), DA - NONE."""
    from ess.analysis.sim.measured import MeasuredError, load_measured

    kit = json.load(open(KIT))
    one = kit["da_split"]["unsplit_us"]
    kit["da_split"]["miss_kernel"] = [  # made-up figures: the file format, not a measurement
        {"misses_per_request": 0, "attn0_us": one, "miss_us": 4.0, "merge_us": 6.0, "total_us": one + 10.0},
        {"misses_per_request": 256, "attn0_us": one, "miss_us": 24.0, "merge_us": 6.0, "total_us": one + 30.0}]
    path = tmp_path / "kit.json"
    path.write_text(json.dumps(kit))
    m = load_measured([str(path)])
    assert m.split("da", 32, 0) == pytest.approx(10e-6) and m.split("da", 32, 128) == pytest.approx(20e-6)
    assert m.split("da", 128, 256) == pytest.approx(30e-6 * m.attention(128) / m.attention(32))
    assert m.split("dba", 32, 0) == pytest.approx(10e-6 + m.dba_extra_us * 1e-6)
    assert "miss_kernel" in m.describe()["da_cost"] and "DA - NONE" in load_measured([KIT]).describe()["da_cost"]
    lc = cost.LayerCost(**{f.name: 1e-3 for f in dataclasses.fields(cost.LayerCost)})
    assert cost.exposed_transfer(lc, 0.0, "da", m, 32, 256)[1] == pytest.approx(30e-6)
    kit["da_split"]["miss_kernel"][1].pop("total_us")
    path.write_text(json.dumps(kit))
    with pytest.raises(MeasuredError, match=r"miss_kernel\[1\]"):
        load_measured([str(path)])


@pytest.mark.parametrize("edit,message", [
    (lambda k: k.pop("flashtrans"), "'flashtrans'"),
    (lambda k: k["flashmla"].update(attn_us={"one": 1.0}), "batch sizes"),
    (lambda k: k["overlap"]["rows"].clear(), "mode none"),
    (lambda k: k["flashtrans"]["rows"][0].update(triton_h2d_gbps=-1), "triton_h2d_gbps"),
])
def test_a_bad_measurement_file_is_named_with_its_field(tmp_path, edit, message):
    from ess.analysis.sim.measured import MeasuredError, load_measured

    kit = json.load(open(KIT))
    edit(kit)
    path = tmp_path / "kit.json"
    path.write_text(json.dumps(kit))
    with pytest.raises(MeasuredError, match=message) as e:
        load_measured([str(path)])
    assert str(path) in str(e.value)
    with pytest.raises(MeasuredError, match="bookkeeping.json"):
        load_measured([BOOK])
    assert main(["sim", "paper", "--measured", str(path)]) == 2


def test_the_measured_rest_of_a_layer_enters_every_arm(tmp_path):
    """A whole-layer decode.json as a third --measured file: the rest of a layer after attention by tokens (a
    two-batch-overlap row counts micro-batch A's tokens), its all-to-all wait left out (the simulator models it), the
    dense layers' own, the LM head; the baseline's step moves with it as ESS's does. A decode.json of the hybrid
    figures, or a second one, is refused by name."""
    from ess.analysis.sim.measured import MeasuredError, load_measured

    def row(batch, moe, dense, head, tbo=False):
        return {"batch": batch, "query_rows": 1, "tbo": tbo, "mode": "none",
                "rest_ms": {"moe_layer": moe + 0.4, "comm_wait": 0.4, "dense_layer": dense, "lm_head": head}}

    doc = {"whole_layer": True, "ep": 32, "machine": "NVIDIA H200",
           "rows": [row(10, 0.6, 0.5, 0.1), row(60, 1.6, 1.5, 0.3, tbo=True), {"batch": 5, "mode": "x"}]}
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(doc))
    m = load_measured([KIT, BOOK, str(path)])
    assert m.rest.post(20, True) == pytest.approx(1.1e-3) and m.rest.post(20, False) == pytest.approx(1.0e-3)
    assert m.rest.lm_head(30) == pytest.approx(0.3e-3) and m.rest.post(40, True) == pytest.approx(2.1e-3)
    assert "decode.json" in m.describe()["rest"] and load_measured([KIT, str(path)]).rest is not None
    base, base_rest = simulate(context=32768, batch=52), simulate(measured=m, context=32768, batch=52)
    assert base_rest["step_ms"] != base["step_ms"]
    doc["whole_layer"] = False
    path.write_text(json.dumps(doc))
    with pytest.raises(MeasuredError, match="whole_layer"):
        load_measured([KIT, str(path)])
    with pytest.raises(MeasuredError, match="second decode"):
        load_measured([KIT, str(path), str(path)])


def test_dba_under_two_batch_overlap_hides_each_half_under_the_others_moe_and_all_to_all():
    """The decode stack's dba under --tbo (plan_layers' tbo_dba): each micro-batch's half of the layer's H2D against
    the other micro-batch's post-attention compute and all-to-all, one attention call (nothing added); plan then
    takes dba wherever a layer misses, and none where nothing misses (ties go to the simpler mode)."""
    from ess.analysis.sim.engine import plan_layers, plan_modes

    cal, dep = load_calibration(), Deployment(ep=32, tbo=True)
    costs = cost.modelled(cal, DSV32)
    c = cost.layer_cost(DSV32, H200, cal, dep, 204, 204, 32768, moe=True)
    other = cost.layer_cost(DSV32, H200, cal, dep, 102, 102, 32768, moe=True)
    hide = other.post + other.comm
    assert cost.exposed_transfer(c, 3 * hide, "dba", costs, 204, 300, other) == (pytest.approx(hide), 0.0)
    assert cost.exposed_transfer(c, hide, "dba", costs, 204, 300, other) == (0.0, 0.0)
    misses = [0.0] + [300.0] * 60
    modes = plan_modes(DSV32, H200, cal, dep, 204, 32768, 0, misses, tbo_dba=True)
    assert modes[0] == "none" and set(modes[1:]) == {"dba"}
    # the indexer-halves dba otherwise: exposed where the other micro-batch hides all
    hidden = plan_layers(DSV32, H200, cal, dep, 204, 32768, 0, misses, tbo_dba=True)
    assert sum(e for _, e in hidden[DSV32.dense_layers:]) == 0.0  # MoE layers; a dense one has no all-to-all
    assert sum(e for _, e in plan_layers(DSV32, H200, cal, dep, 204, 32768, 0, [0.0] + [3000.0] * 60)) > 0


def test_the_measured_indexer_enters_every_arm(tmp_path):
    """benchmark/indexer_kernels.py's indexer.json as a further --measured file: the indexer's logits and top-k by query rows x
    context, each case's fastest path whose top-k was exact (an inexact faster one is not served), in place of the
    roofline's for the baseline and ESS alike; the projections stay modelled. A case with no exact path is refused."""
    from ess.analysis.sim.measured import MeasuredError, load_measured

    def case(batch, context, keys, fused, fused_exact=True):
        return {"batch": batch, "context": context, "indexer_topk_us": keys, "topk_exact": True,
                "indexer_fused_us": fused, "fused_exact": fused_exact}

    doc = {"device": "NVIDIA H200", "default_launch": {}, "sweep": [],
           "cases": [case(1, 32768, 100.0, 80.0), case(4, 32768, 300.0, 200.0, fused_exact=False)]}
    path = tmp_path / "indexer.json"
    path.write_text(json.dumps(doc))
    m = load_measured([KIT, str(path)])
    assert m.indexer.time(1, 32768) == pytest.approx(80e-6) and m.indexer.time(4, 32768) == pytest.approx(300e-6)
    assert m.indexer.time(2, 32768) == pytest.approx((80 + (300 - 80) / 3) * 1e-6)  # linear in rows x context
    assert "fused" in m.describe()["indexer"] and "keys" in m.describe()["indexer"]
    assert load_measured([KIT, BOOK, str(path)]).indexer is not None and load_measured([KIT, BOOK]).indexer is None
    spec, hw, cal = DSV32, get_hardware("H200"), load_calibration()
    modelled = cost.layer_cost(spec, hw, cal, Deployment(), 52, 52, 32768, moe=True)
    measured = cost.layer_cost(spec, hw, cal, Deployment(), 52, 52, 32768, moe=True, indexer=m.indexer)
    assert measured.indexer != modelled.indexer and measured.indexer > m.indexer.time(52, 32768)  # plus projections
    assert simulate(measured=m, context=32768, batch=52)["step_ms"] != simulate(context=32768, batch=52)["step_ms"]
    doc["cases"][0]["topk_exact"] = False
    doc["cases"][0]["fused_exact"] = False
    path.write_text(json.dumps(doc))
    with pytest.raises(MeasuredError, match="exact"):
        load_measured([KIT, str(path)])
