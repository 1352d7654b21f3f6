"""Pinned host memory of exactly the size asked, for the Total Memory Pool (the latent cache in host memory).

torch's `pin_memory=True` goes through its caching host allocator, which rounds every block up to a power of two: a
169 GiB pool would take 256 GiB of host memory. Here the pages come from an anonymous mapping (zero-filled,
page-aligned, exactly the size) and are registered with the CUDA driver (cudaHostRegister) in chunks of at most
CHUNK_BYTES, since very large single registrations are slow or refused. The ranges are unregistered when the last
tensor viewing the pages is freed. A failed registration raises: unpinned pages would break the UVA copies.
Without CUDA the same call gives plain zeroed memory.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

CHUNK_BYTES = 1 << 30


def chunk_ranges(total: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, size) of each registration covering `total` bytes."""
    return [(offset, min(chunk, total - offset)) for offset in range(0, total, chunk)]


def _unregister(bases: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for base in bases:
        cudart.cudaHostUnregister(base)


def _register(base: int, total: int) -> list[int]:
    cudart = torch.cuda.cudart()
    done: list[int] = []
    for offset, size in chunk_ranges(total):
        rc = int(cudart.cudaHostRegister(base + offset, size, 0))
        if rc != 0:
            _unregister(done)
            raise RuntimeError(f"cudaHostRegister of {size} bytes at offset {offset} of {total} failed (CUDA error {rc}); "
                               "lower --ess-host-pool-gib or check the locked-memory limit (ulimit -l)")
        done.append(base + offset)
    return done


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8, pin: bool = True) -> torch.Tensor:
    """A zeroed host tensor of exactly `shape`, registered with CUDA (pinned) when `pin` and a GPU is present."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1))
    tensor = torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)  # the tensor keeps `pages` alive
    if pin and nbytes and torch.cuda.is_available():
        weakref.finalize(pages, _unregister, _register(tensor.data_ptr(), nbytes))
    return tensor
