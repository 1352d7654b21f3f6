import pytest

from ess.core.residency import RowRegions, split


def test_regions_first_fit_merge_and_refusals():
    r = RowRegions(100)
    a, b, c = r.alloc(30), r.alloc(30), r.alloc(30)
    assert (a, b, c) == (0, 30, 60) and r.alloc(11) is None and r.largest_free() == 10
    r.free(b, 30)
    assert r.alloc(31) is None  # 30 + 10 free, not contiguous
    r.free(a, 30)  # merges with b's rows
    assert r.largest_free() == 60 and r.alloc(60) == 0
    with pytest.raises(ValueError, match="already free"):
        r.free(90, 5)
    with pytest.raises(ValueError, match="outside a pool of 100"):
        r.free(95, 10)
    r.free(0, 60), r.free(60, 30)
    assert r.free_rows() == 100 and r.largest_free() == 100
    r.take(40, 20)  # claimed where it was
    assert r.alloc(41) is None and r.alloc(40) == 0 and r.alloc(40) == 60
    with pytest.raises(ValueError, match="not free"):
        r.take(50, 1)


def test_split_keeps_room_for_every_offloaded_request():
    assert split(rows=1000, batch=4, full=200, capacity=50) == 4
    # 3 x 200 + 3 x 50 = 750 <= 800; 4 x 200 + 2 x 50 = 900 > 800
    assert split(rows=800, batch=6, full=200, capacity=50) == 3
    assert split(rows=300, batch=6, full=200, capacity=50) == 0
    with pytest.raises(ValueError, match="6 requests x 60 slots need 360 device rows, the pool has 300"):
        split(rows=300, batch=6, full=200, capacity=60)
