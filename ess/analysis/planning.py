"""Make a layer-wise overlap plan (ess.core.plan's file format) with the simulator's cost model from a miss profile."""

from __future__ import annotations

from ess.analysis.sim.cost import Deployment
from ess.analysis.sim.engine import check_slots, layer_misses, load_calibration, plan_layers, ratio_for_batch, simulate
from ess.analysis.sim.specs import get_hardware, get_model
from ess.core.plan import FORMAT, MODES, PlanError


def make_plan(profile: dict, hardware: str, context: int, batch: int, mtp: int = 2, accept: float = 1.7,
              sparse_ratio: float | None = None, model: str = "dsv32", ep: int = 32, tbo: bool = True,
              measured=None) -> dict:
    """measured: ESS's own terms from a GPU run (ess.analysis.sim.measured); default: modelled."""
    spec, hw = get_model(model), get_hardware(hardware)
    if spec.index_topk is None:
        raise ValueError(f"--model {model}: no sparse attention, nothing to plan")
    have = int(profile["num_layers"])
    if have not in (spec.layers, spec.layers + 1):
        raise PlanError(f"profile has {have} layers; {model} has {spec.layers} (+1 MTP layer)")
    cal = load_calibration()
    dep = Deployment(ep=ep, tbo=tbo)
    if context < spec.index_topk + 1:
        raise ValueError(f"--context {context}: below {model}'s top-k + 1 = {spec.index_topk + 1}; every position "
                         "would be selected, there is nothing to offload")
    if sparse_ratio is None:
        sparse_ratio = ratio_for_batch(spec, hw, cal, dep, batch, context)
        if sparse_ratio * context < spec.index_topk + 1:
            raise ValueError(f"--batch-size {batch} does not fit {hardware} at context {context} even with ESS")
    check_slots(spec, sparse_ratio, context)
    misses = layer_misses(spec, mtp, profile, sparse_ratio)
    n = len(misses)
    layers = plan_layers(spec, hw, cal, dep, batch, context, mtp, misses, measured)
    modes = [mode for mode, _ in layers]
    exposed = [round(e * 1e6, 3) for _, e in layers]
    common = dict(model=model, hardware=hardware, context=context, mtp=mtp, accept=accept, batch=batch,
                  sparse_ratio=sparse_ratio, tbo=tbo, ep=ep, profile=profile, measured=measured)
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
        "ess_costs": measured.source if measured is not None else "modelled",
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
