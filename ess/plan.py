"""Layer-wise overlap plans: per layer NONE, DA or DBA, chosen with the simulator's cost model from a miss profile.

Plan JSON (what the runtime and the plugin read, `--ess-layer-plan`):
    {"format": "ess-layer-plan/1", "num_layers": N, "modes": ["none" | "da" | "dba", ...],
     "exposed_transfer_us": [...], "mean_misses": [...], plus the inputs it was made for}
"""

from __future__ import annotations

import json

from ess.sim.cost import Deployment
from ess.sim.engine import layer_misses, load_calibration, plan_layers, ratio_for_batch, simulate
from ess.sim.specs import get_hardware, get_model

FORMAT = "ess-layer-plan/1"
MODES = ("none", "da", "dba")


class PlanError(ValueError):
    """A plan file that is unreadable, of another format, or for another layer count."""


def make_plan(profile: dict, hardware: str, context: int, batch: int, mtp: int = 2, accept: float = 1.7,
              sparse_ratio: float | None = None, model: str = "dsv32", ep: int = 32, tbo: bool = True) -> dict:
    spec, hw = get_model(model), get_hardware(hardware)
    if spec.index_topk is None:
        raise ValueError(f"--model {model}: no sparse attention, nothing to plan")
    have = int(profile["num_layers"])
    if have not in (spec.layers, spec.layers + 1):
        raise PlanError(f"profile has {have} layers; {model} has {spec.layers} (+1 MTP layer)")
    cal = load_calibration()
    dep = Deployment(ep=ep, tbo=tbo)
    if sparse_ratio is None:
        sparse_ratio = ratio_for_batch(spec, hw, cal, dep, batch, context)
        if sparse_ratio * context < spec.index_topk + 1:
            raise ValueError(f"--batch-size {batch} does not fit {hardware} at context {context} even with ESS")
    misses = layer_misses(spec, mtp, profile, sparse_ratio)
    n = len(misses)
    layers = plan_layers(spec, hw, cal, dep, batch, context, mtp, misses)
    modes = [mode for mode, _ in layers]
    exposed = [round(e * 1e6, 3) for _, e in layers]
    common = dict(model=model, hardware=hardware, context=context, mtp=mtp, accept=accept, batch=batch,
                  sparse_ratio=sparse_ratio, tbo=tbo, ep=ep, profile=profile)
    planned, serial = simulate(overlap="plan", **common), simulate(overlap="none", **common)
    return {
        "format": FORMAT,
        "model": model,
        "hardware": hardware,
        "context": context,
        "batch_size": batch,
        "mtp": mtp,
        "sparse_ratio": round(sparse_ratio, 6),
        "profile_source": profile.get("source"),
        "num_layers": n,
        "modes": modes,
        "counts": {m: modes.count(m) for m in MODES},
        "mean_misses": [round(m, 3) for m in misses],
        "exposed_transfer_us": exposed,
        "predicted": {
            "step_ms": planned["step_ms"],
            "throughput": planned["throughput"],
            "exposed_transfer_ms": planned["exposed_transfer_ms"],
            "serial_swap_in_step_ms": serial["step_ms"],
            "serial_swap_in_exposed_ms": serial["exposed_transfer_ms"],
        },
    }


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
