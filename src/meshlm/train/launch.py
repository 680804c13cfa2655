"""Starting workers: in-process for one rank, `torch.distributed.run` for --nproc N, or joining an
outside torchrun / Slurm job (RANK / WORLD_SIZE / MASTER_ADDR already in the environment)."""
from __future__ import annotations

import os
import subprocess
import sys

SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def under_launcher() -> bool:
    """True when this process is one rank of a job somebody else started."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # srun started one task per GPU: translate Slurm's variables to torch's.
        for src, dst in SLURM_TO_TORCH.items():
            os.environ.setdefault(dst, os.environ[src])
        os.environ.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("Slurm: set MASTER_ADDR to the first node's hostname in the batch script")
        return True
    return False


def spawn(nproc: int, config_path: str, run_dir: str, max_restarts: int = 0) -> int:
    """Run `meshlm train` on `nproc` local workers through torchrun; returns its exit status.
    `max_restarts`: torchrun's elastic agent restarts all workers up to that many times after one fails
    (each restart resumes from the newest complete checkpoint, see train/fault.py)."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    for old in os.listdir(logs):  # one-line errors of a previous launch would be misleading
        if old.startswith(ERROR_PREFIX):
            os.remove(os.path.join(logs, old))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", f"--log-dir={logs}", "--redirects=2", "--tee=2",
           "-m", "meshlm.cli", "train", "--config", config_path, "--run-dir", run_dir, "--worker"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    return subprocess.call(cmd, env=env)


ERROR_PREFIX = "error_rank"


def record_error(run_dir: str, rank: int, line: str) -> None:
    """A failing worker leaves its one-line reason where the launcher will look for it."""
    try:
        with open(os.path.join(run_dir, "logs", f"{ERROR_PREFIX}{rank}.txt"), "w") as f:
            f.write(line + "\n")
    except OSError:
        pass  # the log on stderr still has it


def worker_errors(run_dir: str) -> list[str]:
    """The failing ranks' one-line errors of the last attempt, by rank."""
    logs = os.path.join(run_dir, "logs")
    found = []
    for name in os.listdir(logs) if os.path.isdir(logs) else []:
        if name.startswith(ERROR_PREFIX) and name.endswith(".txt"):
            with open(os.path.join(logs, name)) as f:
                found.append((int(name[len(ERROR_PREFIX):-4]), f.read().strip()))
    return [line for _, line in sorted(found)]


def incidents(run_dir: str) -> list[str]:
    """One line per straggler named, spike and restart in RUN_DIR/metrics.jsonl (the launcher prints
    them when the job ends; docs/fault_tolerance.md)."""
    import json
    path, out, slow = os.path.join(run_dir, "metrics.jsonl"), [], {}
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            for s in rec.get("stragglers", []):
                first, _ = slow.get(s["rank"], (rec["step"], s))
                slow[s["rank"]] = (first, s)
            if "spike" in rec:
                sp = rec["spike"]
                what = (f"rolled back to step {rec['rollback_to']}, skipped global batches "
                        f"{rec['skipped_batches'][0]}..{rec['skipped_batches'][1]}") if "rollback_to" in rec \
                    else "update skipped"
                out.append(f"meshlm: spike at step {sp['step']}: {sp['on']} {sp['value']:.4g} "
                           f"(window mean {sp['mean']:.4g}, std {sp['std']:.3g}): {what}")
            if "restart" in rec:
                out.append(f"meshlm: restart {rec['restart']}: resumed from step {rec['resumed_from']}"
                           + (f", world {rec['old_world']} -> {rec['world']} ranks, layout {rec['old_layout']} -> {rec['layout']}"
                              if rec.get("resized") else ""))
    for rank, (first, s) in sorted(slow.items()):
        out.append(f"meshlm: straggler: rank {rank} from step {first}: busy {s['ratio']:.1f}x the others' median "
                   f"(compute {s['compute_s'] * 1e3:.0f} ms, data {s['data_s'] * 1e3:.0f} ms, "
                   f"blocked in collectives {s['comm_s'] * 1e3:.0f} ms per step)")
    return out
