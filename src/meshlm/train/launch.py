"""Starting workers: in-process for one rank, torchrun's elastic agent (run in the launcher's own
process) for --nproc N, or joining an outside torchrun / Slurm job (RANK / WORLD_SIZE / MASTER_ADDR
already in the environment)."""
from __future__ import annotations

import os
import signal
import sys
import traceback

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
    """Run `meshlm train` on `nproc` local workers under torchrun's elastic agent; returns its exit status.
    `max_restarts`: the agent restarts all workers up to that many times after one fails (each restart
    resumes from the newest complete checkpoint, see train/resilience/fault.py)."""
    logs = fresh_logs(run_dir)
    code, codes = run_agent(*torchrun_args(nproc, max_restarts, logs, config_path, run_dir))
    stopped = preempted(run_dir)
    if len(stopped) == nproc:  # every rank saved and stopped on checkpoint.on_signal (and exited 0)
        from .resilience.preempt import exit_status, message
        name, step, saved = stopped[0]
        print(f"meshlm: {message(name, step, saved)}", file=sys.stderr)
        return exit_status(name)
    if code and len(done_ranks(run_dir)) == nproc:
        for line in after_done(codes, code):
            print(line, file=sys.stderr)
        return 0
    return code


def run_agent(args: list[str], env: dict) -> tuple[int, dict[int, int]]:
    """torchrun's elastic agent in this process: what `python -m torch.distributed.run ARGS` runs,
    without a second interpreter importing torch (1.3 CPU-s and about a second per launch). The workers'
    stderr is teed onto ours (--tee). Returns (torchrun's exit status, rank -> exit code of each worker
    that failed); a signal that stops the agent (it passes it on to the workers first) is 128 + signum."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    saved = dict(os.environ)
    os.environ.update(env)  # the workers inherit the agent's environment
    try:
        run(parse_args(args))
        return 0, {}
    except ChildFailedError as e:  # torchrun's failure summary, as its own process would print it
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1, {rank: f.exitcode for rank, f in e.failures.items()}
    except SignalException as e:
        return 128 + int(e.sigval), {}
    except Exception:  # noqa: BLE001 - the agent itself failed (rendezvous, ports): its traceback, exit 1
        traceback.print_exc()
        return 1, {}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for s, h in handlers.items():  # the agent's handlers raise SignalException: not after it ended
            signal.signal(s, h)


def fresh_logs(run_dir: str) -> str:
    """RUN_DIR/logs, without the one-line errors and outcomes of a previous launch (they would mislead)."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    for old in os.listdir(logs):
        if old.startswith((ERROR_PREFIX, DONE_PREFIX, PREEMPTED_PREFIX)):
            os.remove(os.path.join(logs, old))
    return logs


def torchrun_args(nproc: int, max_restarts: int, logs: str, config_path: str, run_dir: str,
                  threads_of: int | None = None) -> tuple[list[str], dict]:
    """torchrun's arguments and the environment of one launch of `nproc` meshlm workers (`threads_of`:
    the local workers the cores are shared by, default nproc)."""
    args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", f"--log-dir={logs}",
            "--redirects=2", "--tee=2", "-m", "meshlm.cli", "train", "--config", config_path, "--run-dir", run_dir,
            "--worker"]
    share = threads_of or nproc
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // share))))
    return args, env


def torchrun(nproc: int, max_restarts: int, logs: str, config_path: str, run_dir: str,
             threads_of: int | None = None) -> tuple[list[str], dict]:
    """The command and environment of one torchrun as a process of its own (island jobs run several)."""
    args, env = torchrun_args(nproc, max_restarts, logs, config_path, run_dir, threads_of)
    return [sys.executable, "-m", "torch.distributed.run", *args], env


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
