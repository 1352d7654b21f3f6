"""What every `ess` command shares: the parser's class and help format, argument types, output paths and their checks,
the progress bar, and the JSON or table output."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ess.core.settings import DEFAULT_DECAY_SHIFT, KnobError, check_output_dir, check_output_file

JSON_HELP = "print one JSON document on stdout instead of a table"
SEED_HELP = "seed of the random weights and prompts"
SEED_MAX = 2**63 - 1  # torch's generators take a signed 64-bit seed (numpy's take any non-negative integer)

err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 200)  # tables are not cut when piped


def say(text: str) -> None:
    """One unwrapped line on stderr."""
    print(text, file=sys.stderr)


class ProgressBar:
    """A rich progress bar on stderr, one task per phase name."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.enabled:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, where it has one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage is a --help away), exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# -- argument types: a bad value is refused when the command line is read -------------------------------------------
def at_least(minimum: int, maximum: int | None = None, what: str | None = None):
    """An argparse type: an integer >= minimum (and <= maximum; `what` then says the range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{what or f'must be at least {minimum}'}, got {value}")
        return value

    return parse


POSITIVE, NON_NEGATIVE = at_least(1), at_least(0)
SEED = at_least(0, SEED_MAX, "a seed is an integer from 0 to 2^63 - 1 (torch's generators)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text}")
    return value


def floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated numbers, got {text!r}")
    return values


def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated integers, got {text!r}")
    return values


def _checked_path(text: str, flag: str, check) -> str:
    """An output path through a settings check (check_output_file / check_output_dir), as argparse reports it."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    try:
        check(text, flag)
    except KnobError as e:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(e)[len(flag) + 1:])
    return text


def output_file(flag: str, plot: bool = False):
    """An argparse type: a file to write, checked when the command line is read (not a directory, its folder
    creatable; a plot's name ends in a format matplotlib writes), so that a bad path fails before any work. An
    existing file is refused in check_outputs unless --force."""

    def parse(text: str) -> str:
        _checked_path(text, flag, check_output_file)
        if plot:
            from matplotlib.figure import Figure

            formats = Figure().canvas.get_supported_filetypes()
            suffix = pathlib.Path(text).suffix.lstrip(".").lower()
            if suffix not in formats:
                raise argparse.ArgumentTypeError(f"{text}: a plot's name ends in one of matplotlib's formats "
                                                 f"({', '.join('.' + f for f in sorted(formats))})")
        return text

    return parse


def output_dir(flag: str):
    """An argparse type: a directory to write files in, checked when the command line is read."""
    return lambda text: _checked_path(text, flag, check_output_dir)


def add_force(p) -> None:
    p.add_argument("--force", action="store_true", help="overwrite an existing output file (refused otherwise)")


# -- checks every command shares ---------------------------------------------------------------------------------------
def check_outputs(args) -> None:
    """An output file that exists is overwritten only with --force, and never when it is one of the command's
    inputs (a trace or a profile would be lost)."""
    profile = getattr(args, "profile", None)  # one file, or a list (`sim paper`, `sim pd`)
    inputs = [*(getattr(args, "traces", None) or []), getattr(args, "trace", None),
              *(profile if isinstance(profile, list) else [profile]), getattr(args, "like", None)]
    for attr in ("out", "plot", "fit_out"):
        path = getattr(args, attr, None)
        if not path or not os.path.isfile(path):
            continue
        if any(i and os.path.exists(i) and os.path.samefile(i, path) for i in inputs):
            raise ValueError(f"--{attr} {path}: that is an input of this command; write the output elsewhere")
        if not getattr(args, "force", False):
            raise ValueError(f"--{attr} {path}: exists; give --force to overwrite it")


def check_policy_flags(args) -> None:
    """`ess cache replay` and `ess profile`: the flags of one replacement policy only with that policy."""
    if args.lookahead is not None and args.policy != "prefetch":
        raise ValueError(f"--lookahead is the prefetch policy's; --policy {args.policy} would ignore it")
    if args.decay_shift is not None and args.policy != "score":
        raise ValueError(f"--decay-shift is the score policy's; --policy {args.policy} would ignore it")


def decay_shift(args) -> int:
    return DEFAULT_DECAY_SHIFT if args.decay_shift is None else args.decay_shift


def free_memory_bytes() -> int:
    """This machine's memory free now."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# -- output ------------------------------------------------------------------------------------------------------------
def output(path: str | None) -> str | None:
    """An output file's path, its folder created."""
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    return path


def emit(args, doc: dict, table: Table | None) -> None:
    if args.json:
        print(json.dumps(doc))
    elif table is not None:
        out.print(table)
