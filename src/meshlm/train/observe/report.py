"""`meshlm report RUN_DIR`: loss, throughput and memory curves of a run in one PNG, and with pp > 1
the measured pipeline timeline of one step in pipeline.png."""
from __future__ import annotations

import json
import os

from ...core.facts.energy import kwh


def read_records(run_dir: str) -> tuple[list[dict], list[dict]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"report: no metrics.jsonl in {run_dir}")
    steps, evals = [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            (steps if "loss" in rec else evals).append(rec)
    if not steps:
        raise ValueError(f"report: {path} has no logged steps yet")
    return steps, evals


def write_report(run_dir: str, out: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_records(run_dir)
    out = out or os.path.join(run_dir, "report.png")
    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(x, [r["loss"] for r in steps], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    axes[0].set(title="loss", xlabel="step")
    axes[0].legend()
    axes[1].plot(x, [r["tokens_per_s"] for r in steps])
    mfu = [100 * r["mfu"] for r in steps]
    axes[1].set(title=f"tokens/s (last MFU {mfu[-1]:.1f}%)", xlabel="step")
    mib = 2.0 ** 20
    for key in ("params", "grads", "optim", "peak"):
        axes[2].plot(x, [r["mem"][key] / mib for r in steps], label=key)
    axes[2].set(title="memory, rank 0 (MiB)", xlabel="step", yscale="log")
    axes[2].legend()
    used = kwh(steps)  # measured where the counters were readable (docs/energy.md, "Measured energy")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir))
                 + (f": {used:.4g} kWh measured" if used is not None else ": energy not measured"))
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    write_pipeline_png(run_dir)
    return out


def write_pipeline_png(run_dir: str) -> str | None:
    """The measured pipeline timeline (pipeline_trace.json, written when pp > 1) as pipeline.png
    next to the report; None when the run has no trace."""
    trace = os.path.join(run_dir, "pipeline_trace.json")
    if not os.path.isfile(trace):
        return None
    from ...core.schedule.trace import load_timeline
    from ...core.schedule.draw import render_png

    timeline, blocked = load_timeline(trace)
    timeline.name += "; ms blocked in p2p per rank: " + ", ".join(f"{b:.0f}" for b in blocked)
    out = os.path.join(run_dir, "pipeline.png")
    render_png(timeline, out)
    return out
