"""Measured energy, as runtime and planner agree on it (docs/energy.md, "Measured energy").

A counter is a hardware register that only grows: NVML's total energy of one GPU (millijoules, 64 bits)
or a RAPL package's energy (microjoules, wrapping at `max_energy_range_uj`). It is named by a key that is
the same on every rank that can read it (`gpu_key`, `package_key`), so the job's sum counts a CPU package
shared by the ranks on one host once, and each GPU once. A value that cannot be known is None, never a
guess: one rank without a counter makes the job's energy unknown.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """One read of one counter: `joules` since the counter's own zero, `wrap` its range in joules (0: it
    does not wrap), `max_watts` the most it can draw (0: unknown), which bounds how long a read may wait."""
    key: str
    joules: float
    wrap: float = 0.0
    max_watts: float = 0.0


def gpu_key(uuid: str) -> str:
    """A GPU's counter is its one rank's: named by the card's UUID."""
    return f"gpu:{uuid}"


def package_key(host: str, package: str) -> str:
    """A CPU package's counter is every rank's on that host: named by the host and the zone's own name
    (`package-0`; `package-0-die-1` where a package has several dies), unique on the host."""
    return f"cpu:{host}:{package}"


def delta(before: Reading, now: Reading, seconds: float) -> float | None:
    """Joules between two reads of one counter. A smaller value is one wrap-around where the counter
    wraps; where it does not (a driver reload reset it), or where the reads are so far apart that the
    counter could have wrapped twice at its maximum power, the answer is unknown (None)."""
    if now.wrap and now.max_watts and seconds * now.max_watts >= now.wrap:
        return None
    if now.joules >= before.joules:
        return now.joules - before.joules
    if now.wrap:
        return now.joules + now.wrap - before.joules
    return None


def deltas(before: list[Reading], now: list[Reading], seconds: float) -> dict[str, float | None] | None:
    """One rank's joules per counter key between two reads of all its counters; None where the rank has
    no counter at all."""
    if not now:
        return None
    old = {r.key: r for r in before}
    return {r.key: (delta(old[r.key], r, seconds) if r.key in old else None) for r in now}


def job_joules(per_rank: list[dict[str, float | None] | None]) -> float | None:
    """The job's joules over one interval from every rank's `deltas`: each key counted once (the ranks
    on one CPU package report the same key), None if any rank or counter is unknown."""
    seen: dict[str, float] = {}
    for counters in per_rank:
        if counters is None:
            return None
        for key, j in counters.items():
            if j is None:
                return None
            seen.setdefault(key, j)
    return sum(seen.values()) if seen else None


def energy_fields(joules: float | None, seconds: float, tokens: float) -> dict:
    """The metrics line's `energy_j`, `power_w` and `j_per_token` over one interval between records
    (README: metrics.jsonl); null where the joules are unknown."""
    if joules is None:
        return {"energy_j": None, "power_w": None, "j_per_token": None}
    return {"energy_j": joules, "power_w": joules / seconds if seconds > 0 else None,
            "j_per_token": joules / tokens if tokens > 0 else None}


def kwh(records: list[dict]) -> float | None:
    """The run's kWh from its metrics lines' `energy_j` (the run report); None if no line has one."""
    js = [r["energy_j"] for r in records if r.get("energy_j") is not None]
    return sum(js) / 3.6e6 if js else None
