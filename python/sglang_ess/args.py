"""The settings of an ESS launch, one record (EssArgs): its flags, each a field declared once with its flag, help and
type (`flag`), added to SGLang's own parser (`add_cli_args`) and read back from its namespace (`from_namespace`); and
what the launch checks resolved against the model (`facts`, an EssFacts: sglang_ess.validate.resolution_step). How
the record travels into every process:

    parsed    ServerArgs.from_cli_args, in the launcher (`attach_flags`, from its hook): the ESS flags -> EssArgs
    resolved  SGLang's argument resolution, in the launcher (sglang_ess.validate.resolution_step, around its
              handle_other_validations): the checks against the model and the rest of the launch -> EssArgs.facts
    carried   ServerArgs is a msgspec Struct with a fixed field set, so ESS keeps its EssArgs in one bookkeeping
              attribute, `server_args._ess`, which ServerArgs.__reduce__ pickles along to the scheduler processes
    read      `ess_args(server_args)`, by every reader: the KV cache configurator's hooks (the pool's sizing), the
              device check before the load, the runtime
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ess.core import settings
from ess.core.settings import DA_ATTN1_KINDS, DEFAULT_SPARSE_RATIO, OVERLAP_CHOICES, PLUGIN_DA_ATTN1, WARMUP_WINDOWS


class EssArgsError(ValueError):
    """A bad ESS launch setting; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class EssFacts:
    """What the launch checks resolved (sglang_ess.validate.validate_model), for the pool, the sizing and the runtime
    of every process (carried there as EssArgs.facts)."""

    role: str  # "co-located", "pd-decode" (the ESS cache lives here) or "pd-prefill" (sends warm-up state only)
    topk: int
    layers: int
    context: int  # the longest context served
    buffer: int = 0  # GPU latent slots per (request, layer); 0 on a prefill node
    query_rows: int = 1  # query rows per request and step (MTP verify: 1 + draft tokens)
    plan: tuple[str, ...] | None = None  # --ess-layer-plan's mode per layer
    windows: int = 0  # LRU-Warmup windows a prefill node sends
    residency: bool = False  # residency first (--ess-residency; docs/design.md, "Residency first")
    fixed_step: bool = False  # decode runs as CUDA graphs: one step path for every batch (no host-known skips)
    # DP attention: a decode forward may run relabelled as one-token extends, which read the selected rows from the
    # host pool (sglang_ess.pool.stage_selected), so every new row is backed up: no resident path
    relabelled_decodes: bool = False


def flag(default, name: str, help: str, **argparse_kw):
    """An EssArgs field that is a launch flag: its default, its name, its help and how argparse reads it."""
    return dataclasses.field(default=default, metadata={"flag": name, "help": help, "argparse": argparse_kw})


