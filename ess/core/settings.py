"""ESS's defaults and its cache knobs, in one place, with one set of rules for the demo, the tools and the plugin.

No torch import: the CLI's parser and SGLang's argument hooks read this module. Every error names the knob as the
caller spells it (a demo flag, a plugin flag, a config field): `check_knobs(..., names=...)`.
"""

from __future__ import annotations

import dataclasses
import math
import os

GIB = 1 << 30
DEFAULT_SPARSE_RATIO = 0.2  # the ESS paper's operating point, when neither the buffer nor the ratio is given
WARMUP_WINDOWS = 32  # LRU-Warmup windows W (docs/design.md, "LRU-Warmup")
OVERLAP_MODES = ("none", "da", "dba")  # docs/design.md, "Overlap"
OVERLAP_CHOICES = ("auto",) + OVERLAP_MODES  # auto: per layer from a plan, else da
# DA's Attn1 (docs/design.md, "Overlap"): "miss" the compact kernel over the compacted miss lists after FlashTrans'
# H2D (ess.core.kernels.miss_attention), "fused" the H2D and Attn1 in one kernel (the copy then starts after PreAttn, when the
# query exists), "calls" a second full-width attention call (the hits set to -1). Not yet timed on a GPU: "miss" keeps
# the H2D's start at the indexer, as DA had it.
DA_ATTN1_KINDS = ("miss", "fused", "calls")
DA_ATTN1 = "miss"
# The plugin's (--ess-da-attn1): "calls" there is one FlashMLA call over every entry after the copy, bit for bit the
# stock backend's output. Its default until a GPU shows the split pays: each split part leaves FlashMLA in bf16, so
# the merged output differs from one call's by bf16 rounding, which can flip a greedy token at a near-tie (seen in
# the CPU real-server test's tiny random model; docs/plugin.md).
PLUGIN_DA_ATTN1 = "calls"
PAGE_TOKENS = 64  # FlashMLA's page; host-pool allocation unit of the reference
DISK_PAGE_BYTES = 45056  # a disk tier's page: one layer's PAGE_TOKENS latent rows (41,984 B), 4 KiB-aligned for direct
# I/O (ess.reference.tiered_host_pool; the simulator's disk term)
TIER_PLACEMENTS = ("frequency", "lru")  # which page a full disk tier's host frames give up (docs/design.md, "Disk tier")
TIER_HEAT_HALF_LIFE_STEPS = 8  # placement "frequency": a page's access count halves every 8 decode steps
# Progressive PD (docs/pd.md, "Progressive PD transfer"): at most this many requests per decode rank decode before
# all their latent rows have landed (each holds a landed bitmap of layers x context bytes on the device, 1/656 of the
# rows it tracks); more wait for their whole transfer, as without the flag.
PROGRESSIVE_REQUESTS = 16
# A prefill node sends a progressive request's phase 3 (the latent pages no warm-up row names) in slices of this many
# pages, each reported when it has landed; the blocks a waiting decode step names go next, after the slice in flight,
# once per layer that waits: 4 pages of 64 tokens are 10.2 MB over DeepSeek-V3.2's 61 layers (0.8 ms at 100 Gb/s),
# 512 slices at 128K (one Mooncake batch transfer and one message each). Chosen in the model (docs/simulator.md:
# 16 pages lose at 32K, the first step waiting half a slice at each of 61 layers); per-slice costs not measured.
PROGRESSIVE_SLICE_PAGES = 4
# A decode step waits at most this long for a row of a request still landing (a wait is normally the slice in flight
# and the named blocks: milliseconds). Past it the request is aborted and the step goes on without waiting for it:
# its transfer has stalled (a prefill node that stopped writing without a status; SGLang keeps silent when a write may
# still be landing), and every request of the batch would stall with it until SGLang's waiting timeout (300 s).
PROGRESSIVE_WAIT_S = 10.0
HOST_PINNABLE_FRACTION = 0.8  # of a machine's memory, ESS's host pools may pin at most this share (the OS, the
# serving processes and the page cache keep the rest)
KERNELS = ("auto", "cuda", "fused", "torch")  # the LRU step: ess.core.kernels.lru_step_cuda's CUDA kernel (sgl-kernel/), ess.core.kernels.lru_step's
# fused Triton kernel, or ess.core.policy's torch ops (the CPU path and the oracle)
AUTO_GPU_KERNELS = ("cuda", "fused")  # `auto` on a GPU: the first of these that builds and equals the torch path there
# (ess.core.kernels.lru_step_cuda.self_check); the order is the design's expectation of speed (docs/gpu.md, "The CUDA LRU step"):
# put "fused" first to keep the Triton kernel
KERNEL_CACHE_DIR = "~/.cache/ess/kernels"  # built kernels (ess.core.kernels.lru_step_cuda; $ESS_KERNEL_CACHE overrides)
# `ess cache replay --policy`: ESS's LRU, the offline optimum (ess.analysis.belady), and the candidates of
# ess.analysis.candidate_policies (docs/policies.md)
REPLAY_POLICIES = ("lru", "belady", "prefetch", "score")
DEFAULT_DECAY_SHIFT = 2  # `--policy score`: the use score decays by 2^-2 per step (lambda = 0.75)
# `ess trace record --model NAME`: real-model traces (ess.analysis.real_traces; docs/profiling.md, "Real traces").
TRACE_MODELS = ("reference", "smollm2-135m")  # reference: the mini DeepSeek-V3.2 with random weights
REAL_TRACE_TOPK = 256  # keys per step of a real-model trace (an 8K context: top-k / context as DeepSeek-V3.2's at 64K)
REAL_TRACE_THREADS = 1  # torch threads of the recorder: with the 2 cores shared, 1 thread ran 4.7x faster than 2 (docs/profiling.md)

