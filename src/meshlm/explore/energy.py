"""The explorer's schedule of a trace (docs/energy.md, "Scheduling in time"): a pasted trace CSV and the
run's predicted length become the trace's windows and the spans the run would train in, chosen by
core/facts/energy_trace.py `plan`, the code the run itself plans with. A trace that has passed (a real
day's prices) is scheduled from its start, as if the run were submitted then."""
from __future__ import annotations

import time

from ..core.config import ConfigError
from ..core.facts.energy_trace import KINDS, parse_time, parse_trace, plan

def energy_schedule(body: dict, bad) -> dict:
    """`body`: {trace: CSV text, seconds: the run's predicted seconds, steps, deadline: ISO 8601 or ""};
    `bad(message, key)` makes the error to raise (explore/api.py's BadRequest)."""
    try:
        trace = parse_trace(str(body.get("trace") or ""), "the trace")
        deadline = parse_time(body["deadline"], "deadline") if body.get("deadline") else None
        steps, seconds = int(body.get("steps") or 0), float(body.get("seconds") or 0)
    except ConfigError as e:
        raise bad(str(e).replace("training.energy.trace: ", ""), "energy.trace") from None
    except (TypeError, ValueError):
        raise bad("steps / seconds: expected numbers", "energy.trace") from None
    if steps < 1 or not seconds > 0:
        raise bad("the run: needs >= 1 step and a predicted time (the estimate's)", "energy.trace")
    now = time.time()
    start = now if trace.start <= now < trace.end else trace.start
    try:
        s = plan(trace, start, seconds / steps, steps, deadline)
    except ConfigError as e:
        raise bad(str(e), "energy.trace") from None
    return {"kind": trace.kind, "saves": KINDS[trace.kind], "start": start, "from_now": start == now,
            "deadline": s.deadline, "windows": [[w.start, w.end, w.value] for w in trace.windows],
            "spans": [list(x) for x in s.spans], "cost": s.cost, "cost_now": s.cost_now, "saving": s.saving}
