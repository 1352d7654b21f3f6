"""`ess plan`: a per-layer overlap plan (none / da / dba) from a miss profile and the simulator's cost model."""

from __future__ import annotations

import json

from rich.table import Table

from ess.cli.cmd_sim import add_sim_args, check_sim_args, measured_arg, measured_notes
from ess.cli.common import POSITIVE, add_force, emit, output, output_file, positive_float


def add_parsers(sub) -> None:
    pl = sub.add_parser("plan", help="per-layer overlap plan (none / da / dba) from a miss profile and the cost model")
    pl.add_argument("--profile", required=True)
    add_sim_args(pl, profile=False)
    pl.add_argument("--batch-size", type=POSITIVE, required=True, help="requests per GPU")
    pl.add_argument("--sparse-ratio", type=positive_float, help="default: the largest that fits the batch")
    pl.add_argument("--out", type=output_file("--out"), help="write the plan JSON here too")
    add_force(pl)
    pl.set_defaults(func=run_plan, check=check_sim_args)


def run_plan(args) -> int:
    from ess.analysis.planning import make_plan
    from ess.analysis.sim.profile import load_profile

    measured = measured_arg(args)
    plan = make_plan(load_profile(args.profile), args.hardware, args.context, args.batch_size, args.mtp, args.accept,
                     args.sparse_ratio, args.model, args.ep, args.tbo, measured)
    measured_notes(measured)
    if args.out:
        with open(output(args.out), "w") as f:
            json.dump(plan, f)
    table = Table(title=f"layer plan: {plan['counts']} (ratio {plan['sparse_ratio']:.3f}); predicted {plan['predicted']}")
    for c in ("layer", "mode", "mean misses", "exposed us"):
        table.add_column(c, justify="right")
    for i, m in enumerate(plan["modes"]):
        table.add_row(str(i), m, str(plan["mean_misses"][i]), str(plan["exposed_transfer_us"][i]))
    emit(args, plan, table)
    return 0
