"""The disk tier under the reference's host pool (ess.reference.tiered_host_pool): lossless decode with a quarter of the cache
in host memory, every page accounted for, and each fault a clear error naming its flag with nothing lost."""

import errno
import os

import numpy as np
import pytest
import torch

from ess.reference.demo import DemoOptions, run_demo
from ess.core.page_file import DISK_PAGE, PAGE_BYTES, DiskTierError
from ess.reference.tiered_host_pool import TieredHostPool

L, B, CONTEXT, STEPS = 2, 2, 256, 8
DEMO_LAYERS = 4  # a quarter of the cache then holds one layer's pages, all a step may need (no locality here)
PAGES = DEMO_LAYERS * B * -(-(CONTEXT + STEPS) // 64)  # every layer-page of the demo's batch


def demo(tmp_path, frames, **kw):
    opt = DemoOptions(layers=DEMO_LAYERS, topk=16, batch=B, context=CONTEXT, steps=STEPS, ess=True, buffer_tokens=40,
                      host_budget_mib=frames * PAGE_BYTES / 2**20, disk_dir=str(tmp_path), **kw)
    return run_demo(opt)


@pytest.mark.parametrize("overlap", ["none", "da", "dba"])
def test_a_quarter_of_the_cache_in_host_memory_decodes_the_same_tokens(tmp_path, overlap):
    r = demo(tmp_path, PAGES // 4, overlap=overlap)
    assert r["tokens_identical"]
    tier = r["ess"]["tier"]
    assert tier["frames"] == PAGES // 4 and tier["host_pages"] + tier["disk_pages"] == PAGES  # host + disk: all
    assert tier["disk_reads"] > 0 and tier["disk_writes"] > 0 and tier["exposed_disk_ms"] > 0
    assert not list(tmp_path.iterdir())  # the page file is removed at the end
    whole = run_demo(DemoOptions(layers=DEMO_LAYERS, topk=16, batch=B, context=CONTEXT, steps=STEPS, ess=True, buffer_tokens=40,
                                 overlap=overlap))
    assert r["ess"]["total_misses"] == whole["ess"]["total_misses"]  # the tier changes no GPU miss


def tier(tmp_path, frames=4, **kw):
    return TieredHostPool(L, B, 128, frames * PAGE_BYTES, str(tmp_path), **kw)


def fill(t):
    """Both layers of both requests, 128 positions each (8 pages through 4 frames: half go to disk)."""
    rows = {}
    for layer in range(L):
        for b in range(B):
            r = torch.randint(0, 256, (128, 656), dtype=torch.uint8)
            t.write(layer, b, torch.arange(128), r)
            rows[layer, b] = r
    return rows


def read_back(t, rows):
    for (layer, b), want in rows.items():
        t.ensure(t.pages_of(layer, torch.tensor([b]), torch.arange(128).unsqueeze(0)))
        got = t.data[layer][t.rows_table(layer)[b, :128]]
        assert torch.equal(got, want), (layer, b)


def test_a_disk_page_is_a_layer_page_aligned_for_direct_io():
    assert PAGE_BYTES == 64 * 656 and DISK_PAGE == -(-PAGE_BYTES // 4096) * 4096 == 45056


def test_every_page_survives_many_passes_through_the_frames(tmp_path):
    t = tier(tmp_path)
    rows = fill(t)
    for _ in range(3):
        read_back(t, rows)
        t.clean()
    t.check()
    rep = t.report()
    assert rep["host_pages"] + rep["disk_pages"] == L * B * 2 and rep["host_pages"] == 4
    t.close()


def test_prefetch_starts_reads_that_a_later_step_finds_done(tmp_path):
    t = tier(tmp_path)
    rows = fill(t)
    later = t.pages_of(0, torch.tensor([0]), torch.arange(128).unsqueeze(0))
    assert (t.frame_of[later] < 0).all()  # layer 0 went to disk when layer 1 was written
    t.clock += 1
    t.prefetch(later)
    t.ensure(later)
    assert t.report()["prefetch_hits"] == len(later)
    read_back(t, rows)
    t.close()


def test_bad_settings_name_their_flag(tmp_path):
    with pytest.raises(DiskTierError, match="--disk-dir .*: no such directory"):
        tier(tmp_path / "missing")
    with pytest.raises(DiskTierError, match="--disk-gib"):
        tier(tmp_path, disk_bytes=PAGE_BYTES)
    with pytest.raises(DiskTierError, match="--host-budget-mib"):
        TieredHostPool(L, B, 128, PAGE_BYTES - 1, str(tmp_path))
    t = tier(tmp_path, frames=1)  # a step needing two pages at once cannot run in one frame
    with pytest.raises(DiskTierError, match="--host-budget-mib: 1 host pages cannot hold"):
        t.ensure([0, 1])
    t.close()
    with pytest.raises(ValueError, match="--host-budget-mib and --disk-dir go together"):
        run_demo(DemoOptions(layers=L, ess=True, disk_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="--tier-placement lru: the disk tier's placement; give --disk-dir"):
        run_demo(DemoOptions(layers=L, ess=True, tier_placement="lru"))
    assert not list(tmp_path.iterdir())


def test_an_unwritable_directory_and_a_full_disk_are_refused(tmp_path, monkeypatch):
    real_open = os.open

    def refused(path, flags, *a):
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(DiskTierError, match="--disk-dir .*cannot create the page file"):
        tier(tmp_path)
    monkeypatch.setattr(os, "open", real_open)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match="--disk-dir .*No space left on device"):
        tier(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_short_reads_and_writes_lose_nothing(tmp_path, monkeypatch):
    t = tier(tmp_path)
    rows = fill(t)
    on_disk = int(np.flatnonzero(t.written & (t.frame_of < 0))[0])
    real_preadv, real_pwrite = os.preadv, os.pwrite
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 100)
    with pytest.raises(DiskTierError, match="--disk-dir: short read"):
        t.ensure([on_disk])
    assert t.frame_of[on_disk] < 0 and t.written[on_disk]  # still on disk, and only there
    monkeypatch.setattr(os, "preadv", real_preadv)
    in_host = [int(p) for p in np.flatnonzero((t.frame_of >= 0) & t.dirty)]
    monkeypatch.setattr(os, "pwrite", lambda fd, buf, off: 100)
    with pytest.raises(DiskTierError, match="--disk-dir: short write"):
        t.ensure(list(np.flatnonzero(t.frame_of < 0)[:4]))  # needs the frames: their pages must be written first
    assert all(t.frame_of[p] >= 0 and t.dirty[p] for p in in_host[:1])  # the page that failed stays in host
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    t.check()
    read_back(t, rows)  # everything is still there
    t.close()
