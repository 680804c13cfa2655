"""Multi-rank CUDA paths on one GPU (issue 47's `multirank` piece): `meshlm train --nproc 2` with both
workers on the one device (mesh.ranks_share_gpus: gloo through host memory, since NCCL refuses two ranks
on one device), for dp2 ZeRO-3, tp2 + SP and pp2 (1F1B), each against one process on the same GPU:
fp32 per-step losses within 1e-5 relative, bf16 within 1%. Then the preemption flag, which on CUDA is
read one step late (train/resilience/preempt.py): rank 1 sends itself SIGTERM in step 3 of a dp2 run; the run
must exit 143 having saved the step it stopped at, 4 on CUDA and 3 on a CPU.
On a CPU (`--device cpu`) the same runs are the suite's gloo paths: plumbing for the script.

    python bench/multirank.py --out multirank.json [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ledger  # noqa: E402

from meshlm.train.checkpoint import list_checkpoints  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"model.preset": "debug", "data.seq_len": 64, "training.global_batch": 8, "training.micro_batch": 2,
        "training.steps": 6, "training.eval_every": 0, "training.seed": 1, "optim.warmup": 2, "optim.lr": 3e-3,
        "training.compile": False, "metrics.progress": False, "checkpoint.resume": "never", "checkpoint.every": 0}
LAYOUTS = {"dp2-zero3": {"parallel.dp": 2, "parallel.zero": 3}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
           "pp2": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def train(run_dir: str, nproc: int, values: dict, env: dict | None = None, timeout: float = 240) -> tuple[int, str]:
    args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
    cmd = [sys.executable, "-m", "meshlm.cli", "train", "--run-dir", run_dir, *(["--nproc", str(nproc)] if nproc > 1
                                                                               else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stderr


def records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compare(ref: list[dict], got: list[dict], tol: float) -> dict:
    a = [r["loss"] for r in ref if "loss" in r]
    b = [r["loss"] for r in got if "loss" in r]
    worst = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("inf"))
    return {"steps": len(b), "worst_rel": worst, "tolerance": tol, "ok": len(a) == len(b) > 0 and worst <= tol}


def preemption(root: str, device: str) -> dict:
    """dp2 with SIGTERM to rank 1 in step 3 (tests/fault_plugin.py's hook): exit 143, the stop step saved."""
    run = os.path.join(root, "preempt")
    tests = os.path.join(ROOT, "tests")
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), tests]), "MESHLM_PLUGINS": "fault_plugin",
           "MESHLM_TEST_SIGNAL": "1:3:SIGTERM"}
    code, err = train(run, 2, {**BASE, "training.device": device, "training.precision": "fp32",
                               "training.steps": 8, "parallel.dp": 2}, env)
    stops = [r for r in records(run) if "preempted" in r] if os.path.exists(os.path.join(run, "metrics.jsonl")) else []
    saved = [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))]
    want = 4 if device == "cuda" else 3
    step = stops[0]["step"] if stops else None
    return {"exit": code, "stopped_at": step, "expected": want, "checkpoints": saved,
            "ok": code == 143 and step == want and saved == [want],
            "last_line": next((x for x in reversed(err.splitlines()) if x.startswith("meshlm: ")), "")}


def layouts(root: str, prec: str, a, report: dict, save) -> None:
    """One process, then each two-rank layout against it, in `prec`."""
    values = {**BASE, "training.device": a.device, "training.precision": prec}
    code, err = train(os.path.join(root, f"one-{prec}"), 1, values)
    if code:
        report["rows"].append({"layout": "one", "precision": prec, "ok": False, "error": err.strip()[-300:]})
        save()
        return
    ref = records(os.path.join(root, f"one-{prec}"))
    for name in a.layouts:
        layout = LAYOUTS[name]
        run = os.path.join(root, f"{name}-{prec}")
        code, err = train(run, 2, {**values, **layout})
        row = {"layout": name, "precision": prec, "exit": code}
        row.update(compare(ref, records(run), TOLERANCE[prec]) if code == 0 else
                   {"ok": False, "error": (err.strip().splitlines() or [""])[-1][:300]})
        row["shared_gpu"] = "sharing" in err
        report["rows"].append(row)
        save()
        print(f"{name} {prec}: {'ok' if row['ok'] else 'FAILED'} "
              + (f"(worst {row['worst_rel']:.2e} over {row['steps']} steps)" if "worst_rel" in row else
                 row.get("error", "")), flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"some of {', '.join(LAYOUTS)}")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    a.layouts = [x for x in a.layouts.split(",") if x]
    if bad := [x for x in a.layouts if x not in LAYOUTS]:
        p.exit(2, f"bench/multirank.py: --layouts: unknown {bad[0]!r} (known: {', '.join(LAYOUTS)})\n")
    report = {"env": ledger.environment(a.device), "rows": [], "preemption": None}
    root = tempfile.mkdtemp(prefix="meshlm-multirank-")

    def save():
        if a.out:
            ledger.write_json(a.out, report)
    for i, prec in enumerate(x for x in a.precisions.split(",") if x):
        layouts(root, prec, a, report, save)
        if i == 0:  # before the second precision: a run cut off by its timeout keeps this row
            report["preemption"] = preemption(root, a.device)
            save()
            print("preemption:", json.dumps(report["preemption"]), flush=True)
    return report


if __name__ == "__main__":
    main()
