"""The global batch of every step under `training.batch_rampup = [start, increment, over]`, Megatron's
`--rampup-batch-size` (docs/training.md, "Batch-size ramp-up"): the batch starts at `start` sequences and grows by
`increment` each time another `over / ((global_batch - start) / increment)` samples have been consumed,
reaching `global_batch` once `over` samples are consumed.

The schedule is a function of the consumed samples, and the consumed samples of a step a function of
the step: both are closed forms over a short table of levels (one per batch size), so a resumed run,
any layout and the planner all read the same sizes without replaying the steps."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

__all__ = ["BatchRamp", "Level"]


@dataclass(frozen=True)
class Level:
    """From step `step` on (having consumed `samples` sequences before it) every step takes `batch`
    sequences, until the next level."""
    step: int
    samples: int
    batch: int


class BatchRamp:
    """Batch sizes by step. `BatchRamp(global_batch)` is the fixed batch (no ramp: step t reads the
    sequences [t·global_batch, (t+1)·global_batch) of the stream, as without this class)."""

    def __init__(self, global_batch: int, rampup: list[int] | tuple[int, ...] = ()):
        self.global_batch = int(global_batch)
        self.rampup = tuple(int(x) for x in rampup)
        self.levels = self._levels()
        self._starts = [lv.step for lv in self.levels]

    def _levels(self) -> list[Level]:
        """Walk the increments: the batch of a step is the level of the samples consumed before it,
        `min(n, samples·n // over)` with n increments (Megatron's `int(consumed / per_increment)`, in
        integers). A batch that overshoots a whole interval skips that level."""
        if not self.rampup or self.rampup[0] >= self.global_batch:
            return [Level(0, 0, self.global_batch)]
        start, inc, over = self.rampup
        n = (self.global_batch - start) // inc
        levels, step, samples = [], 0, 0
        while True:
            k = n if over == 0 else min(n, samples * n // over)
            batch = start + k * inc
            levels.append(Level(step, samples, batch))
            if k == n:
                return levels
            boundary = -(-(k + 1) * over // n)  # the first sample count of level k + 1
            steps = -(-(boundary - samples) // batch)
            step, samples = step + steps, samples + steps * batch

    def index(self, step: int) -> int:
        """Which level step `step` is in."""
        return bisect_right(self._starts, int(step)) - 1

    def level(self, step: int) -> Level:
        return self.levels[self.index(step)]

    def batch(self, step: int) -> int:
        """Sequences in global batch `step`."""
        return self.level(step).batch

    def consumed(self, step: int) -> int:
        """Sequences consumed by the steps before `step`: where step `step`'s batch starts in the stream."""
        lv = self.level(step)
        return lv.samples + (int(step) - lv.step) * lv.batch

    @property
    def ramp_steps(self) -> int:
        """Steps taken at a batch smaller than `global_batch` (0 without a ramp)."""
        return self.levels[-1].step

    def sizes(self) -> list[int]:
        """Every batch size the run uses, smallest first (the last is `global_batch`)."""
        return [lv.batch for lv in self.levels]

    def steps_at(self, steps: int) -> list[tuple[int, int]]:
        """(batch, steps at that batch) over the first `steps` steps of a run (levels it never reaches
        left out): what the planner prices."""
        out = []
        for lv, nxt in zip(self.levels, self._starts[1:] + [None]):
            n = min(steps, nxt if nxt is not None else steps) - lv.step
            if n > 0:
                out.append((lv.batch, n))
        return out
