"""A hook table: one row per SGLang touch point, from which both the registration and the tests' check are made.

A row names a target of the installed SGLang (a dotted path), how the hook attaches (SGLang's HookType), the hook,
the target's parameters the hook reads (by name, in order from the first) and why it is there. SGLang's own
HookRegistry applies the rows after every plugin ran; the tests resolve each target and check that it still has
the parameters its row names, so an upstream rename fails a test. ESS's hooks (sglang_ess.hooks), the CPU path's
patches (sglang_ess.cpu.patches) and the GPU rig's are such tables.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str  # dotted path in sglang 0.5.23
    kind: HookType
    hook: Callable
    params: tuple[str, ...]  # the target's parameters the hook reads, by name, in order from the first
    why: str  # what it does there, or what fails without it


def register(table: list[Hook]) -> None:
    for row in table:
        HookRegistry.register(row.target, row.hook, row.kind)


def unpatched(table: list[Hook]) -> list[str]:
    """Targets that SGLang failed to patch (it logs and goes on; the hook would then be silently off)."""
    return [row.target for row in table if row.target not in HookRegistry._patched]


def expected_params(table: list[Hook]) -> dict[str, list[str]]:
    """Each target's parameters that its hook reads: the view the tests check against the installed SGLang."""
    return {row.target: list(row.params) for row in table}
