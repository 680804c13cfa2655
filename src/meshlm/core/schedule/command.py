"""`meshlm schedule`: build, check, simulate and draw a pipeline schedule.

Lets a user pick pp / micro-batches / schedule from numbers before paying for
GPUs. The main CLI wires it in with `add_parser(subparsers)` and dispatches
to `run(args)`; ``python -m meshlm.core.schedule.command`` also works.
"""
from __future__ import annotations

import argparse
import json
import sys

from .check import check_schedule
from .draw import render_png, render_text
from .schedules import SCHEDULES, TAKES_VIRTUAL, V_SHAPED, build_schedule
from .simulate import P2P_MODES, action_costs, simulate, textbook_bubble


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--virtual", "-v", type=int, default=None,
                   help="chunks per rank (interleaved: default 2; zbv: always 2; 1 elsewhere)")
    p.add_argument("--cost-f", type=float, default=1.0, help="forward time per micro-batch per rank")
    p.add_argument("--cost-b", type=float, default=2.0, help="full backward time (I + W)")
    p.add_argument("--cost-w", type=float, default=None, help="weight-grad part of the backward (default B/2)")
    p.add_argument("--cost-comm", type=float, default=0.0, help="p2p latency (default 0)")
    p.add_argument("--p2p", default="free", choices=P2P_MODES,
                   help="free: p2p only carries data; blocking: wait on every batch (rendezvous)")
    p.add_argument("--width", type=int, default=None, help="fit the text timeline into this many columns")
    p.add_argument("--png", default=None, help="also write the timeline as a PNG here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `schedule` on an argparse subparsers object."""
    p = subparsers.add_parser("schedule", help="simulate a pipeline schedule: timeline, bubble, peak memory",
                              description=__doc__.splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _report(args) -> dict:
    name = args.schedule
    v = args.virtual if args.virtual is not None else (2 if name in TAKES_VIRTUAL else 1)
    p, m = args.pp, args.microbatches
    costs = action_costs(v, args.cost_f, args.cost_b, args.cost_w)
    vs = name in V_SHAPED
    actions = build_schedule(name, p, m, v, costs=costs)
    stats = check_schedule(actions, p, m, v, vs)
    tl = simulate(actions, p, m, v, cost_f=args.cost_f, cost_b=args.cost_b, cost_w=args.cost_w,
                  cost_comm=args.cost_comm, p2p=args.p2p, name=name, vshape=vs)
    return {
        "schedule": name, "pp": p, "microbatches": m, "virtual": v,
        "bubble": tl.bubble,
        "textbook_bubble": textbook_bubble(name, p, m, v, args.cost_f, args.cost_b, args.cost_w),
        "makespan": tl.makespan,
        "peak_inflight": tl.peak_inflight,
        "peak_activations": stats["peak_activations"],
        "busy": tl.busy,
        "costs": tl.costs,
        "p2p_batches": stats["p2p_batches"],
        "_timeline": tl,
    }


def run(args) -> int:
    """Execute `meshlm schedule`; 0 on success, 2 on bad input (one line on stderr)."""
    try:
        rep = _report(args)
    except ValueError as e:  # ScheduleError is a ValueError too
        print(f"meshlm schedule: error: {e}", file=sys.stderr)
        return 2
    tl = rep.pop("_timeline")
    if args.png:
        try:
            render_png(tl, args.png)
        except OSError as e:
            print(f"meshlm schedule: error: cannot write {args.png}: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(rep))
        return 0
    print(render_text(tl, width=args.width))
    print(f"textbook bubble {rep['textbook_bubble']:.1%}  ({_formula(rep)})")
    print(f"peak activations per rank (micro-batches of the rank's layers): {rep['peak_activations']}")
    if args.png:
        print(f"wrote {args.png}")
    return 0


def _formula(rep: dict) -> str:
    name = rep["schedule"]
    if name in ("gpipe", "1f1b"):
        return "(p-1)/(m+p-1)"
    if name == "interleaved":
        return "(p-1)/(v*m+p-1)"
    if name == "zbv":
        return "ZB-H1's formula at half-size chunks: idle (p-1)*(F+I-W)/2 per rank"
    return "idle (p-1)*(F+I-W) per rank, Qi et al. ZB-H1"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="meshlm schedule", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
