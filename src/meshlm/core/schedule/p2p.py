"""Where SEND/RECV go in a schedule, and the blocking model that proves it safe.

The runtime executes each rank's list in order under these rules, and
`run_blocking` (replay.py) replays exactly them:

1. A maximal run of adjacent SEND_*/RECV_* actions is ONE batch: post all of
   them together (``dist.batch_isend_irecv`` in list order), wait for all,
   then run the next compute. `p2p_batches` yields these units.
2. Per ordered pair (a, b), the k-th SEND on a to b pairs with the k-th RECV
   on b from a (NCCL matches p2p in posting order, tags are ignored).
3. A SEND completes only once its RECV is posted and vice versa (rendezvous;
   the worst case, so buffering in NCCL can only help).
   The runtime may wait for a SEND later than its batch (runtime.py): that
   only removes blocking, so what this model proves still holds.

`add_p2p` decides where each SEND/RECV goes. From an ideal timeline of the
compute order (default costs F=1, B=2, I=W=1, free p2p) it exchanges each
tensor in a sender gap (after the producer) and a receiver gap (before the
consumer) that coincide in time, so rendezvous batches stall nobody; sends
are only delayed and recvs only hoisted to keep each channel in one order.
Then it replays the blocking model and repairs any deadlock by hoisting the
receiver's next RECV into its current batch (receiving early into a buffer
is always data-safe). p2p_at="eager" (SEND right after the producer, RECV
right before the consumer) is kept for comparison: it is correct but stalls
badly under rendezvous for interleaved and zero-bubble schedules.
"""
from __future__ import annotations

from bisect import bisect_right

from .actions import Action, ScheduleError, message_of
from .replay import replay, run_blocking


STEER_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _ideal_times(compute: list[list[Action]], p: int, v: int, costs: dict, vshape: bool = False) -> list[list[tuple[float, float]]]:
    """Dataflow (start, end) of every compute under `costs`, with free p2p."""
    spans = replay(compute, p, v, costs, blocking=False, vshape=vshape).spans
    return [[(s, e) for s, e, _ in row] for row in spans]


_EPS = 1e-9


def _gaps(times_r: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Gap g = the instant(s) before compute g: (end of compute g-1, start of compute g)."""
    ends = [0.0] + [e for _, e in times_r]
    starts = [s for s, _ in times_r] + [float("inf")]
    return list(zip(ends, starts))


def _meet(gs_list, gr_list, i: int, j: int) -> tuple[int, int, float]:
    """Sender gap (> i) and receiver gap (<= j) for one message: (gs, gr, time).

    Prefer gaps that overlap in time (both ranks sit in a p2p batch at the
    same instant, so the rendezvous costs nobody anything), the latest such
    pair; otherwise the pair where the waiting side waits least.
    """
    best, best_key = (i + 1, j, gs_list[i + 1][0]), None
    consume = gr_list[j][1]
    opens = [a for a, _ in gr_list[: j + 1]]
    for gs in range(i + 1, len(gs_list)):
        a_s, b_s = gs_list[gs]
        g0 = bisect_right(opens, b_s + _EPS) - 1   # latest receiver gap open by b_s
        for gr in (g0, g0 + 1):
            if not 0 <= gr <= j:
                continue
            a_r, b_r = gr_list[gr]
            stall = max(0.0, a_r - b_s) + max(0.0, a_s - b_r)
            key = (stall, -max(a_s, a_r))
            if best_key is None or key < best_key:
                best, best_key = (gs, gr, max(a_s, a_r)), key
        if a_s > consume + _EPS:
            break
    return best


def add_p2p(compute: list[list[Action]], p: int, v: int, p2p_at: str = "timed",
            costs: dict | None = None, vshape: bool = False) -> list[list[Action]]:
    """Insert SEND/RECV actions into compute-only per-rank lists (rules in module doc).

    `costs` ({"F", "B", "I", "W"} relative durations, default STEER_COSTS)
    only steer where p2p goes; any timing this returns is deadlock-free.
    """
    if p2p_at not in ("timed", "eager"):
        raise ValueError(f"p2p_at must be 'timed' or 'eager', got {p2p_at!r}")
    costs = {**STEER_COSTS, **(costs or {})}
    gaps = [_gaps(t) for t in _ideal_times(compute, p, v, costs, vshape)]
    consumer_pos: list[dict[tuple[str, int, int], int]] = [{} for _ in range(p)]
    for r, acts in enumerate(compute):
        for i, a in enumerate(acts):
            if a.kind in ("F", "B", "I"):
                consumer_pos[r][("F" if a.kind == "F" else "B", a.mb, a.chunk)] = i
    channels: dict[tuple[int, int], list] = {}
    for r, acts in enumerate(compute):
        for i, a in enumerate(acts):
            msg = message_of(a, r, p, v, vshape)
            if msg is None:
                continue
            kind, q, qc = msg
            j = consumer_pos[q].get((kind, a.mb, qc))
            if j is None:
                raise ScheduleError(f"rank {q} never consumes {kind}{a.mb} chunk {qc} sent by rank {r}")
            gs, gr, t = (i + 1, j, 0.0) if p2p_at == "eager" else _meet(gaps[r], gaps[q], i, j)
            channels.setdefault((r, q), []).append(
                [t, gs, gr, Action("SEND_" + kind, a.mb, a.chunk, q), Action("RECV_" + kind, a.mb, qc, r)])
    sends_at: list[dict[int, list[Action]]] = [{} for _ in range(p)]
    recvs_at: list[dict[int, list[Action]]] = [{} for _ in range(p)]
    for (r, q), msgs in sorted(channels.items()):
        msgs.sort(key=lambda x: (x[0], x[1], x[2]))
        # k-th send pairs with k-th recv: delay sends (prefix max) and hoist
        # recvs (suffix min) until both sides list the channel in one order.
        for k in range(1, len(msgs)):
            msgs[k][1] = max(msgs[k][1], msgs[k - 1][1])
        for k in range(len(msgs) - 2, -1, -1):
            msgs[k][2] = min(msgs[k][2], msgs[k + 1][2])
        for _, gs, gr, send, recv in msgs:
            sends_at[r].setdefault(gs, []).append(send)
            recvs_at[q].setdefault(gr, []).append(recv)
    out = []
    for r, acts in enumerate(compute):
        row: list[Action] = []
        for g in range(len(acts) + 1):
            row.extend(sends_at[r].get(g, []))
            row.extend(recvs_at[r].get(g, []))
            if g < len(acts):
                row.append(acts[g])
        out.append(row)
    return run_blocking(out, p, v, repair=True, vshape=vshape)