@dataclasses.dataclass(frozen=True)
class EssArgs:
    """ESS's launch flags as parsed, one field each (`flag`); `check` holds their rules that need no model."""

    enable: bool = flag(False, "--enable-ess", "Keep the MLA latent cache in pinned host memory and a per-request LRU "
                        "working set on the GPU (ESS).", action="store_true")
    buffer_tokens: int | None = flag(None, "--ess-buffer-tokens", "GPU latent slots per request and layer (at least "
                                     "top-k + 1; the ESS paper recommends >= 6.4K).", type=int)
    sparse_ratio: float | None = flag(None, "--ess-sparse-ratio", "GPU latent slots as a share of the context length "
                                      f"(Sparse Memory Ratio), instead of --ess-buffer-tokens. Default "
                                      f"{DEFAULT_SPARSE_RATIO}.", type=float)
    host_pool_gib: float | None = flag(None, "--ess-host-pool-gib", "Pinned host memory for the full latent cache "
                                       "(Total Memory Pool), per GPU. Default: sized to the token pool. With "
                                       "--ess-disk-dir: the host frames over the disk tier.", type=float)
    overlap: str = flag("auto", "--ess-overlap", "How the H2D of misses overlaps compute: none, da (Dual-Attention), "
                        "dba (DualBatch-Attention), or auto (per layer from --ess-layer-plan, else da).",
                        choices=OVERLAP_CHOICES)
    layer_plan: str | None = flag(None, "--ess-layer-plan", "Per-layer overlap plan from `ess plan` (format "
                                  "ess-layer-plan/1).", type=str)
    da_attn1: str = flag(PLUGIN_DA_ATTN1, "--ess-da-attn1", "DA / DBA decode attention: calls (one FlashMLA call over "
                         "every entry after the misses' copy; default), miss (FlashMLA over the hits, ESS's kernel "
                         "over the misses, merged by log-sum-exp), fused (as miss, the misses' copy and attention in "
                         "one kernel). Not yet timed on a GPU.", choices=DA_ATTN1_KINDS)  # docs/plugin.md, "Overlap"
    warmup_windows: int = flag(WARMUP_WINDOWS, "--ess-warmup-windows", "LRU-Warmup: replay the top-k sets of the last "
                               "W prefill positions before decode (0: off).", type=int)
    record_trace: str | None = flag(None, "--ess-record-trace", "Directory to write top-k trace files (.npz, the `ess "
                                    "profile` input) of finished requests.", type=str)
    record_lookahead: int = flag(0, "--ess-record-lookahead", "With --ess-record-trace: also record the D positions "
                                 "the indexer ranks after each decode top-k (topk_ext, for `ess cache replay --policy "
                                 "prefetch`); one extra top-k over the logits per layer.", type=int)
    disk_dir: str | None = flag(None, "--ess-disk-dir", "A directory on local NVMe for a disk tier under the host "
                                "pool: pages no recent step used are written there and read back when a step needs "
                                "them (eager mode: needs --cuda-graph-backend-decode disabled and prefill graphs off; "
                                "co-located only).", type=str)
    disk_gib: float | None = flag(None, "--ess-disk-gib", "With --ess-disk-dir: the most the page file may take, per "
                                  "GPU (default: the directory's free space).", type=float)
    progressive_pd: bool = flag(False, "--ess-progressive-pd", "PD decode node: a request joins decode once its "
                                "index-K, warm-up state and warm-up rows have landed, while its other latent rows "
                                "stream; a step that needs a row not landed yet waits for it (tokens equal a full "
                                "transfer's). Needs --disaggregation-mode decode and --disaggregation-transfer-backend "
                                "mooncake or nixl; prefill nodes with --enable-ess send in the progressive order; with "
                                "decode CUDA graphs on, a batch holding a request still landing runs eagerly "
                                "(docs/pd.md).", action="store_true")
    residency: str = flag("auto", "--ess-residency", "Residency first: a request whose rows fit in the GPU pool keeps "
                          "all of them there (no LRU step, no transfer) and is offloaded only when the pool is full "
                          "(on; auto: on unless --ess-disk-dir or --ess-progressive-pd is given), or every request "
                          "offloaded (off).", choices=("auto", "on", "off"))
    hisparse: bool = False  # SGLang's own --enable-hisparse, which excludes ESS
    facts: EssFacts | None = None  # what the launch checks resolved; None while ESS is off, and before SGLang resolves

    def check(self) -> "EssArgs":
        """Checks that need no model: combinations of the ESS flags themselves."""
        set_flags = [FLAGS[f.name] for f in dataclasses.fields(self)
                     if f.name in FLAGS and f.name != "enable" and getattr(self, f.name) != f.default]
        if not self.enable:
            if set_flags:
                raise EssArgsError(f"{', '.join(set_flags)} given without --enable-ess")
            return self
        if self.hisparse:
            raise EssArgsError("--enable-ess and --enable-hisparse both offload the sparse KV cache; choose one")
        try:  # the rules every ESS entry point shares (ess.core.settings), with this layer's flag names
            settings.check_knobs(self.buffer_tokens, self.sparse_ratio, self.warmup_windows, self.host_pool_gib, FLAGS)
        except settings.KnobError as e:
            raise EssArgsError(str(e)) from e
        if not isinstance(self.record_lookahead, int) or self.record_lookahead < 0:
            raise EssArgsError(f"--ess-record-lookahead must be a non-negative integer, got {self.record_lookahead!r}")
        if self.record_lookahead and self.record_trace is None:
            raise EssArgsError("--ess-record-lookahead adds ranks to recorded traces: give --ess-record-trace DIR too")
        if self.record_trace is not None:
            try:
                settings.check_output_dir(self.record_trace, FLAGS["record_trace"])
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
                settings.check_disk_dir(self.disk_dir, FLAGS["disk_dir"])
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


FLAGS = {f.name: f.metadata["flag"] for f in dataclasses.fields(EssArgs) if "flag" in f.metadata}  # field -> flag


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ESS (offloaded sparse latent cache for DeepSeek-V3.2 decode)")
    for f in dataclasses.fields(EssArgs):
        if "flag" in f.metadata:
            g.add_argument(f.metadata["flag"], default=f.default, help=f.metadata["help"], **f.metadata["argparse"])


def from_namespace(ns: argparse.Namespace) -> EssArgs:
    """The ESS settings of a parsed command line (argparse's dest of each flag in FLAGS)."""
    dests = {field: name[2:].replace("-", "_") for field, name in FLAGS.items()}
    given = {field: getattr(ns, dest) for field, dest in dests.items() if hasattr(ns, dest)}
    return EssArgs(**given, hisparse=bool(getattr(ns, "enable_hisparse", False))).check()


ATTR = "_ess"  # the ServerArgs attribute that carries a launch's EssArgs
OFF = EssArgs()


def ess_args(server_args: Any) -> EssArgs:
    """ESS's settings of a ServerArgs record. ESS is off (`enable` False) unless it was launched with --enable-ess: OFF
    for a record built elsewhere (Engine(...), which takes no ESS flag). SGLang resolves a record in the launcher,
    before any scheduler process receives it, so there an ESS launch has its facts."""
    return getattr(server_args, ATTR, None) or OFF


def attach_flags(server_args: Any, namespace: argparse.Namespace) -> None:
    """SGLang made the record from a command line: its ESS flags ride on it."""
    setattr(server_args, ATTR, from_namespace(namespace))


def attach_facts(server_args: Any, facts: EssFacts) -> None:
    """SGLang resolved the record: what the launch checks resolved rides on it beside the flags."""
    setattr(server_args, ATTR, dataclasses.replace(ess_args(server_args), facts=facts))
