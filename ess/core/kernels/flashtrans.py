"""FlashTrans: copy scattered 656-byte latent rows between the host pool and the GPU pool by index lists.

    gather(host, host_rows, gpu, gpu_slots)    H2D: gpu[gpu_slots[i]] = host[host_rows[i]]
    scatter(gpu, gpu_slots, host, host_rows)   D2H: host[host_rows[i]] = gpu[gpu_slots[i]]
Pairs with a -1 on either side are skipped. Both are `copy_rows(src, src_idx, dst, dst_idx)`.
    gather_lists(host, host_rows, gpu, gpu_slots, counts)   H2D of per-request lists [B, K] compacted left, the first
                                                             counts[b] of row b (the fused LRU step's miss lists): a
                                                             fixed grid that stops at the device-side total.

Backends:
  "triton"  one Triton kernel that reads and writes pinned host memory in place through unified virtual addressing
            (the host tensor's address is valid on the device): no cudaMemcpyAsync per row, no staging buffer. A row
            is 164 int32 lanes, which the compiler packs into 16-byte accesses (656 = 41 x 16); the grid is below.
            On an H100 it moved 48.6 GB/s H2D and 43.6 GB/s D2H for random rows (docs/gpu.md).
  "torch"   a fallback with the same result for CPU tensors; padded pairs go to dst's last row, which every ESS
            pool keeps as a sink.
  "interpret"  the Triton kernel run by Triton's CPU interpreter: how CI checks the kernel against the fallback.
"auto" picks "triton" when either side is a CUDA tensor, else "torch".
"""

from __future__ import annotations

import functools

import torch

from ess.core import layout

WORDS = layout.LATENT_ROW_BYTES // 4  # 164 int32 words per row
BLOCK = 256  # next power of two
# The Triton kernel's grid: each program moves `rows` pairs per iteration, and `programs` programs loop over the list
# (0: one program per `rows` pairs). A copy kernel holds the SMs it runs on: a serial copy takes the whole GPU, while a
# copy beside compute (on the copy stream, DA / DBA) runs on a small persistent grid, which leaves the other SMs to
# the compute stream at about the same bandwidth (measured on an H100, docs/gpu.md).
ROWS, PROGRAMS = 1, 0
OVERLAP_ROWS, OVERLAP_PROGRAMS = 16, 32
# gather_lists: its grid is fixed (a CUDA graph replays it whatever the miss count), so it is persistent.
LIST_ROWS, LIST_PROGRAMS = 4, 1024


try:  # torch's Linux wheels bring Triton; without it only the torch backend exists
    import triton
    import triton.language as tl

    def _copy_rows_kernel(src, src_idx, dst, dst_idx, n, iters, WORDS: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr):
        offs = tl.arange(0, BLOCK)[None, :]
        first = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        for it in range(iters):  # iteration it: pairs it * programs * ROWS + [pid * ROWS, (pid + 1) * ROWS)
            i = first + it * tl.num_programs(0) * ROWS
            s = tl.load(src_idx + i, mask=i < n, other=-1)[:, None]
            d = tl.load(dst_idx + i, mask=i < n, other=-1)[:, None]
            m = (offs < WORDS) & (s >= 0) & (d >= 0)
            v = tl.load(src + s * WORDS + offs, mask=m)
            tl.store(dst + d * WORDS + offs, v, mask=m)

    # Reductions through tl.reduce / tl.associative_scan with the standard library's combine function: tl.sum and
    # tl.cumsum are jit functions, which Triton's interpreter cannot call unless TRITON_INTERPRET was set at import.
    _ADD = tl.standard._sum_combine

    def _copy_lists_kernel(src, src_idx, dst, dst_idx, counts, B, K, WORDS: tl.constexpr, BLOCK: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_B: tl.constexpr):
        bb = tl.arange(0, BLOCK_B)
        cnt = tl.load(counts + bb, mask=bb < B, other=0)
        incl = tl.associative_scan(cnt, 0, _ADD)
        total = tl.reduce(cnt, 0, _ADD)
        offs = tl.arange(0, BLOCK)[None, :]
        for g0 in range(tl.program_id(0) * ROWS, total, tl.num_programs(0) * ROWS):
            g = g0 + tl.arange(0, ROWS)  # global list indices: request `owner`, its entry g - start
            owner = tl.reduce((incl[None, :] <= g[:, None]).to(tl.int32), 1, _ADD)
            start = tl.reduce(tl.where(bb[None, :] < owner[:, None], cnt[None, :], 0), 1, _ADD)
            i = owner.to(tl.int64) * K + (g - start)
            s = tl.load(src_idx + i, mask=g < total, other=-1).to(tl.int64)[:, None]
            d = tl.load(dst_idx + i, mask=g < total, other=-1).to(tl.int64)[:, None]
            m = (offs < WORDS) & (s >= 0) & (d >= 0)
            v = tl.load(src + s * WORDS + offs, mask=m)
            tl.store(dst + d * WORDS + offs, v, mask=m)

