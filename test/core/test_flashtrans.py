import pytest
import torch

from ess.core.kernels import flashtrans


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (300, 656), dtype=torch.uint8, generator=g)
    rows = torch.randperm(299, generator=g)[:64]
    slots = torch.randperm(127, generator=g)[:64]
    rows[::7] = -1  # padded pairs on either side are skipped
    slots[3::11] = -1
    return host, rows, slots


def test_gather_then_scatter_round_trip_is_exact():
    host, rows, slots = _case()
    gpu = torch.zeros(128, 656, dtype=torch.uint8)  # last row: sink
    flashtrans.gather(host, rows, gpu, slots, backend="torch")
    ok = (rows >= 0) & (slots >= 0)
    assert torch.equal(gpu[slots[ok]], host[rows[ok]])
    back = torch.zeros_like(host)
    flashtrans.scatter(gpu, slots, back, rows, backend="torch")
    assert torch.equal(back[rows[ok]], host[rows[ok]])
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[rows[ok]] = False
    untouched[-1] = False  # sink
    assert int(back[untouched].sum()) == 0


GRIDS = [(1, 0), (4, 0), (4, 3), (16, 2)]  # (rows per program iteration, programs; 0 = one per `rows` pairs)


# The GPU machine's Triton 3.6 cannot interpret the kernel (see flashtrans.INTERPRETER_OK); CI's pinned Triton can.
@pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="Triton < 3.8: its interpreter cannot run the kernel's loop")
@pytest.mark.parametrize("grid", GRIDS)
def test_triton_kernel_equals_torch_byte_for_byte_in_interpreter(grid):
    host, rows, slots = _case(1)
    a = torch.randint(0, 256, (128, 656), dtype=torch.uint8)
    b = a.clone()
    flashtrans.gather(host, rows, a, slots, backend="torch")
    flashtrans.copy_rows(host, rows, b, slots, "interpret", *grid)
    assert torch.equal(a[:-1], b[:-1])  # all but the torch path's sink row
    ha, hb = host.clone(), host.clone()
    flashtrans.scatter(a, slots, ha, rows, backend="torch")
    flashtrans.copy_rows(b, slots, hb, rows, "interpret", *grid)
    assert torch.equal(ha[:-1], hb[:-1])


@pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="Triton < 3.8: its interpreter cannot run the kernel's loop")
@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("grid", GRIDS)
def test_list_copies_move_every_listed_row_on_every_grid(grid, overlapped, monkeypatch):
    """gather_lists over per-request lists, on each grid the kit sweeps for copies beside compute (programs 0: one per
    `rows` pairs; it once launched no program at all, so a kit variant timed DA without its copy)."""
    name = ("OVERLAP_ROWS", "OVERLAP_PROGRAMS") if overlapped else ("LIST_ROWS", "LIST_PROGRAMS")
    monkeypatch.setattr(flashtrans, name[0], grid[0])
    monkeypatch.setattr(flashtrans, name[1], grid[1])
    host, rows, slots = _case(3)
    rows, slots = rows.view(4, 16), slots.view(4, 16)
    counts = torch.tensor([16, 0, 9, 13])
    want, got = (torch.zeros(128, 656, dtype=torch.uint8) for _ in range(2))
    flashtrans.gather_lists(host, rows, want, slots, counts, "torch")
    flashtrans.gather_lists(host, rows, got, slots, counts, "interpret", overlapped=overlapped)
    assert torch.equal(got[:-1], want[:-1]) and int(got[:-1].sum()) > 0  # all but the torch path's sink row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grid", GRIDS)
def test_triton_uva_equals_torch_on_cuda(grid):
    host, rows, slots = _case(2)
    host = host.pin_memory()
    ref = torch.zeros(128, 656, dtype=torch.uint8)
    flashtrans.gather(host, rows, ref, slots, backend="torch")
    gpu = torch.zeros(128, 656, dtype=torch.uint8, device="cuda")
    flashtrans.copy_rows(host, rows.cuda(), gpu, slots.cuda(), "triton", *grid)
    assert torch.equal(gpu.cpu()[:-1], ref[:-1])
    back = torch.zeros_like(host).pin_memory()
    flashtrans.copy_rows(gpu, slots.cuda(), back, rows.cuda(), "triton", *grid)
    torch.cuda.synchronize()
    ok = (rows >= 0) & (slots >= 0)
    assert torch.equal(back[rows[ok]], host[rows[ok]])


def test_bad_rows_are_rejected():
    with pytest.raises(ValueError, match="uint8"):
        flashtrans.copy_rows(torch.zeros(4, 656), torch.zeros(1, dtype=torch.long), torch.zeros(4, 656), torch.zeros(1, dtype=torch.long), "interpret")
    with pytest.raises(ValueError, match="one length"):
        flashtrans.copy_rows(torch.zeros(4, 656, dtype=torch.uint8), torch.zeros(2, dtype=torch.long), torch.zeros(4, 656, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