FIELD_NAMES = {"buffer_tokens": "buffer_tokens", "sparse_ratio": "sparse_ratio", "warmup_windows": "warmup_windows",
               "host_pool_gib": "host_pool_gib"}


class KnobError(ValueError):
    """A bad ESS setting; the message names it."""


def check_knobs(buffer_tokens=None, sparse_ratio=None, warmup_windows=WARMUP_WINDOWS, host_pool_gib=None,
                names: dict = FIELD_NAMES) -> None:
    """The rules of the cache knobs: at most one of buffer_tokens and sparse_ratio (neither: DEFAULT_SPARSE_RATIO),
    buffer_tokens a positive integer, sparse_ratio in (0, 1], warmup_windows a non-negative integer, host_pool_gib
    positive. Whether the buffer holds top-k + 1 needs the model: `capacity`."""
    if buffer_tokens is not None and sparse_ratio is not None:
        raise KnobError(f"give one of {names['buffer_tokens']} and {names['sparse_ratio']}, not both")
    if buffer_tokens is not None and (not isinstance(buffer_tokens, int) or buffer_tokens < 1):
        raise KnobError(f"{names['buffer_tokens']} must be a positive integer, got {buffer_tokens!r}")
    if sparse_ratio is not None and not (0.0 < sparse_ratio <= 1.0):
        raise KnobError(f"{names['sparse_ratio']} must be in (0, 1], got {sparse_ratio!r}")
    if not isinstance(warmup_windows, int) or warmup_windows < 0:
        raise KnobError(f"{names['warmup_windows']} must be a non-negative integer, got {warmup_windows!r}")
    if host_pool_gib is not None and not host_pool_gib > 0:
        raise KnobError(f"{names['host_pool_gib']} must be positive, got {host_pool_gib!r}")