except ImportError:  # pragma: no cover
    triton = None

# Triton's CPU interpreter runs the kernel from Triton 3.8 on (the pinned torch's). Triton 3.6's hands scalar kernel
# arguments over as one-element arrays and fails on the kernel's loop (seen on the GPU machine, which has 3.6).
INTERPRETER_OK = triton is not None and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)


KERNEL_BACKENDS = ("auto", "triton", "interpret", "torch")


def kernel_backend(backend: str, device: torch.device, what: str) -> str:
    """A kernel's backend, resolved on the device of its tensors: "auto" is the Triton kernel on a GPU and the torch
    reference elsewhere; "triton" needs CUDA tensors, "interpret" (Triton's CPU interpreter) CPU ones. `what` names
    the caller in the errors."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"{what}: backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "triton" and device.type != "cuda":
        raise ValueError(f"{what}: backend 'triton' needs CUDA tensors ('interpret' runs the kernel on a CPU)")
    if backend == "interpret" and device.type == "cuda":
        raise ValueError(f"{what}: backend 'interpret' needs CPU tensors (Triton's interpreter reads host memory)")
    return backend


@functools.lru_cache(maxsize=None)
def compiled(fn, interpret: bool, what: str):
    """A Triton kernel function compiled for the GPU, or wrapped for Triton's CPU interpreter (decided per call, not
    per import, so one process can run both); every kernel of ess.core is launched through it. `what` names the
    caller in the errors."""
    if triton is None:
        raise RuntimeError(f"{what}: the triton and interpret backends need the triton package")
    if interpret:
        if not INTERPRETER_OK:
            raise RuntimeError(f"{what}: the 'interpret' backend needs Triton >= 3.8's interpreter")
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


class _UvaPointer:
    """A pinned host tensor handed to Triton: Triton resolves data_ptr() with cuPointerGetAttribute, which for
    pinned memory yields the device-visible address of the same bytes."""

    def __init__(self, t: torch.Tensor):
        if not t.is_pinned():
            raise ValueError("FlashTrans: host tensors must be in pinned memory for UVA access")
        self._t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


def uva_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same bytes as a pinned host tensor (unified virtual addressing): CUDA kernels that take
    only device tensors (torch indexing, FlashMLA) then read host memory in place, over the interconnect. The view
    does not own the memory: keep `host` alive while it is used."""
    if not host.is_pinned():
        raise ValueError("uva_view: the host tensor must be in pinned memory")
    if host.dtype != torch.uint8 or not host.is_contiguous():
        raise ValueError(f"uva_view: expected a contiguous uint8 host tensor, got {host.dtype}")

    class _Interface:  # torch.as_tensor accepts objects with __cuda_array_interface__ (numba / CuPy's protocol)
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
        }

    return torch.as_tensor(_Interface(), device=torch.device("cuda", torch.cuda.current_device()))


