"""Training in the cheap hours (`training.energy.trace`, docs/energy.md "Scheduling in time"): the run
plans, from its measured step time, the cheapest spans of the trace that still finish by the deadline
(core/facts/energy_trace.py `plan`), and between two steps outside them it checkpoints, pauses in this
process and goes on when its next span starts. A pause never loses a step: the checkpoint is committed
before the wait, so a job killed while paused resumes from it, and the restarted run waits out the
rest of the pause it was in (the pause's line in metrics.jsonl says until when).

Rank 0 plans; every rank learns the plan (how long to pause, how many steps to run before the next
plan) in one small all-reduce per plan, so every rank pauses after the same step and for the same
time. Plans come after steps 1, 2, 4, 8, ... of each start (the step time settles) and at least every
PLAN_MAX steps, and whenever the last plan's steps are run. Rank 0 reads the trace again at a plan
when its file changed, so a job that refreshes it (tomorrow's day-ahead prices, a new carbon forecast)
moves the schedule; a refreshed file that cannot be read is said once and the last good one kept."""
from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque

from ...core.errors import ConfigError
from ...core.facts.energy_trace import KINDS, Window, parse_time, plan, read_trace

PLAN_MAX = 64  # steps between plans at most, once the step time has settled
TICK_S = 0.5  # a pause sleeps in ticks this long (a test's trace is seconds long; a day's, hours)


