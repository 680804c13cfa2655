"""Slow ranks. In synchronous training every rank's wall step time is the same (the collectives wait
for the slowest), so a straggler shows as its own *busy* time (compute + data: the step minus the
time blocked in collectives) standing above the others', while the others' time blocked grows.

Each rank publishes its split (compute, comm, data seconds per step) on logged steps through the job's
key-value store, next to the watchdog's heartbeats (distributed/watchdog.py); rank 0 reads every rank's,
compares each rank's busy time to the median of the *other* ranks' (so two ranks work too), and names
a rank that stays above `metrics.straggler_factor` × that median for `metrics.straggler_steps` logged
steps in a row: in metrics.jsonl (`stragglers`), on stderr (the `--nproc` launcher's output) and in
the runs dashboard (docs/fault_tolerance.md).
"""
from __future__ import annotations

import json
import statistics
import time


def split(step_s: float, comm_s: float, data_s: float) -> dict:
    """This rank's seconds per step: time blocked in collectives, reading data, the rest (compute)."""
    comm, data = min(comm_s, step_s), min(data_s, step_s)
    return {"compute_s": max(0.0, step_s - comm - data), "comm_s": comm, "data_s": data}


def gather_published(store, prefix: str, world: int, step: int, wait_s: float) -> dict[int, dict]:
    """What every rank published as `{prefix}/{rank}` for `step` or later (rank 0 only). Every rank has
    passed the step's gradient norm all-reduce, so what is missing is a few microseconds away; a rank
    that has not published within `wait_s` is left out."""
    keys = [f"{prefix}/{r}" for r in range(world)]
    deadline = time.monotonic() + wait_s
    while True:
        got = {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))} if store.check(keys) else {}
        fresh = {r: v for r, v in got.items() if v["step"] >= step}
        if len(fresh) == world or time.monotonic() > deadline:
            return fresh
        time.sleep(0.005)


class StragglerWatch:
    def __init__(self, store, rank: int, world: int, factor: float, steps: int, wait_s: float = 2.0):
        self.store, self.rank, self.world = store, rank, world
        self.factor, self.steps, self.wait_s = factor, steps, wait_s
        self.slow_for: dict[int, int] = {}  # rank -> consecutive logged steps above the bar

    @property
    def enabled(self) -> bool:
        return self.store is not None and self.world > 1 and self.steps > 0

    def publish(self, step: int, parts: dict) -> None:
        self.store.set(f"meshlm/time/{self.rank}", json.dumps({"step": step, **parts}))

    def gather(self, step: int) -> dict[int, dict]:
        """Every rank's split of `step` (rank 0 only)."""
        return gather_published(self.store, "meshlm/time", self.world, step, self.wait_s)

    def report(self, step: int, parts: dict, is_logger: bool, message) -> list[dict]:
        """Publish this rank's split of `step`; on rank 0 (`is_logger`) the ranks named stragglers,
        each also told through `message` once per slow spell."""
        if not self.enabled:
            return []
        self.publish(step, parts)
        if not is_logger:
            return []
        named = self.judge(step, self.gather(step))
        for s in named:
            if s["steps"] == self.steps:
                message(f"step {step}: {describe(s)}")
        return named

    def judge(self, step: int, splits: dict[int, dict]) -> list[dict]:
        """The ranks named stragglers at `step` (those slow for `steps` logged steps in a row)."""
        busy = {r: s["compute_s"] + s["data_s"] for r, s in splits.items()}
        named = []
        for r, b in busy.items():
            others = [v for q, v in busy.items() if q != r]
            med = statistics.median(others) if others else b
            if med > 0 and b > self.factor * med:
                self.slow_for[r] = self.slow_for.get(r, 0) + 1
            else:
                self.slow_for.pop(r, None)
            if self.slow_for.get(r, 0) >= self.steps:
                named.append({"rank": r, "busy_s": b, "median_busy_s": med, "ratio": b / med,
                              "steps": self.slow_for[r], **{k: splits[r][k] for k in ("compute_s", "comm_s", "data_s")}})
        return named


def describe(s: dict) -> str:
    return (f"straggler: rank {s['rank']} busy {s['busy_s'] * 1e3:.0f} ms/step, {s['ratio']:.1f}x the others' median "
            f"{s['median_busy_s'] * 1e3:.0f} ms for {s['steps']} logged steps (compute {s['compute_s'] * 1e3:.0f} ms, "
            f"data {s['data_s'] * 1e3:.0f} ms, blocked in collectives {s['comm_s'] * 1e3:.0f} ms)")
