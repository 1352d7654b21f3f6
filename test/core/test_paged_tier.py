"""ess.core.disk_tier under ess.core.serving: virtual rows through the page map, every step's rows equal to the rows
written, with about half the pages in host frames; on a GPU the same steps give the same rows as on the CPU."""

import pytest
import torch

from ess.core import layout
from ess.core.disk_tier import PAGE_BYTES, PagedHostTier
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
    assert report["frames"] == FRAMES and report["disk_reads"] > 0 and report["disk_writes"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_steps_through_the_tier_equal_the_cpu_steps(tmp_path):
    """Pinned frames read by FlashTrans over UVA, the page map on the device: the same rows as the CPU path."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "gpu").mkdir()
    cpu, cpu_report = run("cpu", tmp_path / "cpu")
    gpu, gpu_report = run("cuda", tmp_path / "gpu")
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu))
    assert {k: cpu_report[k] for k in ("disk_reads", "disk_writes")} == {k: gpu_report[k] for k in ("disk_reads", "disk_writes")}


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


def corrupt(tier, page):
    """Flip one bit of `page`'s first row in the tier's file (buffered: the tier's own descriptor may be direct)."""
    import os

    from ess.core.disk_tier import DISK_PAGE

    fd = os.open(f"/proc/self/fd/{tier.file.fd}", os.O_RDWR)
    byte = os.pread(fd, 1, page * DISK_PAGE)
    os.pwrite(fd, bytes([byte[0] ^ 1]), page * DISK_PAGE)
    os.fsync(fd)
    os.close(fd)


def test_a_serving_tier_quarantines_a_changed_page_and_charges_its_readers(tmp_path):
    """quarantine=True: the changed page enters its frame zeroed, its rows lost; a reader of a lost row is charged
    with the message, readers of other rows are not; rows written again are found; a read ahead of a changed page
    raises nothing."""
    t = PagedHostTier(1, 4 * 64, 2 * PAGE_BYTES, str(tmp_path), quarantine=True)
    rows = truth()[0, : 4 * 64]
    for j in range(4):
        v = torch.arange(64 * j, 64 * (j + 1))
        t.ensure(t.pages(0, v), dirty=True)
        t.frame_rows[t.rows(0, v)] = rows[v]
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
