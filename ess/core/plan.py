"""Layer-wise overlap plan files: per layer NONE, DA or DBA (made by ess.analysis.planning from a miss profile).

Plan JSON (what the runtime and the plugin read, `--ess-layer-plan`):
    {"format": "ess-layer-plan/1", "num_layers": N, "modes": ["none" | "da" | "dba", ...],
     "exposed_transfer_us": [...], "mean_misses": [...], plus the inputs it was made for}
"""

from __future__ import annotations

import json

from ess.core.settings import OVERLAP_MODES as MODES

FORMAT = "ess-layer-plan/1"


class PlanError(ValueError):
    """A plan file that is unreadable, of another format, or for another layer count."""


def validate_plan(plan: dict, num_layers: int | None = None, where: str = "plan", mtp_layer: bool = False) -> list[str]:
    """The plan's modes; with num_layers, the plan must cover exactly those layers (one more entry allowed, for the
    MTP layer, where mtp_layer)."""
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise PlanError(f"{where}: not an ESS layer plan (expected format {FORMAT!r})")
    modes = plan.get("modes")
    if not isinstance(modes, list) or any(m not in MODES for m in modes) or len(modes) != plan.get("num_layers"):
        raise PlanError(f"{where}: 'modes' must list num_layers entries of {MODES}")
    if num_layers is not None and len(modes) not in ((num_layers, num_layers + 1) if mtp_layer else (num_layers,)):
        raise PlanError(f"{where}: plan for {len(modes)} layers, the model has {num_layers}")
    return modes


def load_plan(path, num_layers: int | None = None, mtp_layer: bool = False) -> list[str]:
    try:
        with open(path) as f:
            plan = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, or not JSON
        raise PlanError(f"{path}: not a readable layer plan ({type(e).__name__}: {e})") from e
    return validate_plan(plan, num_layers, str(path), mtp_layer)
