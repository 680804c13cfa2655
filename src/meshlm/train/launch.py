"""Starting workers: in-process for one rank, `torch.distributed.run` for --nproc N, or joining an
outside torchrun / Slurm job (RANK / WORLD_SIZE / MASTER_ADDR already in the environment)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import deque

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
    (each restart resumes from the newest complete checkpoint, see train/resilience/fault.py)."""
    logs = fresh_logs(run_dir)
    cmd, env = torchrun(nproc, max_restarts, logs, config_path, run_dir)
    # torchrun's output passes through (the workers' stderr is teed into it); its last lines name
    # each failed rank's exit code, which is all that tells which rank ended how.
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    tail: deque[str] = deque(maxlen=400)
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line)
    code = proc.wait()
    stopped = preempted(run_dir)
    if len(stopped) == nproc:  # every rank saved and stopped on checkpoint.on_signal (and exited 0)
        from .resilience.preempt import exit_status, message
        name, step, saved = stopped[0]
        print(f"meshlm: {message(name, step, saved)}", file=sys.stderr)
        return exit_status(name)
    if code and len(done_ranks(run_dir)) == nproc:
        for line in after_done(exit_codes("".join(tail)), code):
            print(line, file=sys.stderr)
        return 0
    return code


def fresh_logs(run_dir: str) -> str:
    """RUN_DIR/logs, without the one-line errors and outcomes of a previous launch (they would mislead)."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    for old in os.listdir(logs):
        if old.startswith((ERROR_PREFIX, DONE_PREFIX, PREEMPTED_PREFIX)):
            os.remove(os.path.join(logs, old))
    return logs


def torchrun(nproc: int, max_restarts: int, logs: str, config_path: str, run_dir: str,
             threads_of: int | None = None) -> tuple[list[str], dict]:
    """The command and environment of one torchrun of `nproc` meshlm workers (`threads_of`: the local
    workers the cores are shared by, default nproc)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", f"--log-dir={logs}", "--redirects=2", "--tee=2",
           "-m", "meshlm.cli", "train", "--config", config_path, "--run-dir", run_dir, "--worker"]
    share = threads_of or nproc
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // share))))
    return cmd, env


ERROR_PREFIX = "error_rank"
DONE_PREFIX = "done_rank"
PREEMPTED_PREFIX = "preempted_rank"


def teardown(ctx, finished: bool, since: set[int] | None = None) -> None:
    """A worker's last act (distributed/mesh.py `shutdown`); a thread started since `since` that
    outlives it is named on stderr (the rank's log): it may end the process abnormally at exit."""
    from ..distributed.mesh import shutdown
    rank = ctx.rank if ctx is not None else int(os.environ.get("RANK", "0"))
    left = shutdown(ctx, finished, since)
    if left:
        print(f"meshlm: rank {rank}: threads alive after the teardown: {', '.join(left)}", file=sys.stderr,
              flush=True)


def record_done(run_dir: str, rank: int, last: dict) -> None:
    """A worker whose run finished says so before its teardown; the launcher reads it when the worker
    process still ends abnormally (`after_done`). Only under meshlm's launcher (it made RUN_DIR/logs)."""
    logs = os.path.join(run_dir, "logs")
    if os.path.isdir(logs):
        with open(os.path.join(logs, f"{DONE_PREFIX}{rank}.txt"), "w") as f:
            f.write(f"step {last.get('step')} loss {last.get('loss', float('nan')):.6g}\n")


def record_preempted(run_dir: str, rank: int, how: dict) -> None:
    """A worker that saved and stopped on a signal (train/resilience/preempt.py) says so for the launcher, whose
    torchrun reports only that the workers failed. Only under meshlm's launcher, as `record_done`."""
    logs = os.path.join(run_dir, "logs")
    if os.path.isdir(logs):
        with open(os.path.join(logs, f"{PREEMPTED_PREFIX}{rank}.txt"), "w") as f:
            f.write(f"{how['signal']} {how['step']} {int(how['saved'])}\n")


def preempted(run_dir: str) -> list[tuple[str, int, bool]]:
    """(signal, step, saved) of every rank that recorded a preemption in this launch."""
    logs = os.path.join(run_dir, "logs")
    out = []
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if name.startswith(PREEMPTED_PREFIX) and name.endswith(".txt"):
            with open(os.path.join(logs, name)) as f:
                sig, step, saved = f.read().split()
            out.append((sig, int(step), saved == "1"))
    return out


def done_ranks(run_dir: str) -> list[int]:
    logs = os.path.join(run_dir, "logs")
    names = os.listdir(logs) if os.path.isdir(logs) else []
    return sorted(int(n[len(DONE_PREFIX):-4]) for n in names if n.startswith(DONE_PREFIX) and n.endswith(".txt"))


def exit_codes(agent_output: str) -> dict[int, int]:
    """rank -> exit code of every failed worker in torchrun's failure summary
    (`rank : 1 (local_rank: 1)` then `exitcode : -6 (pid: …)`)."""
    found = re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", agent_output)
    return {int(r): int(c) for r, c in found}


def after_done(codes: dict[int, int], code: int) -> list[str]:
    """The launcher's lines for a job whose every rank finished its run and wrote so, but whose
    torchrun still failed (a worker ended abnormally after that): the run is complete, exit 0."""
    if not codes:
        return [f"meshlm: torchrun exited {code} after every rank finished its run; the run is complete"]
    out = []
    for rank, c in sorted(codes.items()):
        how = f"signal {signal.Signals(-c).name}" if c < 0 and -c in signal.valid_signals() else f"exit {c}"
        out.append(f"meshlm: rank {rank} ended with {how} after its run finished "
                   f"(logs/{DONE_PREFIX}{rank}.txt); the run is complete")
    return out


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
