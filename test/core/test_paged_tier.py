"""ess.core.disk_tier under ess.core.serving: virtual rows through the page map, every step's rows equal to the rows
written, with about half the pages in host frames; on a GPU the same steps give the same rows as on the CPU."""

import os

import pytest
import torch

from ess.core import layout
from ess.core.disk_tier import DISK_PAGE, PAGE_BYTES, PageChecksumError, PagedHostTier
from ess.core.serving import ServingLatentCache

L, B, CTX, K, C, STEPS = 2, 3, 256, 16, 24, 6
PAGES = L * B * CTX // 64  # 24
FRAMES = PAGES // 2 + 1  # one layer's pages (12), all a step may need, + 1: the rest on disk


def truth():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (L, B * CTX, layout.LATENT_ROW_BYTES), generator=g, dtype=torch.uint8)


def test_rows_follow_the_page_map(tmp_path):
    t = PagedHostTier(L, B * CTX, 2 * PAGE_BYTES, str(tmp_path))
    v = torch.tensor([-1, 0, 63, 64, 130, B * CTX])
    assert (t.rows(1, v) == t.sink).all()  # nothing in a frame yet; out of range and -1 go to the sink
    assert t.pages(1, v).tolist() == [12, 13, 14]  # layer 1's pages start at B x CTX / 64 = 12
    with pytest.raises(Exception, match="--host-budget-mib: 2 host pages cannot hold the 3 pages"):
        t.ensure(t.pages(1, v))
    assert t.host_pages() == 0  # a refused call changes nothing
    t.ensure(t.pages(1, v[:4]), dirty=True)  # pages 12 and 13
    rows = t.rows(1, v)
    assert rows[1] % 64 == 0 and rows[2] == rows[1] + 63 and rows[3] % 64 == 0 and rows[3] != rows[1]
    assert rows[0] == t.sink and rows[4] == t.sink and rows[5] == t.sink
    t.ensure(t.pages(1, v[4:5]))  # page 14 takes the least recently used frame, whose changed page is written first
    assert t.rows(1, v)[4] != t.sink and t.stats["disk_writes"] == 1 and t.disk_pages() == 1
    t.check()
    t.close()


@pytest.mark.parametrize("placement,kept", [("frequency", True), ("lru", False)])
def test_a_hot_page_outlives_a_newer_cold_one_by_frequency_only(tmp_path, placement, kept):
    """Two frames; page 0 used twice, then pages 1 and 2 once each: "frequency" gives up page 1 (count 1 against
    about 2), "lru" gives up page 0 (used least recently)."""
    t = PagedHostTier(1, 3 * 64, 2 * PAGE_BYTES, str(tmp_path), placement=placement)
    for page in (0, 0, 1, 2):
        t.ensure([page], dirty=True)
    assert (t.frame_of[0] >= 0) == kept and (t.frame_of[1] >= 0) != kept and t.frame_of[2] >= 0
    with pytest.raises(Exception, match="placement 'mru': one of frequency, lru"):
        PagedHostTier(1, 64, PAGE_BYTES, str(tmp_path), placement="mru")
    t.close()