def _words(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != layout.LATENT_ROW_BYTES or not t.is_contiguous():
        raise ValueError(f"FlashTrans: expected contiguous uint8 [N, 656] rows, got {t.dtype} {tuple(t.shape)}")
    return t.view(torch.int32)


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor, backend: str = "auto",
              rows: int | None = None, programs: int | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for every i where both indices are >= 0 (1-D int32 or int64 index lists).
    rows, programs: the Triton kernel's grid (default ROWS, PROGRAMS: a serial copy)."""
    if src_idx.shape != dst_idx.shape or src_idx.dim() != 1:
        raise ValueError("FlashTrans: src_idx and dst_idx must be 1-D and of one length")
    if backend == "auto":
        backend = "triton" if (src.is_cuda or dst.is_cuda) else "torch"
    if backend == "torch":
        src_idx, dst_idx = src_idx.long(), dst_idx.long()
        valid = (src_idx >= 0) & (dst_idx >= 0)
        picked = src[torch.where(valid, src_idx, 0).to(src.device)].to(dst.device)
        dst.index_copy_(0, torch.where(valid, dst_idx, dst.shape[0] - 1).to(dst.device), picked)
        return
    if backend not in ("triton", "interpret"):
        raise ValueError(f"FlashTrans: unknown backend {backend!r}")
    n = src_idx.shape[0]
    if n == 0:
        return
    sw, dw = _words(src), _words(dst)
    if backend == "interpret" and not INTERPRETER_OK:
        raise RuntimeError("FlashTrans: the 'interpret' backend needs Triton >= 3.8")
    if backend == "triton":
        sw = _UvaPointer(sw) if not sw.is_cuda else sw
        dw = _UvaPointer(dw) if not dw.is_cuda else dw
    rows = rows or ROWS
    grid = -(-n // rows)
    programs = programs if programs is not None else PROGRAMS
    if programs:
        grid = min(grid, programs)
    iters = -(-n // (grid * rows))
    compiled(_copy_rows_kernel, backend == "interpret", "FlashTrans")[(grid,)](
        sw, src_idx, dw, dst_idx, n, iters, WORDS=WORDS, BLOCK=BLOCK, ROWS=rows)


def gather_lists(host: torch.Tensor, host_rows: torch.Tensor, gpu: torch.Tensor, gpu_slots: torch.Tensor,
                 counts: torch.Tensor, backend: str = "auto", overlapped: bool = False) -> None:
    """H2D of per-request lists: for each b and i < counts[b], gpu[gpu_slots[b, i]] = host[host_rows[b, i]] (-1 pairs
    skipped). host_rows, gpu_slots [B, K], counts [B] (int32 or int64, on the device: nothing syncs)."""
    if host_rows.shape != gpu_slots.shape or host_rows.dim() != 2 or counts.shape != host_rows.shape[:1]:
        raise ValueError("FlashTrans: host_rows and gpu_slots must be [B, K] and counts [B]")
    if backend == "auto":
        backend = "triton" if (host.is_cuda or gpu.is_cuda) else "torch"
    B, K = host_rows.shape
    if backend == "torch":
        listed = torch.arange(K, device=counts.device).unsqueeze(0) < counts.unsqueeze(1)
        copy_rows(host, torch.where(listed, host_rows, -1).flatten(), gpu, gpu_slots.flatten(), "torch")
        return
    if backend not in ("triton", "interpret"):
        raise ValueError(f"FlashTrans: unknown backend {backend!r}")
    if backend == "interpret" and not INTERPRETER_OK:
        raise RuntimeError("FlashTrans: the 'interpret' backend needs Triton >= 3.8")
    if B * K == 0:
        return
    sw, dw = _words(host), _words(gpu)
    if backend == "triton":
        sw = _UvaPointer(sw) if not sw.is_cuda else sw
    rows, programs = (OVERLAP_ROWS, OVERLAP_PROGRAMS) if overlapped else (LIST_ROWS, LIST_PROGRAMS)
    grid = -(-B * K // rows)
    if programs:  # 0: one program per `rows` pairs, as copy_rows reads it
        grid = min(grid, programs)
    compiled(_copy_lists_kernel, backend == "interpret", "FlashTrans")[(grid,)](
        sw, host_rows.contiguous(), dw, gpu_slots.contiguous(), counts.contiguous(), B, K,
        WORDS=WORDS, BLOCK=BLOCK, ROWS=rows, BLOCK_B=max(2, 1 << (B - 1).bit_length()),
    )


def gather(host: torch.Tensor, host_rows: torch.Tensor, gpu: torch.Tensor, gpu_slots: torch.Tensor, backend: str = "auto",
           overlapped: bool = False) -> None:
    """H2D: fetch host rows into GPU pool slots. overlapped: the copy runs beside compute (the small grid)."""
    grid = (OVERLAP_ROWS, OVERLAP_PROGRAMS) if overlapped else (None, None)
    copy_rows(host, host_rows, gpu, gpu_slots, backend, *grid)


def scatter(gpu: torch.Tensor, gpu_slots: torch.Tensor, host: torch.Tensor, host_rows: torch.Tensor, backend: str = "auto") -> None:
    """D2H: back GPU pool slots up to host rows."""
    copy_rows(gpu, gpu_slots, host, host_rows, backend)
