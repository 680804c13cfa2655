"""Energy traces and the schedule in time (docs/energy.md, "Scheduling in time"): what the run
(train/resilience/energy_pause.py), the entry's checks (preflight.py) and the planner's print
(plan/cost/energy_schedule.py) agree on, so that all three choose the same windows.

A trace is a CSV with a header `time,price` or `time,carbon`: ISO 8601 times with their zone, each
value holding until the next row's time; the last row's value holds for as long as the row before it
(an hourly export's last hour counts). Prices are per kWh, carbon intensity in gCO2e/kWh."""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from datetime import datetime

from ..errors import ConfigError

KINDS = {"price": "cost", "carbon": "emissions"}  # the trace's column -> what its schedule saves
KEY = "training.energy.trace"


def parse_time(text: str, where: str) -> float:
    """Unix seconds of an ISO 8601 time that states its zone (a time without one is ambiguous)."""
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"{where}: not an ISO 8601 time: {text.strip()!r}") from None
    if t.tzinfo is None:
        raise ConfigError(f"{where}: {text.strip()!r} has no zone (write e.g. 2024-06-01T00:00:00+02:00 or ...Z)")
    return t.timestamp()


@dataclass(frozen=True)
class Window:
    """[start, end) in Unix seconds at one value (a price per kWh or gCO2e/kWh)."""
    start: float
    end: float
    value: float

    @property
    def hours(self) -> float:
        return (self.end - self.start) / 3600


@dataclass(frozen=True)
class Trace:
    kind: str  # "price" or "carbon"
    windows: tuple[Window, ...]  # in time order, each ending where the next starts

    @property
    def start(self) -> float:
        return self.windows[0].start

    @property
    def end(self) -> float:
        return self.windows[-1].end

    def covers(self, start: float, end: float) -> bool:
        return self.start <= start and end <= self.end

    def clipped(self, start: float, end: float) -> list[Window]:
        """The windows' parts inside [start, end)."""
        return [Window(max(w.start, start), min(w.end, end), w.value) for w in self.windows
                if w.end > start and w.start < end]

    def value_hours(self, start: float, end: float) -> float:
        """The integral of the value over [start, end), in value x hours (x kW = cost or grams)."""
        return sum(w.value * w.hours for w in self.clipped(start, end))


def parse_trace(text: str, path: str) -> Trace:
    """A trace from its CSV text; a bad file is one ConfigError line naming the row."""
    rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
    head = [c.strip().lower() for c in rows[0]] if rows else []
    if len(head) != 2 or head[0] != "time" or head[1] not in KINDS:
        raise ConfigError(f"{KEY}: {path}: row 1: expected the header time,price or time,carbon, got "
                          f"{','.join(head) or 'nothing'}")
    times, values = [], []
    for n, row in enumerate(rows[1:], start=2):
        where = f"{KEY}: {path}: row {n}"
        if len(row) != 2:
            raise ConfigError(f"{where}: expected 2 columns, got {len(row)}")
        t = parse_time(row[0], where)
        try:
            v = float(row[1])
        except ValueError:
            raise ConfigError(f"{where}: {head[1]} is not a number: {row[1].strip()!r}") from None
        if not math.isfinite(v) or head[1] == "carbon" and v < 0:
            raise ConfigError(f"{where}: {head[1]} must be a finite number{' >= 0' if head[1] == 'carbon' else ''}, "
                              f"got {row[1].strip()}")
        if times and t <= times[-1]:
            raise ConfigError(f"{where}: times must increase ({row[0].strip()} is not after the row before)")
        times.append(t)
        values.append(v)
    if len(times) < 2:
        raise ConfigError(f"{KEY}: {path}: needs at least two rows of times (each value holds until the next)")
    ends = times[1:] + [times[-1] + (times[-1] - times[-2])]
    return Trace(head[1], tuple(Window(a, b, v) for a, b, v in zip(times, ends, values)))


def read_trace(path: str) -> Trace:
    try:
        with open(path, newline="") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{KEY}: cannot read {path} ({e.__class__.__name__})") from None
    return parse_trace(text, path)


@dataclass(frozen=True)
class Schedule:
    """When the run trains: `spans` (in time order; it pauses between them) and what that costs
    against running from `now` throughout (value x kWh: a price's cost, or grams of CO2e)."""
    kind: str
    now: float
    deadline: float
    step_s: float
    steps: int
    kw: float  # the job's draw while it trains (kWh per hour of running)
    spans: tuple[tuple[float, float, int], ...]  # (start, end, steps run in it)
    cost: float
    cost_now: float

    @property
    def finish(self) -> float:
        return self.spans[-1][1] if self.spans else self.now

    @property
    def saving(self) -> float:
        """The fraction of running now's cost (or emissions) the schedule saves."""
        return 1 - self.cost / self.cost_now if self.cost_now > 0 else 0.0

    def next_span(self, t: float) -> tuple[float, float, int] | None:
        """The span that holds time `t` or comes next; None when none is left."""
        return next((s for s in self.spans if s[1] > t), None)