def run(device, tmp_path):
    """STEPS decode steps of B requests through a serving cache over a tier of FRAMES pages; returns each step's
    selected rows (host) and the tier's report."""
    rows = truth()
    tier = PagedHostTier(L, B * CTX, FRAMES * PAGE_BYTES, str(tmp_path), device=device)
    for layer in range(L):  # the prompt's rows, a page at a time through the frames
        for j in range(B * CTX // 64):
            v = torch.arange(64 * j, 64 * (j + 1), device=device)
            tier.ensure(tier.pages(layer, v), dirty=True)
            tier.frame_rows[tier.rows(layer, v).cpu()] = rows[layer, v.cpu()]
    table = torch.arange(B * CTX, device=device).reshape(B, CTX)
    cache = ServingLatentCache(L, B, C, CTX, tier.data, device, tier=tier)
    req = torch.arange(B, device=device)
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        own = torch.full((B,), CTX - STEPS + step, device=device)
        cache.next_step()
        for layer in range(L):
            sets = torch.stack([torch.randperm(CTX - STEPS + step, generator=g)[:K] for _ in range(B)]).to(device)
            cache.page_in(layer, req, table, sets, own)
            own_rows = rows[layer, (req * CTX + own).cpu()].to(device)  # the step's own row (the model's new token)
            r = cache.translate(layer, req, table, sets, own, own_rows)
            got = cache.rows(layer, r).cpu()
            want = rows[layer, (req.unsqueeze(1) * CTX + sets).cpu()]
            assert torch.equal(got, want), (device, step, layer)
            out.append(got)
            tier.clean()
    report = tier.report()
    tier.check()
    tier.close()
    return out, report


def test_every_step_reads_the_rows_written(tmp_path):
    _, report = run("cpu", tmp_path)
    assert report["frames"] == FRAMES and report["row_reads"] > 0 and report["disk_writes"] > 0
    # the misses' rows were read by their sectors: at most two 4 KiB sectors for a 656-byte row
    assert 1 < report["read_amplification"] <= 2 * 4096 / 656


def filled_tier(tmp_path, quarantine=False):
    """One layer of 4 pages through 2 frames, each page written in turn: pages 0 and 1 out on disk, 2 and 3 in frames."""
    t = PagedHostTier(1, 4 * 64, 2 * PAGE_BYTES, str(tmp_path), quarantine=quarantine)
    rows = truth()[0, : 4 * 64]
    for j in range(4):
        v = torch.arange(64 * j, 64 * (j + 1))
        t.ensure(t.pages(0, v), dirty=True)
        t.frame_rows[t.rows(0, v)] = rows[v]
    return t, rows


def written_tier(tmp_path, quarantine=False):
    """One layer of 4 pages through 2 frames: pages 0 and 1 end on disk only."""
    t, rows = filled_tier(tmp_path, quarantine)
    t.ensure([2, 3])  # pages 0 and 1 written out
    return t, rows


def test_rows_read_by_their_sectors_are_exact_and_counted(tmp_path):
    """ensure_rows reads the 4 KiB sectors that hold the rows it needs (a run of adjacent sectors in one read); the
    page's other rows follow when a later call needs them, and a writer gets the whole page."""
    t, rows = written_tier(tmp_path)
    reads = []
    real = os.preadv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "preadv", lambda fd, bufs, off: reads.append((off, len(bufs[0]))) or real(fd, bufs, off))
        v = torch.tensor([0, 1, 7, 70])  # rows 0, 1, 7 of page 0 (sectors 0 and 1: row 6 ends in sector 1), row 6 of page 1
        t.ensure_rows(0, v)
    assert torch.equal(t.frame_rows[t.rows(0, v)], rows[v])
    # page 0: rows 0-1 in sector 0 and row 7 (bytes 4592..5247) in sector 1: one run of 2 sectors; page 1: row 6 spans
    # bytes 3936..4591, sectors 0 and 1
    assert sorted(reads) == [(0, 2 * 4096), (DISK_PAGE, 2 * 4096)]
    r = t.report()
    assert r["row_reads"] == 2 and r["sector_bytes_read"] == 4 * 4096 and r["row_bytes_used"] == 4 * 656
    assert r["read_amplification"] == round(4 * 4096 / (4 * 656), 3) and r["disk_reads"] == 0
    t.ensure_rows(0, torch.tensor([0, 63]))  # row 0 is there; row 63 (bytes 41328..41983) is sector 10
    assert t.report()["sector_bytes_read"] == 5 * 4096
    t.ensure([0], dirty=True)  # a writer: the whole page
    every = torch.arange(64)
    assert torch.equal(t.frame_rows[t.rows(0, every)], rows[every]) and t.report()["disk_reads"] == 1
    t.check()
    t.close()


