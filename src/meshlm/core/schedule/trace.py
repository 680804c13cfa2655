"""Measured pipeline timelines: gather, bubble, Chrome trace (Perfetto), and back to a `Timeline`.

The runtime times every item of its list (a compute, or one p2p batch including the wait for the
peer). Each rank's spans are wall-clock seconds, gathered over the pp group as one padded float64
tensor; the labels need no communication since every rank can rebuild every list from the schedule.

Measured bubble = 1 - Σ_r busy_r / (p × makespan), as in simulate.py: busy is compute only, the
makespan runs from the first item's start to the last item's end on any rank. Time blocked in a
p2p batch therefore counts as bubble. Across hosts the clocks are only as aligned as NTP keeps them.
"""
from __future__ import annotations

import json
import os

from .actions import Action, stage_index
from .replay import p2p_batches

Spans = list[list[tuple[float, float]]]




def _compute_spans(actions: list[list[Action]], spans: Spans):
    for r, acts in enumerate(actions):
        for it, (s, e) in zip(p2p_batches(acts), spans[r]):
            yield r, it, s, e


def measured_bubble(actions: list[list[Action]], spans: Spans) -> float:
    p = len(actions)
    flat = [x for row in spans for x in row]
    if not flat:
        return 0.0
    makespan = max(e for _, e in flat) - min(s for s, _ in flat)
    busy = sum(e - s for _, it, s, e in _compute_spans(actions, spans) if not isinstance(it, tuple))
    return 1.0 - busy / (p * makespan) if makespan > 0 else 0.0


def chrome_trace(actions: list[list[Action]], spans: Spans, meta: dict) -> dict:
    """Chrome trace-event JSON: one thread per pp rank, compute spans and p2p batches (with the
    time blocked in them). Times in microseconds from the step's first event."""
    flat = [s for row in spans for s, _ in row]
    t0 = min(flat) if flat else 0.0
    p, v = len(actions), meta.get("v", 1)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"pipeline step {meta.get('step')}"}}]
    for r in range(p):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
    for r, it, s, e in _compute_spans(actions, spans):
        ev = {"ph": "X", "pid": 0, "tid": r, "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6}
        if isinstance(it, tuple):
            ev.update(name="p2p", cat="p2p", args={"ops": [str(a) for a in it], "blocked_ms": (e - s) * 1e3})
        else:
            ev.update(name=f"{it.kind}{it.mb}" + (f"c{it.chunk}" if v > 1 else ""), cat=it.kind,
                      args={"kind": it.kind, "mb": it.mb, "chunk": it.chunk, "stage": stage_index(r, it.chunk, p, bool(meta.get("vshape")))})
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta)}


def write_chrome_trace(path: str, actions: list[list[Action]], spans: Spans, meta: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(chrome_trace(actions, spans, meta), f)
    os.replace(tmp, path)


def load_timeline(path: str):
    """A written trace as a simulate.Timeline (times in ms), so draw.render_png can draw it, plus
    the per-rank milliseconds blocked in p2p."""
    from .check import inflight_profile
    from .simulate import Timeline

    with open(path) as f:
        data = json.load(f)
    meta = data.get("otherData", {})
    p, m, v = int(meta["p"]), int(meta["m"]), int(meta.get("v", 1))
    rows: list[list] = [[] for _ in range(p)]
    blocked = [0.0] * p
    end = 0.0
    for ev in data["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        s, e = ev["ts"] / 1e3, (ev["ts"] + ev["dur"]) / 1e3
        end = max(end, e)
        if ev.get("cat") == "p2p":
            blocked[ev["tid"]] += e - s
        else:
            a = ev["args"]
            rows[ev["tid"]].append((s, e, Action(a["kind"], a["mb"], a["chunk"])))
    busy = [sum(e - s for s, e, _ in row) for row in rows]
    bubble = 1.0 - sum(busy) / (p * end) if end > 0 else 0.0
    acts = [[a for _, _, a in row] for row in rows]
    name = f"{meta.get('schedule', 'pipeline')} (measured, step {meta.get('step')})"
    tl = Timeline(p, m, v, rows, end, bubble, inflight_profile(acts), busy, name, {})
    return tl, blocked
