"""Loss spikes: a step whose loss or gradient norm stands more than `training.spike_zscore` standard
deviations above the previous `training.spike_window` steps' is either not applied (`skip`) or undone
by reloading the newest checkpoint before it and skipping the data windows since (`rollback`).

The decision reads the globally reduced loss and the global gradient norm, which every layout computes
alike (docs/architecture.md, invariant 1) and every rank holds the same copy of, so every rank and
every layout decides the same step. Spiking steps never enter the window; the window travels in the
checkpoint (meta.json), so a resumed or rolled-back run judges the next steps exactly as an
uninterrupted one would.

Defaults and where they come from (docs/fault_tolerance.md):
- `spike_window = 100`: PaLM (Chowdhery et al. 2022, §5.1) restarted ~100 steps before a spike;
  OLMo 2 and ZClip (Kumar et al. 2025) judge gradient-norm spikes against statistics of the last
  ~100 steps.
- `spike_zscore = 0` (off): the judgement reads the loss on the host every step, a sync the fast
  path otherwise avoids. 6 is the value we suggest: random-token batches stand 20+ σ out on the
  tiny test models while ordinary steps stay under 4 σ (measured in tests/test_spike.py).
- `spike_action = "skip"`: costs nothing but the step; `rollback` costs the replay since the
  checkpoint and is what PaLM did by hand.
"""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from ..checkpoint import list_checkpoints

if TYPE_CHECKING:
    from ..checkpoint import Checkpointer
    from ..observe.metrics import MetricsLog
    from ..state import TrainState

MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3  # then the state, not the data, is the problem: stop


class SpikeError(RuntimeError):
    """Rollback keeps meeting spikes after the same checkpoint; the message is one line."""


class SpikeDetector:
    def __init__(self, zscore: float, window: int, action: str):
        self.z, self.size, self.action = float(zscore), int(window), action
        self.history: deque = deque(maxlen=self.size)  # (loss, grad norm) of accepted steps

    @property
    def enabled(self) -> bool:
        return self.z > 0

    def judge(self, step: int, loss: float, norm: float) -> dict | None:
        """None for an ordinary step (it joins the window), else what stood out (every rank alike)."""
        if len(self.history) == self.size:
            for name, value, column in (("loss", loss, 0), ("grad_norm", norm, 1)):
                vals = [h[column] for h in self.history]
                mean = math.fsum(vals) / len(vals)
                std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / len(vals))
                z = (value - mean) / std if std > 0 else (math.inf if value > mean else 0.0)
                if not math.isfinite(value) or z > self.z:
                    return {"step": step, "on": name, "value": value, "mean": mean, "std": std,
                            "zscore": z if math.isfinite(z) else None, "loss": loss, "grad_norm": norm,
                            "action": self.action}
        self.history.append((loss, norm))
        return None

    def state_dict(self) -> list:
        return [list(h) for h in self.history]

    def load_state_dict(self, state: list | None) -> None:
        self.history.clear()
        self.history.extend(tuple(h) for h in state or [])


def rollback_target(checkpoints: list[tuple[int, str]], spike_step: int) -> tuple[int, str] | None:
    """The newest checkpoint written strictly before the spiking step."""
    before = [c for c in checkpoints if c[0] < spike_step]
    return before[-1] if before else None


def count_rollback(counts: dict[int, int], to_step: int, spike: dict) -> None:
    """One more rollback to the checkpoint of `to_step` (`counts`: per checkpoint step); SpikeError
    past MAX_ROLLBACKS_TO_ONE_CHECKPOINT."""
    counts[to_step] = counts.get(to_step, 0) + 1
    if counts[to_step] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
        raise SpikeError(f"training.spike_action: {counts[to_step]} rollbacks to the step {to_step} "
                         f"checkpoint, the last for a spike at step {spike['step']}: stopped (lower optim.lr)")


def skipped_message(step: int, spike: dict) -> str:
    return (f"step {step}: {spike['on']} {spike['value']:.4g} is a spike (window mean {spike['mean']:.4g}, "
            f"std {spike['std']:.3g}): update skipped")


def rollback_message(spike: dict, to_step: int, windows: list[int]) -> str:
    return (f"step {spike['step']}: {spike['on']} {spike['value']:.4g} is a spike: rolled back to step {to_step}, "
            f"skipping global batches {windows[0]}..{windows[1]}")


class SpikeHandler:
    """What the loop does with a judged spike: `rollback` reloads the newest checkpoint before it and
    skips the data windows from there through the spike (PaLM's recipe); a skip (or a rollback with no
    checkpoint before the spike) is logged and the loop goes on."""

    def __init__(self, checkpointer: "Checkpointer", log: "MetricsLog"):
        self.checkpointer, self.log = checkpointer, log
        self.rollbacks: dict[int, int] = {}  # checkpoint step -> spike rollbacks to it

    def rolled_back(self, spike: dict | None, state: "TrainState") -> bool:
        """True when `state` went back to a checkpoint (the loop goes on from there)."""
        if spike is None:
            return False
        log = self.log
        if spike["action"] == "rollback":
            self.checkpointer.wait()
            target = rollback_target(list_checkpoints(self.checkpointer.root), spike["step"])
            if target is not None:
                count_rollback(self.rollbacks, target[0], spike)
                windows = list(state.rollback(target[1]))  # global batches never trained on
                log.truncate_after(state.step)  # the steps after the checkpoint run again, on later data
                log.write({"step": state.step, "spike": dict(spike, action="rollback"), "rollback_to": state.step,
                           "skipped_batches": windows})
                log.message(rollback_message(spike, state.step, windows))
                return True
            spike = dict(spike, action="skip", why="no checkpoint before the spike")
        log.write({"step": state.step, "spike": spike})
        log.message(skipped_message(state.step, spike))
        return False