class EnergyPause:
    def __init__(self, energy, steps: int, start_step: int, world, log, run_dir: str):
        """`energy`: the training.energy section; `world`: the job's Comm (plans are agreed over it);
        `log`: the run's MetricsLog."""
        self.path = energy.trace
        self.trace, self.mtime = read_trace(self.path), mtime(self.path)
        self.deadline = parse_time(energy.deadline, "training.energy.deadline") if energy.deadline else None
        self.steps, self.world, self.log, self.run_dir = steps, world, log, run_dir
        self.last = time.monotonic()  # the end of the last step (or the start): step times are measured between
        self.intervals: deque[float] = deque(maxlen=16)
        self.step, self.next_plan, self.gap = start_step, start_step + 1, 1
        self.ran: dict[Window, list] = {}  # trace window -> [seconds run in it, joules or None]
        self.warned: set[str] = set()

    # -- between steps -------------------------------------------------------------------------
    def after_step(self, step: int, rec: dict | None) -> float:
        """After step `step` (its metrics line `rec` on logged steps): the Unix time to pause until before
        the next step (the chosen window's start, absolute so that the checkpoint written first does not
        push the resume into the window), 0 to go on; the same on every rank."""
        now, self.step = time.monotonic(), step
        self.intervals.append(now - self.last)
        self.last = now
        self._count(time.time(), self.intervals[-1], rec)
        if step >= self.steps or step < self.next_plan:
            return 0.0
        resume_at, run_n = self._agree(self._plan(step) if self.world.rank == 0 else (0.0, 0))
        self.next_plan = step + max(1, min(int(run_n), self.gap))
        self.gap = min(2 * self.gap, PLAN_MAX)
        return resume_at

    def _plan(self, step: int) -> tuple[float, float]:
        """Rank 0: (the Unix time to pause until, 0 for none; steps to run before the next plan)."""
        self.reload()
        step_s = statistics.median(self.intervals)
        try:
            sched = plan(self.trace, time.time(), step_s, self.steps - step, self.deadline)
        except ConfigError as e:  # the step time grew past what the deadline allows, or the trace ran out
            self.say_once("plan", f"{e}; the run trains throughout until the trace allows a schedule again")
            return 0.0, PLAN_MAX
        first = sched.spans[0]
        wait = first[0] - sched.now
        return (first[0], 0) if wait > 1e-3 else (0.0, first[2])

    def reload(self) -> None:
        """Rank 0, at a plan: the trace again if its file changed since it was read."""
        now = mtime(self.path)
        if now == self.mtime:
            return
        try:
            trace = read_trace(self.path)
        except ConfigError as e:
            self.say_once("reload", f"{e}; the run keeps the trace it read before")
            return
        self.flush()
        self.trace, self.mtime = trace, now

    def say_once(self, what: str, line: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            self.log.message(line)

    def _agree(self, mine: tuple[float, float]) -> tuple[float, float]:
        """Rank 0's plan on every rank (the others send zeros: both numbers are >= 0)."""
        import torch.distributed as dist
        out = self.world.all_reduce_scalars(list(mine), op=dist.ReduceOp.MAX)
        return out[0], out[1]

    def pause(self, step: int, resume_at: float, ckpt: dict) -> None:
        """Pause after `step`, whose checkpoint (`ckpt`, save_now's report) is committed, until the Unix
        time `resume_at`."""
        start = time.time()
        seconds = max(0.0, resume_at - start)
        self.flush()
        values = [w.value for w in self.trace.clipped(start, resume_at) if w.end - w.start > 1e-3]
        resume = self.trace.clipped(resume_at, resume_at + 1)
        self.log.write({"step": step, "pause": {
            "start": start, "end": resume_at, "kind": self.trace.kind, "prices": values,
            "resume_price": resume[0].value if resume else None, "ckpt": ckpt}})
        self.log.message(f"step {step}: paused {seconds:.0f} s outside the cheapest windows of the "
                         f"{self.trace.kind} trace (checkpoint saved)")
        self.wait(seconds)
        self.log.write({"step": step, "resumed": {"time": time.time(), "paused_s": time.time() - start}})

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(TICK_S, left))
        self.last = time.monotonic()  # the pause is no step's time

    def resume_pause(self, step: int) -> None:
        """Before the first step of a start: a run killed while paused waits out the rest of that pause."""
        left = 0.0
        if self.world.rank == 0:
            pause = last_pause(self.run_dir, step)
            left = max(0.0, pause["end"] - time.time()) if pause else 0.0
        left = self._agree((left, 0))[0]
        if left > 0:
            self.log.message(f"step {step}: the run was paused until {left:.0f} s from now; waiting")
            self.wait(left)
            self.log.write({"step": step, "resumed": {"time": time.time(), "paused_s": left}})

    # -- each window's energy ------------------------------------------------------------------
    def _count(self, end: float, seconds: float, rec: dict | None) -> None:
        """The step that ended at Unix time `end` ran in a trace window: its seconds, and the joules of
        the metrics line (`energy_j`, since the last line; None where no counter is readable)."""
        window = next((w for w in self.trace.windows if w.start <= end < w.end), None)
        if window is None:
            return
        slot = self.ran.setdefault(window, [0.0, 0.0])
        slot[0] += seconds
        if rec is not None:
            joules = rec.get("energy_j")
            slot[1] = None if joules is None or slot[1] is None else slot[1] + joules

    def flush(self) -> None:
        """One line per trace window the run trained in since the last flush: its price (or carbon
        intensity), the seconds run, the joules measured and what they cost (null without joules)."""
        for w, (seconds, joules) in sorted(self.ran.items(), key=lambda item: item[0].start):
            cost = None if joules is None else joules / 3.6e6 * w.value
            self.log.write({"step": self.step, "energy_window": {
                "start": w.start, "end": w.end, self.trace.kind: w.value, "ran_s": seconds, "energy_j": joules,
                KINDS[self.trace.kind]: cost}})
        self.ran = {}


def mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def last_pause(run_dir: str, step: int) -> dict | None:
    """The pause that began after `step` and was not resumed (metrics.jsonl), if any."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    pause = None
    with open(path) as f:
        for line in f:
            rec = json.loads(line) if line.strip() else {}
            if rec.get("step") == step and "pause" in rec:
                pause = rec["pause"]
            elif rec.get("step") == step and "resumed" in rec:
                pause = None
    return pause

