"""ESS launch flags: added to SGLang's own parser, carried on the ServerArgs record into every process.

ServerArgs is a msgspec Struct with a fixed field set, so ESS cannot add fields. It keeps its settings in one
bookkeeping attribute, `server_args._ess`, which ServerArgs.__reduce__ pickles along (that is how the launcher's
record reaches the scheduler processes). `ess_args(server_args)` reads it anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

from ess.core import settings
from ess.core.settings import DA_ATTN1_KINDS, DEFAULT_SPARSE_RATIO, OVERLAP_CHOICES, PLUGIN_DA_ATTN1, WARMUP_WINDOWS

ATTR = "_ess"


class EssArgsError(ValueError):
    """A bad ESS launch setting; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class EssArgs:
    enable: bool = False
    buffer_tokens: int | None = None
    sparse_ratio: float | None = None
    host_pool_gib: float | None = None
    overlap: str = "auto"
    layer_plan: str | None = None
    da_attn1: str = PLUGIN_DA_ATTN1  # DA's Attn1 (docs/plugin.md, "Overlap")
    warmup_windows: int = WARMUP_WINDOWS
    record_trace: str | None = None
    record_lookahead: int = 0  # with record_trace: ranks past the top-k recorded as topk_ext
    disk_dir: str | None = None  # a disk tier under the host pool (ess.core.disk_tier); host_pool_gib is then its frames
    disk_gib: float | None = None  # the disk tier's budget (default: the directory's free space)
    progressive_pd: bool = False  # a PD decode node starts a request before its latent rows have all landed
    hisparse: bool = False  # SGLang's own --enable-hisparse, which excludes ESS

    # flag name of each field, for messages
    FLAGS = {
        "enable": "--enable-ess",
        "buffer_tokens": "--ess-buffer-tokens",
        "sparse_ratio": "--ess-sparse-ratio",
        "host_pool_gib": "--ess-host-pool-gib",
        "overlap": "--ess-overlap",
        "layer_plan": "--ess-layer-plan",
        "da_attn1": "--ess-da-attn1",
        "warmup_windows": "--ess-warmup-windows",
        "record_trace": "--ess-record-trace",
        "record_lookahead": "--ess-record-lookahead",
        "disk_dir": "--ess-disk-dir",
        "disk_gib": "--ess-disk-gib",
        "progressive_pd": "--ess-progressive-pd",
    }

    def check(self) -> "EssArgs":
        """Checks that need no model: combinations of the ESS flags themselves."""
        set_flags = [self.FLAGS[f.name] for f in dataclasses.fields(self)
                     if f.name in self.FLAGS and f.name != "enable" and getattr(self, f.name) != f.default]
        if not self.enable:
            if set_flags:
                raise EssArgsError(f"{', '.join(set_flags)} given without --enable-ess")
            return self
        if self.hisparse:
            raise EssArgsError("--enable-ess and --enable-hisparse both offload the sparse KV cache; choose one")
        try:  # the rules every ESS entry point shares (ess.core.settings), with this layer's flag names
            settings.check_knobs(self.buffer_tokens, self.sparse_ratio, self.warmup_windows, self.host_pool_gib, self.FLAGS)
        except settings.KnobError as e:
            raise EssArgsError(str(e)) from e
        if not isinstance(self.record_lookahead, int) or self.record_lookahead < 0:
            raise EssArgsError(f"--ess-record-lookahead must be a non-negative integer, got {self.record_lookahead!r}")
        if self.record_lookahead and self.record_trace is None:
            raise EssArgsError("--ess-record-lookahead adds ranks to recorded traces: give --ess-record-trace DIR too")
        if self.record_trace is not None:
            try:
                settings.check_output_dir(self.record_trace, self.FLAGS["record_trace"])
            except settings.KnobError as e:
                raise EssArgsError(str(e)) from e
        if self.disk_gib is not None:
            if self.disk_dir is None:
                raise EssArgsError("--ess-disk-gib bounds the disk tier: give --ess-disk-dir too")
            if not self.disk_gib > 0:
                raise EssArgsError(f"--ess-disk-gib must be positive, got {self.disk_gib!r}")
        if self.disk_dir is not None:
            if self.host_pool_gib is None:
                raise EssArgsError("--ess-disk-dir adds a disk tier under the host pool: give --ess-host-pool-gib, "
                                   "the pinned host memory that holds the pages in use")
            try:
                settings.check_disk_dir(self.disk_dir, self.FLAGS["disk_dir"])
            except settings.KnobError as e:
                raise EssArgsError(str(e)) from e
        if self.overlap not in OVERLAP_CHOICES:
            raise EssArgsError(f"--ess-overlap must be one of {OVERLAP_CHOICES}, got {self.overlap!r}")
        if self.da_attn1 not in DA_ATTN1_KINDS:
            raise EssArgsError(f"--ess-da-attn1 must be one of {DA_ATTN1_KINDS}, got {self.da_attn1!r}")
        if self.layer_plan is not None:
            if self.overlap != "auto":
                raise EssArgsError(f"--ess-layer-plan chooses the mode per layer; it cannot be combined with --ess-overlap {self.overlap}")
            if not os.path.isfile(self.layer_plan):
                raise EssArgsError(f"--ess-layer-plan: no such file: {self.layer_plan}")
        return self

    def buffer_for(self, context_len: int) -> int:
        """GPU slots per (request, layer): --ess-buffer-tokens, or the ratio of the longest context served
        (default DEFAULT_SPARSE_RATIO, the paper's operating point, when neither flag is given)."""
        if self.buffer_tokens is not None:
            return self.buffer_tokens
        ratio = DEFAULT_SPARSE_RATIO if self.sparse_ratio is None else self.sparse_ratio
        return math.ceil(ratio * context_len)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ESS (offloaded sparse latent cache for DeepSeek-V3.2 decode)")
    g.add_argument("--enable-ess", action="store_true", help="Keep the MLA latent cache in pinned host memory and a per-request LRU working set on the GPU (ESS).")
    g.add_argument("--ess-buffer-tokens", type=int, default=None, help="GPU latent slots per request and layer (at least top-k + 1; the ESS paper recommends >= 6.4K).")
    g.add_argument("--ess-sparse-ratio", type=float, default=None, help=f"GPU latent slots as a share of the context length (Sparse Memory Ratio), instead of --ess-buffer-tokens. Default {DEFAULT_SPARSE_RATIO}.")
    g.add_argument("--ess-host-pool-gib", type=float, default=None, help="Pinned host memory for the full latent cache (Total Memory Pool), per GPU. Default: sized to the token pool. With --ess-disk-dir: the host frames over the disk tier.")
    g.add_argument("--ess-disk-dir", type=str, default=None, help="A directory on local NVMe for a disk tier under the host pool: pages no recent step used are written there and read back when a step needs them (eager mode: needs --cuda-graph-backend-decode disabled and prefill graphs off; co-located only).")
    g.add_argument("--ess-disk-gib", type=float, default=None, help="With --ess-disk-dir: the most the page file may take, per GPU (default: the directory's free space).")
    g.add_argument("--ess-overlap", choices=OVERLAP_CHOICES, default="auto", help="How the H2D of misses overlaps compute: none, da (Dual-Attention), dba (DualBatch-Attention), or auto (per layer from --ess-layer-plan, else da).")
    g.add_argument("--ess-layer-plan", type=str, default=None, help="Per-layer overlap plan from `ess plan` (format ess-layer-plan/1).")
    g.add_argument("--ess-da-attn1", choices=DA_ATTN1_KINDS, default=PLUGIN_DA_ATTN1, help=f"DA / DBA decode attention: calls (one FlashMLA call over every entry after the misses' copy; default), miss (FlashMLA over the hits, ESS's kernel over the misses, merged by log-sum-exp), fused (as miss, the misses' copy and attention in one kernel). Not yet timed on a GPU.")
    g.add_argument("--ess-warmup-windows", type=int, default=WARMUP_WINDOWS, help="LRU-Warmup: replay the top-k sets of the last W prefill positions before decode (0: off).")
    g.add_argument("--ess-record-trace", type=str, default=None, help="Directory to write top-k trace files (.npz, the `ess profile` input) of finished requests.")
    g.add_argument("--ess-progressive-pd", action="store_true", help="PD decode node: a request joins decode once its index-K, warm-up state and warm-up rows have landed, while its other latent rows stream; a step that needs a row not landed yet waits for it (tokens equal a full transfer's). Needs --disaggregation-mode decode and --disaggregation-transfer-backend mooncake or nixl; prefill nodes with --enable-ess send in the progressive order; with decode CUDA graphs on, a batch holding a request still landing runs eagerly (docs/plugin.md).")
    g.add_argument("--ess-record-lookahead", type=int, default=0, help="With --ess-record-trace: also record the D positions the indexer ranks after each decode top-k (topk_ext, for `ess cache replay --policy prefetch`); one extra top-k over the logits per layer.")


def from_namespace(ns: argparse.Namespace) -> EssArgs:
    """The ESS settings of a parsed command line (argparse's dest of each flag in EssArgs.FLAGS)."""
    given = {name: getattr(ns, flag[2:].replace("-", "_")) for name, flag in EssArgs.FLAGS.items()
             if hasattr(ns, flag[2:].replace("-", "_"))}
    return EssArgs(**given, hisparse=bool(getattr(ns, "enable_hisparse", False))).check()


def attach(server_args: Any, args: EssArgs) -> None:
    setattr(server_args, ATTR, args)


def ess_args(server_args: Any) -> EssArgs:
    """The ESS settings of a ServerArgs record (ESS off when the record came from elsewhere, e.g. Engine(...))."""
    return getattr(server_args, ATTR, None) or EssArgs()
