"""Surviving failures: restarts under torch's elastic agent, the checkpoint cadence (Young/Daly), and
stopping on a non-finite loss or gradient norm without ever checkpointing the bad state.

- **Restarts** (`meshlm train --max-restarts R`): torchrun's agent restarts every worker when one dies;
  a restarted worker (the job's restart count > 0: the largest of the agents' TORCHELASTIC_RESTART_COUNT,
  agreed by every rank at start-up, distributed/mesh.py `join_world`) resumes from the newest complete
  checkpoint of its run directory, whatever `checkpoint.resume` said, and rank 0 writes a `restart` line to
  metrics.jsonl. Lines of steps after the resumed one are dropped first: those steps run again with
  the same losses, so no step is ever logged twice. A saving step's line is written after its save
  (it carries the save's `ckpt` timings) and also kept in the checkpoint's meta.json, so a crash
  between the two does not lose it: the resume puts it back (without `ckpt`).
- **Cadence** (`checkpoint.every = "auto"`): the first checkpoint is written after AUTO_FIRST steps and
  timed; the interval is then √(2 · cost · MTBF) (Young 1974, Daly 2006) in steps of the measured
  step time, agreed by every rank, and logged.
- **Non-finite** values: a device-side record of the first step whose loss (every precision) or
  gradient norm (fp32/bf16; fp16's loss scaler skips those steps itself) was NaN/Inf. It costs a few
  tiny kernels per step and no host sync; it is read on logged steps and before every checkpoint save,
  so a bad state is never saved and the run stops within `metrics.every` steps, naming the step.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import torch

from ...distributed.watchdog import Watchdog, exit_silent

AUTO_FIRST = 5  # steps before the first, timed, checkpoint of checkpoint.every = "auto"
NONE = 2 ** 62  # "no bad step yet" in the device-side record


def resize_record(meta: dict, layout: dict, accum: int) -> dict:
    """What a restart line says about the world: the checkpoint's and this run's size and layout
    (an elastic resize changes them; the global batch stays, the accumulation count makes up)."""
    old = meta.get("layout") or {}
    out = {"old_world": math.prod(old.values()) if old else None, "world": math.prod(layout.values()),
           "old_layout": old, "layout": dict(layout), "old_accum": meta.get("accum"), "accum": accum}
    out["resized"] = out["old_world"] is not None and out["old_world"] != out["world"]
    return out


def on_start(run_dir: str, step: int, is_logger: bool, restarts: int, record: dict | None = None,
             resize: dict | None = None) -> None:
    """Before metrics are appended: drop lines of steps that will run again; put back the resumed
    step's line (`record`, from its checkpoint) if a crash after the save lost it; note a restart
    (the job's agreed count `restarts`, with the old and new world and layout, `resize`)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    restarted = restarts > 0
    if not is_logger or not (restarted or step > 0) or not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    if record is not None and not any('"loss"' in line and json.loads(line).get("step") == step for line in lines):
        lines.append(json.dumps(record) + "\n")
    if restarted:
        lines.append(json.dumps({"step": step, "restart": restarts, "resumed_from": step, **(resize or {})})
                     + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(lines)
    os.replace(tmp, path)


def watch(ctx, heartbeat_s: float, record: Callable[[int, str], None]) -> Watchdog | None:
    """The job's watchdog (distributed/watchdog.py) on every group of `ctx`, None when off. On a silent
    rank it leaves its line for the launcher (`record(rank, line)`: train/launch.py's record_error,
    passed in so that this module stays below the launcher) and exits this process."""
    def peer_lost(line: str) -> None:
        record(ctx.rank, f"meshlm: {line}")
        exit_silent(line)
    watchdog = Watchdog.for_job(ctx.job_rank, ctx.job_world, heartbeat_s, peer_lost)
    for c in ctx.all_comms():
        c.watchdog = watchdog
    return watchdog


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stopped being finite; the message is one line naming the step."""


class FiniteGuard:
    def __init__(self, precision: str, device: torch.device, world, run_dir: str, restarts: int = 0):
        self.check_norm = precision != "fp16"
        self.world, self.run_dir, self.restarts = world, run_dir, restarts  # restarts: the job's agreed count
        self.first = torch.full((2,), NONE, dtype=torch.int64, device=device)  # loss, grad norm
        self.marker = os.path.join(run_dir, "nonfinite.json")
        if restarts == 0 and world.rank == 0 and os.path.exists(self.marker):
            os.remove(self.marker)  # a new launch (maybe with a smaller lr) tries again

    def replay(self) -> None:
        """A restart after a non-finite stop would only meet the same step again: stop at once."""
        if self.restarts > 0 and os.path.isfile(self.marker):
            with open(self.marker) as f:
                raise NonFiniteError(json.load(f)["message"])

    def observe(self, step: int, loss_sum: torch.Tensor, norm: torch.Tensor) -> None:
        """Device ops only (no host read): remember the first step with a non-finite value."""
        bad = torch.stack([~torch.isfinite(loss_sum), ~torch.isfinite(norm) & self.check_norm])
        torch.minimum(self.first, torch.where(bad, step, NONE), out=self.first)

    def check(self, newest_checkpoint: int | None) -> None:
        """Read the record (every rank agrees on it); raise NonFiniteError when a step went bad."""
        loss_step, norm_step = (int(x) for x in self.world.all_reduce_scalars(
            [float(x) for x in self.first.tolist()], op=torch.distributed.ReduceOp.MIN))
        if min(loss_step, norm_step) >= NONE:
            return
        what = "loss" if loss_step <= norm_step else "gradient norm"
        ck = f"step {newest_checkpoint}" if newest_checkpoint else "none"
        msg = (f"non-finite {what} at step {min(loss_step, norm_step)}: stopped "
               f"(newest checkpoint: {ck}; lower optim.lr or check the data, then run again)")
        if self.world.rank == 0:
            with open(self.marker, "w") as f:
                json.dump({"step": min(loss_step, norm_step), "message": msg}, f)
        raise NonFiniteError(msg)


class Cadence:
    """When to checkpoint: every N steps, or `auto` from the measured cost and checkpoint.mtbf_hours."""

    def __init__(self, every: int | str, mtbf_hours: float, start_step: int, world, log):
        self.auto = every == "auto"
        self.interval = None if self.auto else int(every)
        self.mtbf_s, self.world, self.log = mtbf_hours * 3600.0, world, log
        self.first = start_step + AUTO_FIRST
        self.start, self.t_first_step = start_step, None

    def due(self, step: int, last: bool) -> bool:
        if not self.auto:
            return bool(self.interval) and step % self.interval == 0
        if step == self.start + 1:
            self.t_first_step = time.perf_counter()  # later steps' time, without the first's warm-up
        if self.interval is None:
            return step == self.first or (last and step < self.first)
        return (step - self.first) % self.interval == 0

    def saved(self, step: int, cost_s: float) -> None:
        """Right after a save that blocked training for `cost_s` (Checkpointer.save's `save_s`: the
        whole write when sync, the host snapshot when async): fix the auto interval (once), the same
        on every rank, and log it."""
        if not self.auto or self.interval is not None:
            return
        steps_timed = step - self.start - 1
        t_save_start = time.perf_counter() - cost_s
        step_s = (t_save_start - self.t_first_step) / steps_timed if steps_timed > 0 else float("nan")
        best_s = math.sqrt(2.0 * cost_s * self.mtbf_s)
        local = max(1, round(best_s / step_s)) if step_s > 0 and math.isfinite(step_s) else 1
        self.interval = int(self.world.all_reduce_scalars([float(local)], op=torch.distributed.ReduceOp.MAX)[0])
        rec = {"step": step, "checkpoint_every": self.interval, "checkpoint_cost_s": cost_s,
               "step_s": step_s, "mtbf_hours": self.mtbf_s / 3600.0, "young_daly_s": best_s}
        self.log.write(rec)
        self.log.message(f"checkpoint.every = auto: a save takes {cost_s:.2f} s, MTBF {self.mtbf_s / 3600:.3g} h "
                         f"-> every {best_s:.0f} s = {self.interval} steps of {step_s:.3f} s")
