"""When the loop checkpoints and what goes with a save: the cadence (fault.Cadence), the non-finite
check before any save (a bad state is never saved), the step's metrics line in meta.json, the lines
of saves that finished in the background, and checkpoint.export_hf, which streams a saved step."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from .. import checkpoint as ckpt
from ..observe.metrics import MetricsLog
from . import preempt
from .energy_pause import EnergyPause
from .fault import Cadence, FiniteGuard, NonFiniteError

if TYPE_CHECKING:
    from ..state import TrainState


class Saving:
    def __init__(self, cfg, checkpointer: ckpt.Checkpointer, guard: FiniteGuard, cadence: Cadence,
                 log: MetricsLog, world, run_dir: str):
        self.cfg, self.checkpointer, self.guard, self.cadence = cfg, checkpointer, guard, cadence
        self.log, self.world, self.run_dir = log, world, run_dir
        t = cfg.training  # training.energy.trace: pauses outside the cheapest windows (energy_pause.py)
        self.energy = EnergyPause(t.energy, t.steps, cadence.start, world, log, run_dir) if t.energy.trace else None

    def resume_pause(self, state: "TrainState") -> None:
        """Before the first step: a run killed while paused for energy waits out that pause."""
        if self.energy is not None:
            self.energy.resume_pause(state.step)

    def after_step(self, state: "TrainState", rec: dict | None) -> bool:
        """Save `state` when the cadence or an export asks; `rec`: the step's metrics line (logged
        steps), which gets the save's `ckpt` report and goes into meta.json too: it is written after
        the save, and a resume from this checkpoint puts it back if a crash lost it (fault.py).
        Returns whether the step exports (`export`, after its line is written). Outside the cheapest
        windows of training.energy.trace the step is saved and the run pauses here (energy_pause.py)."""
        exporting = self.save_if_due(state, rec)
        resume_at = self.energy.after_step(state.step, rec) if self.energy is not None else 0.0
        if resume_at > 0:  # the Unix time the chosen window starts
            self.energy.pause(state.step, resume_at, self.save_now(state, rec))
        return exporting

    def save_if_due(self, state: "TrainState", rec: dict | None) -> bool:
        step, last = state.step, state.step == self.cfg.training.steps
        due = self.cadence.due(step, last)
        every = self.cfg.checkpoint.export_hf  # "end": on the last step; N: every N steps and on the last
        exporting = every == "end" and last or not isinstance(every, str) and (step % every == 0 or last)
        if rec is not None or due or exporting:  # read the non-finite record
            self.check_finite(state, rec)
        if not (due or exporting):
            return False
        ck = state.save(self.checkpointer, {"metrics": dict(rec)} if rec is not None else None)
        if self.cfg.checkpoint.async_:
            ck["async"] = True
        if "error" not in ck:
            self.cadence.saved(step, ck["save_s"])
        for done in self.log_done(but=step):  # a synchronous save has just finished (or failed)
            ck.update({k: v for k, v in done.items() if k != "step"})
        if rec is None:
            self.log.write({"step": step, "ckpt": ck})
        else:
            rec["ckpt"] = ck
        return exporting

    def save_now(self, state: "TrainState", rec: dict | None) -> dict:
        """A checkpoint of this step, committed before returning (the process ends next: preemption);
        the step's own save if the cadence already made one. What the save reports."""
        ck: dict = {"step": state.step}
        if state.saved_step != state.step:
            self.check_finite(state, rec)
            ck = state.save(self.checkpointer, {"metrics": dict(rec)} if rec is not None else None)
        self.checkpointer.wait()
        for done in self.log_done(but=state.step):
            ck.update({k: v for k, v in done.items() if k != "step"})
        return ck

    def preempted(self, state: "TrainState", rec: dict | None, signal: str) -> dict:
        """Save this step on `signal` (train/resilience/preempt.py), committed, and say so; what `run` records."""
        ck = self.save_now(state, rec)
        saved = "error" not in ck
        self.log.write({"step": state.step, "preempted": signal, "ckpt": ck})
        self.log.message(preempt.message(signal, state.step, saved))
        return {"signal": signal, "step": state.step, "saved": saved}

    def check_finite(self, state: "TrainState", rec: dict | None) -> None:
        """Stop on a non-finite loss or grad norm (train/resilience/fault.py); the step's metrics line is still
        written and a checkpoint still being written (async, checked before it was taken) is committed."""
        try:
            self.guard.check(state.saved_step)
        except NonFiniteError:
            if rec is not None:
                self.log.write(rec)
            self.checkpointer.wait()
            raise

    def log_done(self, but: int | None = None) -> list[dict]:
        """Log the checkpoints committed since the last call (rank 0 measured their bytes); the one of
        step `but` is returned instead (its save's own line reports it)."""
        done, self.checkpointer.done = self.checkpointer.done, []
        for d in done:
            if d["step"] != but:
                self.log.write({"step": d["step"], "ckpt": d})
        return [d for d in done if d["step"] == but]

    def finish(self) -> None:
        """The last background write, committed and logged; the energy of the last windows trained in."""
        self.checkpointer.close()
        self.log_done()
        if self.energy is not None:
            self.energy.flush()

    def export(self, step: int) -> None:
        """RUN_DIR/hf/step_N, a transformers directory, from the checkpoint of `step` just written: rank 0
        streams it one tensor at a time (convert.to_hf), so no rank ever holds more than one full
        tensor and the layout's shards are never gathered. A directory already there (a resumed run
        exporting the same step again) is kept. Every rank learns whether it worked."""
        from ..convert import to_hf
        self.checkpointer.wait()  # async: the checkpoint is committed
        out = os.path.join(self.run_dir, "hf", f"step_{step:08d}")
        failed, t0 = 0.0, time.perf_counter()
        if self.world.rank == 0 and not os.path.isdir(out):
            try:
                os.makedirs(os.path.dirname(out), exist_ok=True)
                to_hf(os.path.join(self.checkpointer.root, f"step_{step:08d}"), out, self.cfg.checkpoint.export_dtype)
            except (ValueError, OSError, ckpt.CheckpointError) as e:
                failed, error = 1.0, e
        if self.world.all_reduce_scalars([failed])[0]:
            line = f"checkpoint.export_hf: step {step}: {error if self.world.rank == 0 else 'failed on rank 0'}"
            if self.cfg.checkpoint.on_error == "continue":  # the next due export tries again
                self.log.write({"step": step, "export_error": line})
                self.log.message(f"{line}; training goes on (checkpoint.on_error = continue)")
                return
            raise RuntimeError(line) from (error if self.world.rank == 0 else None)
        self.log.message(f"step {step}: exported {out} ({time.perf_counter() - t0:.1f} s)")
