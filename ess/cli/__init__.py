"""The `ess` command. Every command that reports numbers takes --json and then prints one JSON document on stdout;
tables go to stdout without --json, progress to stderr.

A module per command group (cmd_*.py) owns its parser, its checks and its run; common.py holds what they share.
A command's checks run before any work: its flags' combinations and bounds (single flags are checked by their
argparse types), each refusal a ValueError naming the flag."""

from __future__ import annotations

import os
import sys

# Before torch loads MKL: without a fixed code path, MKL's float32 GEMMs may differ in the last bits with the memory
# alignment of their operands, which changes from process to process; the random-weight model's near-ties then flipped
# the baseline's tokens in 5 of 26 runs of `ess demo --ess` (0 of 22 with this setting). STRICT makes the results
# independent of alignment.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from ess.cli import cmd_cache, cmd_demo, cmd_plan, cmd_profile, cmd_sim, cmd_trace  # noqa: E402
from ess.cli.common import Parser, check_outputs  # noqa: E402


def build_parser() -> Parser:
    p = Parser(prog="ess", description="ESS: offloaded sparse KV cache for DeepSeek-V3.2 decode")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (cmd_demo, cmd_cache, cmd_sim, cmd_trace, cmd_profile, cmd_plan):
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_outputs(args)
        if getattr(args, "check", None):
            args.check(args)
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"ess: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # what the checks before the work cannot see (a full disk; a path only root is refused)
        print(f"ess: error: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 2