def check_disk_dir(directory: str, flag: str) -> None:
    """A disk tier's directory: it exists and this process may create files there (the message names `flag`)."""
    if not os.path.isdir(directory):
        raise KnobError(f"{flag} {directory}: no such directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise KnobError(f"{flag} {directory}: not writable")


def _check_can_create(path: str, flag: str) -> None:
    """The nearest existing ancestor of a path to create is a writable directory."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise KnobError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KnobError(f"{flag} {path}: {parent} is not writable")


def check_output_dir(directory: str, flag: str) -> None:
    """A directory this process will create files in (created if missing): not a file, and writable or creatable
    (the message names `flag`)."""
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise KnobError(f"{flag} {directory}: exists and is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise KnobError(f"{flag} {directory}: not writable")
        return
    _check_can_create(directory, flag)


def check_output_file(path: str, flag: str) -> None:
    """A file this process will write (its folders created if missing): not a directory, writable or creatable."""
    if os.path.isdir(path):
        raise KnobError(f"{flag} {path}: is a directory, not a file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise KnobError(f"{flag} {path}: not writable")
        return
    _check_can_create(path, flag)


def sparse_ratio_in_effect(sparse_ratio: float | None) -> float:
    """The Sparse Memory Ratio a launch runs with: the one given, else DEFAULT_SPARSE_RATIO."""
    return DEFAULT_SPARSE_RATIO if sparse_ratio is None else sparse_ratio


def capacity(buffer_tokens, sparse_ratio, context_tokens: int, topk: int, names: dict = FIELD_NAMES,
             rows: int = 1) -> int:
    """The rule for C, the GPU slots per (request, layer) for requests of up to context_tokens tokens: buffer_tokens,
    else the ratio (sparse_ratio_in_effect) of the context, rounded up; at least what one step reads, rows (query rows
    per request: 1, or MTP's verify rows) x (top-k + 1) (the step's set and its own token)."""
    if buffer_tokens is not None:
        cap, what = buffer_tokens, names["buffer_tokens"]
    else:
        ratio = sparse_ratio_in_effect(sparse_ratio)
        cap = math.ceil(ratio * context_tokens)
        what = f"{names['sparse_ratio']} {ratio} of {context_tokens} tokens"
    need = rows * (topk + 1)
    if cap < need:
        reads = "top-k + 1" if rows == 1 else f"{rows} verify rows x (top-k + 1)"
        raise KnobError(f"{what}: a GPU buffer of {cap} tokens per request is below {reads} = {need} "
                        "(the step's top-k set and its own token must fit)")
    return cap


@dataclasses.dataclass(frozen=True)
class EssConfig:
    """The cache knobs of the reference model's ESS cache and the offline tools, fields named as here (a server
    launch's settings are the plugin's record, sglang_ess.args.EssArgs, held to the same rules): buffer_tokens, the
    GPU Sparse Memory Pool's slots per (request, layer), or sparse_ratio, the same as a share of the context;
    host_pool_gib, the pinned Total Memory Pool (None: sized to the live requests); warmup_windows, LRU-Warmup's W
    (0: off)."""

    topk: int
    buffer_tokens: int | None = None
    sparse_ratio: float | None = None
    warmup_windows: int = WARMUP_WINDOWS
    host_pool_gib: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.topk, int) or self.topk < 1:
            raise KnobError(f"topk must be a positive integer, got {self.topk!r}")
        check_knobs(self.buffer_tokens, self.sparse_ratio, self.warmup_windows, self.host_pool_gib)
        if self.buffer_tokens is not None:
            capacity(self.buffer_tokens, None, 0, self.topk)

    def capacity(self, context_tokens: int) -> int:
        return capacity(self.buffer_tokens, self.sparse_ratio, context_tokens, self.topk)

    def host_pool_tokens(self, num_layers: int, row_bytes: int) -> int | None:
        if self.host_pool_gib is None:
            return None
        return int(self.host_pool_gib * GIB) // (num_layers * row_bytes)

    @staticmethod
    def from_dict(d: dict) -> "EssConfig":
        names = {f.name for f in dataclasses.fields(EssConfig)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise KnobError(f"unknown ESS config field(s) {unknown}; known: {sorted(names)}")
        return EssConfig(**d)
