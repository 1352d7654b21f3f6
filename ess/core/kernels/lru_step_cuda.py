"""The LRU step of ess.core.policy.lru_update as one CUDA kernel (sgl-kernel/csrc/lru_step.cu; docs/gpu.md, "The CUDA
LRU step"): one block per batch row, the row's slots staged in shared memory, victims by a histogram select. Same
arguments and results as ess.core.kernels.lru_step.lru_update_fused (byte for byte, sink columns aside).

The source is built on first use into a shared library (settings.KERNEL_CACHE_DIR, keyed by the source's hash and the
target) and called through ctypes with the tensors' addresses on the current stream, so a CUDA graph captures it:
  - CUDA tensors: nvcc (found by `find_nvcc`), -arch of the tensors' device; the library links the CUDA runtime
    statically and needs neither torch's headers nor ninja, so it builds on a machine with no network in seconds;
  - CPU tensors: the same source through g++ with -DESS_EMULATE, a block's threads as std::threads (the tests' way to
    check the kernel's logic against the torch path on a machine with no GPU).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

from ess.core import settings
from ess.core.policy import PolicyResult, check_capacity, check_step_tables

SOURCE = pathlib.Path(__file__).resolve().parents[3] / "sgl-kernel" / "csrc" / "lru_step.cu"
ARGS = 26  # the launcher's argument words (lru_step.cu, ess_lru::ARGS)
EMULATION = "emulate"  # the CPU tensors' target: 32 threads per block ("emulate512": the GPU's 512, slower)
logger = logging.getLogger(__name__)


def find_nvcc() -> str | None:
    """nvcc: $ESS_NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, the PATH, then the pip wheels
    (nvidia-cuda-nvcc: the venv has one through SGLang's dependencies)."""
    candidates = [os.environ.get("ESS_NVCC")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        candidates.append(home and os.path.join(home, "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += sorted(str(p) for p in pathlib.Path(root).glob("*/bin/nvcc"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def find_cxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build_command(target: str, out: str, compile_only: bool = False) -> list[str]:
    """The compiler command for target "sm_XY" (nvcc) or "emulate[N]" (g++, CPU; N threads per block, default 32)."""
    if target.startswith("emulate"):
        cxx = find_cxx()
        if cxx is None:
            raise RuntimeError("the CUDA LRU step's CPU emulation needs a C++20 compiler (g++; or set CXX)")
        threads = int(target[len("emulate"):] or 32)
        return [cxx, "-O2", "-std=c++20", "-DESS_EMULATE", f"-DESS_EMU_THREADS={threads}", "-x", "c++", "-pthread", "-fPIC",
                *(["-c"] if compile_only else ["-shared"]), str(SOURCE), "-o", out]
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("the CUDA LRU step needs nvcc (set ESS_NVCC or CUDA_HOME, or install nvidia-cuda-nvcc)")
    return [nvcc, "-O3", "-std=c++17", f"-arch={target}", "-lineinfo", "-Xcompiler", "-fPIC",
            *(["-c"] if compile_only else ["-shared"]), str(SOURCE), "-o", out]


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.path.expanduser(os.environ.get("ESS_KERNEL_CACHE", settings.KERNEL_CACHE_DIR)))


def build(target: str) -> pathlib.Path:
    """The shared library for target ("sm_XY" or "emulate"), compiled once per source version."""
    if not SOURCE.is_file():
        raise RuntimeError(f"the CUDA LRU step's source {SOURCE} is missing (sgl-kernel/ ships with the repository)")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    lib = _cache_dir() / f"ess_lru_step_{target}_{digest}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = build_command(target, tmp)
    logger.info("ESS: building the CUDA LRU step for %s: %s", target, " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the CUDA LRU step failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    os.replace(tmp, lib)  # atomic: processes building at once each get a whole library
    return lib


@functools.lru_cache(maxsize=None)
def library(target: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(target)))
    lib.ess_lru_step.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_void_p]
    lib.ess_lru_step.restype = ctypes.c_int
    lib.ess_lru_max_staged_slots.argtypes = [ctypes.c_int]
    return lib


def target_of(device: torch.device) -> str:
    if device.type != "cuda":
        return EMULATION
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _max_staged_slots(target: str, index: int) -> int:
    return library(target).ess_lru_max_staged_slots(index)


@functools.lru_cache(maxsize=None)
def _limits(target: str) -> tuple[int, int]:
    """The kernel's most entries and own tokens per row (constants of the build: read once, not every step)."""
    lib = library(target)
    return lib.ess_lru_max_entries(), lib.ess_lru_max_own()


def lru_update_cuda(
    slot_pos: torch.Tensor,
    slot_stamp: torch.Tensor,
    pos_slot: torch.Tensor,
    req: torch.Tensor,
    sets: torch.Tensor,
    own_pos: torch.Tensor,
    stamp: torch.Tensor | int,
    token_table: torch.Tensor | None = None,
    num_rows: torch.Tensor | None = None,
    profile: torch.Tensor | None = None,
    staged: bool | None = None,
) -> PolicyResult:
    """ess.core.policy.lru_update's step as one CUDA kernel (the arguments and results of
    ess.core.kernels.lru_step.lru_update_fused; the tables must be contiguous int32). On CPU tensors the kernel runs in its
    CPU emulation. num_rows: a one-element int32 device tensor; rows at or past it are empty rows (no entry, no own
    token) whatever they hold: a CUDA graph's padding, skipped. profile [B, 8] int64 (GPU): thread 0's global timer
    (ns) at the kernel's 7 phase boundaries. staged: force the slots in (True) or out of (False) shared memory; None:
    in, where they fit."""
    B, K = sets.shape
    one_own = own_pos.dim() == 1
    own = own_pos.reshape(B, 1 if one_own else own_pos.shape[1]).to(torch.int64).contiguous()
    M = own.shape[1]
    C = slot_pos.shape[1] - 1
    P = pos_slot.shape[1] - 1
    check_capacity(C, K, M)
    check_step_tables("CUDA LRU step", slot_pos, slot_stamp, pos_slot, token_table)
    dev = sets.device
    target = target_of(dev)
    lib = library(target)
    max_entries, max_own = _limits(target)
    if K > max_entries:
        raise ValueError(f"CUDA LRU step: {K} entries per row (query rows x top-k) exceed its {max_entries}")
    if M > max_own:
        raise ValueError(f"CUDA LRU step: {M} own tokens per row (MTP query rows) exceed its {max_own}")
    stamp = torch.as_tensor(stamp, device=dev)
    if stamp.dtype not in (torch.int32, torch.int64) or stamp.numel() != 1:
        raise ValueError(f"CUDA LRU step: the stamp must be one int32 or int64 value, got {stamp.dtype} {tuple(stamp.shape)}")
    stamp = stamp.contiguous()
    req = req.to(torch.int64).contiguous()
    sets = sets.to(torch.int32).contiguous()
    i32 = dict(dtype=torch.int32, device=dev)
    out = PolicyResult.empty(B, K, M, dev)
    if num_rows is not None and (num_rows.dtype != torch.int32 or num_rows.numel() != 1):
        raise ValueError("CUDA LRU step: num_rows must be a one-element int32 tensor")
    if profile is not None and (profile.dtype != torch.int64 or tuple(profile.shape) != (B, 8) or not profile.is_contiguous()):
        raise ValueError("CUDA LRU step: profile must be a contiguous [B, 8] int64 tensor")
    if B > 0:
        if staged is None:
            staged = C <= _max_staged_slots(target, dev.index or 0)
        scratch = None if staged else torch.empty(B, C, **i32)
        ptr = lambda t: 0 if t is None else t.data_ptr()
        words = [
            ptr(slot_pos), ptr(slot_stamp), ptr(pos_slot), ptr(req), ptr(sets), ptr(own), ptr(stamp),
            ptr(token_table), token_table.stride(0) if token_table is not None else 0, ptr(num_rows),
            ptr(out.attn_slot), ptr(out.hit), ptr(out.miss_pos), ptr(out.miss_slot), ptr(out.miss_row),
            ptr(out.own_slot), ptr(out.n_miss), ptr(out.n_set), ptr(scratch), ptr(profile), B, K, C, P, M,
            int(stamp.dtype == torch.int32),
        ]
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        rc = lib.ess_lru_step((ctypes.c_longlong * ARGS)(*words), ARGS, stream)
        if rc != 0:
            raise RuntimeError(f"CUDA LRU step: launch failed (code {rc})")
    if one_own:
        out.own_slot = out.own_slot.squeeze(1)
    if token_table is None:
        out.miss_row = None  # no token table, no host rows: the caller translates miss_pos itself
    return out


def self_check(device: torch.device) -> None:
    """Raises RuntimeError unless the kernel builds and equals the torch path on `device` (small random and adversarial
    steps, decode and verify): how `auto` admits it (ess.core.sparse_pool.step_function)."""
    from ess.core.policy import lru_update

    g = torch.Generator().manual_seed(0)
    for B, K, C, M, P, steps in ((3, 16, 20, 1, 64, 6), (2, 12, 40, 3, 96, 5)):
        tables = [(torch.full((B, C + 1), -1, dtype=torch.int32, device=device),
                   torch.zeros(B, C + 1, dtype=torch.int32, device=device),
                   torch.full((B, P + 1), -1, dtype=torch.int32, device=device)) for _ in range(2)]
        req = torch.randperm(B, generator=g).to(device)
        for t in range(steps):
            stamp = 7 if t < 2 else t  # two steps with one stamp: ties broken by position
            sets = torch.randint(-1, P - M * steps - 1, (B, K), generator=g, dtype=torch.int32).to(device)
            own = (P - M * steps - 1 + M * t + torch.arange(M)).expand(B, M).contiguous().to(device)
            own = own[:, 0] if M == 1 else own
            want = lru_update(*tables[0], req, sets, own, stamp)
            got = lru_update_cuda(*tables[1], req, sets, own, stamp)
            for f in ("attn_slot", "hit", "miss_pos", "miss_slot", "own_slot", "n_miss", "n_set"):
                if not torch.equal(getattr(want, f), getattr(got, f)):
                    raise RuntimeError(f"CUDA LRU step differs from the torch path on {device} ({f}, B={B}, M={M}, step {t})")
            for x, y in zip(*tables):
                if not torch.equal(x[:, :-1], y[:, :-1]):
                    raise RuntimeError(f"CUDA LRU step's tables differ from the torch path's on {device}")


def main(argv=None) -> int:
    """`python -m ess.core.kernels.lru_step_cuda [--target sm_90 | emulate] [--compile-only]`: build the kernel now (default: for
    this machine's GPU), printing the library's path, or why it did not build (exit 1)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--target", help="sm_XY (nvcc) or emulate (g++); default: the GPU's, else emulate")
    p.add_argument("--compile-only", action="store_true", help="compile (nvcc -c / g++ -c) into a temporary file")
    p.add_argument("--check", action="store_true", help="then run the self-check against the torch path (needs the target's device)")
    args = p.parse_args(argv)
    target = args.target or (target_of(torch.device("cuda")) if torch.cuda.is_available() else "emulate")
    try:
        if args.compile_only:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = build_command(target, os.path.join(tmp, "lru_step.o"), compile_only=True)
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)}:\n{done.stderr[-4000:]}")
                print(f"compiled for {target}: {' '.join(cmd)}")
            return 0
        print(f"built for {target}: {build(target)}")
        if args.check:
            self_check(torch.device("cuda" if target != "emulate" else "cpu"))
            print("self-check: equal to the torch path")
    except RuntimeError as e:
        print(f"CUDA LRU step: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
