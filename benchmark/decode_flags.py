"""benchmark/decode_gpu.py's command line: its flags with their defaults, and the checks that need nothing but the
flags (those that need the stack's setup stay in decode_gpu.main). The script loads this module by its path."""

from __future__ import annotations

import argparse

import torch

from ess.analysis.sim.paper import EP
from ess.core.kernels import indexer
from ess.core.settings import DA_ATTN1, DA_ATTN1_KINDS
from ess.reference.layer_rest import EXPERTS

MODES = ("baseline", "none", "da", "dba", "plan", "hisparse")
# the generator fitted to real SmolLM2-135M traces (docs/profiling.md, "Fitting the synthetic generator")
DEFAULT_FIT = "benchmark/results/policies/real_fit.json"
# The projections' dtype: float32 timed the reference model's float32 torch ops on the H200 (2026-11-26), not a
# server's speed (docs/gpu.md); bf16 is the default on a GPU
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def parse(argv: list[str] | None, description: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (for its error and defaults) and the flags of argv, --modes and --batches checked."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="folder for decode.json and decode.png (created)")
    p.add_argument("--layers", type=int, default=4, help="decode layers in the stack")
    p.add_argument("--contexts", type=lambda x: [int(v) for v in x.split(",")], default=[32768, 131072])
    p.add_argument("--ratios", type=lambda x: [float(v) for v in x.split(",")], default=[0.1, 0.2, 0.3])
    p.add_argument("--batches", type=lambda x: [int(v) for v in x.split(",")], default=[1, 2, 8, 32],
                   help="batches every arm runs (each also at the baseline's memory wall and its own largest batch)")
    p.add_argument("--residency", choices=["on", "off"], default="on",
                   help="ESS residency first (on, the plugin's design) or every request offloaded (off)")
    p.add_argument("--modes", type=lambda x: x.split(","), default=list(MODES), help=f"of {','.join(MODES)}")
    p.add_argument("--query-rows", type=lambda x: [int(v) for v in x.split(",")], default=[1, 3],
                   help="query rows per request and step: 1 is decode, 3 is MTP verify of 2 draft tokens")
    p.add_argument("--accept", type=float, default=1.7,
                   help="tokens per request a verify step yields (the simulator's default for 2 draft tokens)")
    p.add_argument("--topk-source", choices=["synth", "indexer"], default="synth")
    p.add_argument("--fit", metavar="FILE", nargs="?", const=DEFAULT_FIT,
                   help="ESS's rows also with the locality of a fit to real traces (`ess trace synth --like`'s report; "
                   f"alone: {DEFAULT_FIT}, the SmolLM2 traces), rows labelled locality fit beside the paper's")
    p.add_argument("--warm-steps", type=int, default=4, help="eager steps before the timed one")
    p.add_argument("--iters", type=int, default=10, help="timed replays per configuration")
    p.add_argument("--max-batch", type=int, help="cap the largest batches (memory or time)")
    p.add_argument("--hardware", help="simulator profile of this GPU, for the modelled rest of a layer (default: H200 "
                   "on an H200, else H100)")
    p.add_argument("--check", action="store_true",
                   help="also compare every ESS mode's outputs with the baseline's (a second stack: small runs)")
    p.add_argument("--append", action="store_true",
                   help="add the rows to OUT/decode.json (one context per run keeps each run short)")
    p.add_argument("--measured", nargs="+", metavar="FILE",
                   help="mode plan chooses each layer's overlap on ESS's terms measured on a GPU: a kit.json, then "
                   "optionally a bookkeeping.json, a whole-layer decode.json and an indexer.json (e.g. "
                   "benchmark/results/gpu/h200/); "
                   "default: the simulator's "
                   "modelled terms, with which plan lost 6-10%% to none on the H200 (docs/gpu.md)")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="weights and activations of the projections (default: bf16 on a GPU, float32 in the smoke run)")
    p.add_argument("--attn1", choices=DA_ATTN1_KINDS, default=DA_ATTN1,
                   help="DA / DBA's Attn1 in decode rows: the miss kernel, the fused copy-attend, or a second FlashMLA "
                   "call (the plugin's default); verify rows always make two calls")
    p.add_argument("--rest", choices=["measured", "modelled"], default="measured",
                   help="the rest of each layer (w_vc, o_proj, MoE, the dense FFN, the LM head): measured on this GPU "
                   "(the all-to-all a wait of its modelled length) or the simulator's (the hybrid figures before "
                   "2026-11-28)")
    p.add_argument("--ep", type=int, default=EP, choices=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="expert parallelism of the measured MoE share (256 / EP routed experts on this GPU) and of the "
                   "all-to-all's length; the cache budget stays the paper's deployment's (EP %(default)s)")
    p.add_argument("--experts", choices=EXPERTS, default="fp8",
                   help="the routed experts' precision in the measured rest: fp8 (the deployment's; row-wise scales, "
                   "torch's scaled grouped GEMM, bf16 where the device refuses it, said in rest_ms.experts_gemm) or "
                   "bf16")
    p.add_argument("--tbo", action="store_true",
                   help="two-batch overlap in every arm from batch 2: two micro-batches, one's all-to-all and H2D "
                   "beside the other's compute; mode dba is then each micro-batch's H2D under the other's stage, then "
                   "one attention call (docs/gpu.md, \"Two-batch overlap\")")
    p.add_argument("--select", choices=indexer.SELECTS, default=indexer.SELECT,
                   help="how the indexer picks its top-k (ess.core.kernels.indexer's SELECT, for this run): int64 keys "
                   "and torch.topk, the radix select one program a request, or the split radix select fused with the "
                   "scores kernel (the same sets; benchmark/indexer_kernels.py times each)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    if not args.batches or min(args.batches) < 1:
        p.error(f"--batches: positive batch sizes, got {args.batches}")
    return p, args