def test_a_row_changed_on_disk_is_refused_or_lost(tmp_path):
    """Each row's CRC, seeded with its place, is kept for single-row reads: a changed row is refused (its page leaves
    the frame); a serving tier zeroes it, marks it lost and charges its reader, the page's other rows stay good."""
    (tmp_path / "a").mkdir()
    t, rows = written_tier(tmp_path / "a")
    corrupt(t, 0, row=3)
    t.ensure_rows(0, torch.tensor([2]))  # row 2: intact
    with pytest.raises(PageChecksumError, match="page 0 of .* fails its checksum"):
        t.ensure_rows(0, torch.tensor([3]))
    assert torch.equal(t.frame_rows[t.rows(0, torch.tensor([2]))], rows[2:3])
    t.close()
    (tmp_path / "b").mkdir()
    q, rows = written_tier(tmp_path / "b", quarantine=True)
    corrupt(q, 0, row=3)
    v = torch.tensor([2, 3, 4])
    q.ensure_rows(0, v)
    got = q.frame_rows[q.rows(0, v)]
    assert torch.equal(got[0], rows[2]) and not got[1].any() and torch.equal(got[2], rows[4])
    assert q.lost_rows(0, v).tolist() == [False, True, False]
    q.check_read(0, v, torch.tensor([7, 8, 9]))
    assert list(q.lost_reads) == [8] and "page 0" in q.lost_reads[8]
    q.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_steps_through_the_tier_equal_the_cpu_steps(tmp_path):
    """Pinned frames read by FlashTrans over UVA, the page map on the device: the same rows as the CPU path."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "gpu").mkdir()
    cpu, cpu_report = run("cpu", tmp_path / "cpu")
    gpu, gpu_report = run("cuda", tmp_path / "gpu")
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu))
    keys = ("disk_reads", "disk_writes", "row_reads", "sector_bytes_read")
    assert {k: cpu_report[k] for k in keys} == {k: gpu_report[k] for k in keys}


def test_a_failed_read_ahead_leaves_the_page_on_disk(tmp_path, monkeypatch):
    import concurrent.futures
    import os

    t = PagedHostTier(1, 4 * 64, 2 * PAGE_BYTES, str(tmp_path))
    rows = truth()[0, : 4 * 64]
    for j in range(4):  # 4 pages through 2 frames: pages 0 and 1 end on disk
        v = torch.arange(64 * j, 64 * (j + 1))
        t.ensure(t.pages(0, v), dirty=True)
        t.frame_rows[t.rows(0, v)] = rows[v]
    t.clock += 1  # a new step: no frame in use
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 100)
    t.prefetch([0, 1])
    with pytest.raises(Exception, match="--disk-dir: short read of page"):
        t.ensure([0])
    assert t.frame_of[0] < 0 and t.written[0]  # still on disk, and only there
    concurrent.futures.wait(list(t.pending.values()))  # the other read ahead ran with the failing read too
    monkeypatch.setattr(os, "preadv", real)
    for f in list(t.pending):  # the other read ahead failed too: its page stays on disk
        with pytest.raises(Exception, match="short read"):
            t._settle(f)
    t.ensure([0, 1])
    v = torch.arange(128)
    assert torch.equal(t.frame_rows[t.rows(0, v)], rows[v])
    t.report()
    t.check()
    t.close()


def test_a_page_changed_on_disk_is_refused(tmp_path):
    """Each page carries its rows' CRC-32 and its number: bytes changed under the tier, or a page copied to another
    page's place, are refused by name, and the frames keep what they held."""
    import os

    from ess.core.disk_tier import DISK_PAGE

    t = PagedHostTier(1, 4 * 64, 2 * PAGE_BYTES, str(tmp_path))
    rows = truth()[0, : 4 * 64]
    for j in range(4):  # pages 0 and 1 end on disk
        v = torch.arange(64 * j, 64 * (j + 1))
        t.ensure(t.pages(0, v), dirty=True)
        t.frame_rows[t.rows(0, v)] = rows[v]
    t.clock += 1
    corrupt(t, 0)
    with pytest.raises(Exception, match=r"page 0 of .*ess_tier_.* fails its checksum"):
        t.ensure([0])
    assert t.frame_of[0] < 0 and t.written[0]
    fd = os.open(f"/proc/self/fd/{t.file.fd}", os.O_RDWR)  # buffered: the tier's descriptor may be direct I/O
    os.pwrite(fd, os.pread(fd, DISK_PAGE, DISK_PAGE), 0)  # page 1's bytes, seal and all, in page 0's place
    os.fsync(fd)
    os.close(fd)
    with pytest.raises(Exception, match="page 0 of .* fails its checksum"):
        t.ensure([0])
    t.ensure([1])  # the untouched page reads back whole
    v = torch.arange(64, 128)
    assert torch.equal(t.frame_rows[t.rows(0, v)], rows[v])
    t.close()