def _steps_in(trace: Trace, spans: list[tuple[float, float]], step_s: float,
              steps: int) -> tuple[list[tuple[float, float, int]], int]:
    """Steps that fit whole in each span (the run never starts one it cannot finish there), cheapest
    span first, until `steps` are placed; a span with room to spare runs at its cheaper end. In time order."""
    out, left = [], steps
    for a, b in sorted(spans, key=lambda s: (trace.value_hours(*s) / (s[1] - s[0]), s[0])):
        n = min(left, int((b - a) / step_s + 1e-9))
        if n:
            early, late = (a, a + n * step_s), (b - n * step_s, b)
            a, b = late if trace.value_hours(*late) < trace.value_hours(*early) else early
            out.append((a, b, n))
            left -= n
    return sorted(out), steps - left


def _merged(pieces: list[Window]) -> list[tuple[float, float]]:
    spans: list[list[float]] = []
    for w in sorted(pieces, key=lambda w: w.start):
        if spans and w.start <= spans[-1][1] + 1e-9:
            spans[-1][1] = max(spans[-1][1], w.end)
        else:
            spans.append([w.start, w.end])
    return [(a, b) for a, b in spans]


def plan(trace: Trace, now: float, step_s: float, steps: int, deadline: float | None = None,
         kw: float = 1.0) -> Schedule:
    """The cheapest spans that still run `steps` steps of `step_s` seconds by `deadline` (default: the
    trace's end): the trace's windows between now and the deadline, cheapest first (the earlier of
    equal ones), taken until their whole steps suffice; the run pauses outside them. A ConfigError
    line when the trace does not cover the run or the deadline cannot be met even running throughout."""
    end = trace.end if deadline is None else deadline
    need = steps * step_s
    if now + need > end + 1e-9:
        run = f"{steps} steps x {step_s:.3g} s = {need / 3600:.3g} h from now"
        if deadline is None:
            raise ConfigError(f"{KEY}: does not cover the run: it ends {_iso(trace.end)}, the run ({run}) "
                              f"{(now + need - end) / 3600:.3g} h later even running throughout")
        raise ConfigError(f"training.energy.deadline: cannot be met even running throughout: {run} ends "
                          f"{(now + need - end) / 3600:.3g} h after it")
    if not trace.covers(now, end):
        raise ConfigError(f"{KEY}: does not cover the run: it spans {_iso(trace.start)} .. {_iso(trace.end)}, the "
                          f"run may train from {_iso(now)} until {_iso(end)}")
    taken: list[Window] = []
    spans: list[tuple[float, float, int]] = []
    for w in sorted(trace.clipped(now, end), key=lambda w: (w.value, w.start)):
        taken.append(w)
        spans, placed = _steps_in(trace, _merged(taken), step_s, steps)
        if placed >= steps:
            break
    cost = kw * sum(trace.value_hours(a, b) for a, b, _ in spans)
    return Schedule(trace.kind, now, end, step_s, steps, kw, tuple(spans), cost,
                    kw * trace.value_hours(now, now + need))


def schedule_for(energy, now: float, step_s: float, steps: int, kw: float = 1.0) -> Schedule:
    """The schedule from `now` of `steps` steps of `step_s` s under the training.energy section `energy`
    (the entry's check and the planner's print; the run plans through `plan` as it goes)."""
    deadline = parse_time(energy.deadline, "training.energy.deadline") if energy.deadline else None
    return plan(read_trace(energy.trace), now, step_s, steps, deadline, kw)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def describe(s: Schedule, unit: str = "", per_kw: bool = False) -> list[str]:
    """The schedule as lines: each span, then its cost (or emissions) against running now (`per_kw`: the
    draw is not known, the figures are per kW of it)."""
    what = KINDS[s.kind]
    fmt = (lambda x: f"{x / 1000:.3g} kgCO2e") if s.kind == "carbon" else (lambda x: f"{x:.4g}{unit}")
    lines = [f"schedule: {s.steps} steps of {s.step_s:.3g} s in {len(s.spans)} span(s) by {_iso(s.deadline)}"]
    lines += [f"  {_iso(a)} .. {_iso(b)}  {n} steps" for a, b, n in s.spans]
    lines.append(f"  {what}: {fmt(s.cost)} scheduled vs {fmt(s.cost_now)} running now "
                 f"({s.saving:.1%} saved, " + ("per kW drawn)" if per_kw else f"at {s.kw:.3g} kW)"))
    return lines
