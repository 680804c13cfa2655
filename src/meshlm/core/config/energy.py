"""The `training.energy` section: when a run may train (docs/energy.md, "Scheduling in time") and the
per-stage clock plan the planner writes. Its trace is read and the deadline judged against the run's
length by the entry (preflight.py `check_energy`), which knows the run's predicted step time."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..facts.energy_trace import parse_time


@dataclass
class EnergyConfig:
    trace: str = ""  # a CSV of time,price or time,carbon: the run pauses outside its cheapest windows
    deadline: str = ""  # ISO 8601 with its zone: the run ends by then ("" = the trace's end)
    # per-pipeline-stage relative SM clocks (`meshlm plan --emit-config`): data for an administrator to
    # apply (docs/energy.md); meshlm never changes a clock
    clocks: list[float] = field(default_factory=list)

    def check(self, cfg=None) -> None:
        if self.deadline:
            if not self.trace:
                raise ConfigError("training.energy.deadline: needs training.energy.trace (the prices to schedule by)")
            parse_time(self.deadline, "training.energy.deadline")
        for c in self.clocks:
            if not 0 < c <= 1:
                raise ConfigError(f"training.energy.clocks: each stage's clock is a fraction of the card's in (0, 1], "
                                  f"got {c}")