def corrupt(tier, page, row=0):
    """Flip one bit of `page`'s row `row` in the tier's file (buffered: the tier's own descriptor may be direct)."""
    fd = os.open(f"/proc/self/fd/{tier.file.fd}", os.O_RDWR)
    at = page * DISK_PAGE + row * layout.LATENT_ROW_BYTES
    byte = os.pread(fd, 1, at)
    os.pwrite(fd, bytes([byte[0] ^ 1]), at)
    os.fsync(fd)
    os.close(fd)


def test_a_serving_tier_quarantines_a_changed_page_and_charges_its_readers(tmp_path):
    """quarantine=True: the changed page enters its frame zeroed, its rows lost; a reader of a lost row is charged
    with the message, readers of other rows are not; rows written again are found; a read ahead of a changed page
    raises nothing."""
    t, rows = filled_tier(tmp_path, quarantine=True)
    t.clock += 1
    corrupt(t, 0)
    t.ensure([0, 1])
    v0, v1 = torch.arange(64), torch.arange(64, 128)
    assert (t.frame_rows[t.rows(0, v0)] == 0).all() and torch.equal(t.frame_rows[t.rows(0, v1)], rows[v1])
    assert t.lost_rows(0, v0).all() and not t.lost_rows(0, v1).any()
    readers = torch.tensor([7, 8, 9])
    t.check_read(0, torch.tensor([5, 70, 64]), readers)  # reader 7 reads lost row 5; 8 and 9 read page 1
    assert list(t.lost_reads) == [7] and "page 0 of" in t.lost_reads[7] and "fails its checksum" in t.lost_reads[7]
    t.ensure([0], dirty=True)  # a new token at locations 0..9
    t.rewritten(0, torch.arange(10))
    assert t.lost_rows(0, v0).tolist() == [False] * 10 + [True] * 54
    t.clock += 1
    t.ensure([2, 3])  # page 0 leaves, written with its seal: read back whole, its other rows still lost
    t.clock += 1
    t.ensure([0])
    assert t.lost_rows(0, v0).tolist() == [False] * 10 + [True] * 54 and t.stats["checksum_failures"] == 1
    moved = t.lost_rows(0, torch.tensor([3, 30]))  # a move of rows 3 and 30 to 70 and 71: lost goes with row 30
    t.ensure([0, 1], dirty=True)
    t.rewritten(0, torch.tensor([70, 71]), lost=moved, note=t.lost_note[0])
    assert t.lost_rows(0, torch.tensor([70, 71])).tolist() == [False, True]
    t.rewritten(0, torch.arange(64, 128))
    assert list(t.lost) == [0]
    t.clock += 1
    t.ensure([2, 3])
    t.clock += 1
    corrupt(t, 1)
    t.prefetch([1])
    t.report()  # the read ahead failed: no raise, page 1 back on disk only
    t.ensure([1])
    assert t.lost_rows(0, v1).all() and t.stats["checksum_failures"] == 2 and t.report()["lost_pages"] == 2
    t.check()
    t.close()
