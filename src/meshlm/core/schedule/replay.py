"""The one replay of a schedule's dependencies, which the simulator (simulate.py), the deadlock check
(`run_blocking`, check.py), the ideal times that place p2p (p2p.add_p2p) and ZB-V's list scheduler
(schedules.py) all run on.

Every rank runs its list in order; ranks take turns, each going as far as it can, until a round moves
nobody. A compute waits for its input, the forward of stage s-1 (F) or the backward of stage s+1 (B,
I): `Dataflow` is that rule and the end time of everything that ran. A p2p batch (p2p.py rules 1-3)
waits, in blocking mode, until every op's partner is posted: `Rendezvous`. In free mode batches carry
data only and cost nothing.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .actions import Action, ScheduleError, source_stage, stage_index, stage_owner


def p2p_batches(rank_actions: list[Action]) -> list:
    """Split a rank's list into compute Actions and tuples of adjacent p2p Actions (p2p.py rule 1)."""
    out: list = []
    run: list[Action] = []
    for a in rank_actions:
        if a.is_p2p:
            run.append(a)
            continue
        if run:
            out.append(tuple(run))
            run = []
        out.append(a)
    if run:
        out.append(tuple(run))
    return out


class Dataflow:
    """Which forwards and backwards have run and when each ended; an input made on another rank
    arrives `cost_comm` later."""

    def __init__(self, p: int, v: int, vshape: bool = False, cost_comm: float = 0.0):
        self.p, self.n_stages, self.vshape, self.cost_comm = p, p * v, vshape, cost_comm
        self.ends: dict[tuple[str, int, int], float] = {}   # ("F" | "B", stage, mb) -> end; an I counts as B

    def input_at(self, rank: int, kind: str, chunk: int, mb: int) -> float | None:
        """When the input of compute `kind` on (rank, chunk) for `mb` is there: 0.0 if it takes none
        (W, the first forward, the last backward), None while its producer has not run."""
        src = source_stage(kind, stage_index(rank, chunk, self.p, self.vshape), self.n_stages)
        if src is None:
            return 0.0
        t = self.ends.get(("F" if kind == "F" else "B", src, mb))
        if t is None or not self.cost_comm or stage_owner(src, self.p, self.vshape)[0] == rank:
            return t
        return t + self.cost_comm

    def ran(self, rank: int, kind: str, chunk: int, mb: int, end: float) -> None:
        if kind != "W":
            self.ends[("F" if kind == "F" else "B", stage_index(rank, chunk, self.p, self.vshape), mb)] = end

    def forward_ran(self, rank: int, chunk: int, mb: int) -> bool:
        return ("F", stage_index(rank, chunk, self.p, self.vshape), mb) in self.ends

    def missing(self, rank: int, a: Action) -> str:
        """The input `a` waits for, in words."""
        src = source_stage(a.kind, stage_index(rank, a.chunk, self.p, self.vshape), self.n_stages)
        what = "forward" if a.kind == "F" else "backward"
        return f"the {what} of mb {a.mb} at stage {src} (rank {stage_owner(src, self.p, self.vshape)[0]})"


def _channel(r: int, a: Action) -> tuple[int, int]:
    return (r, a.peer) if a.is_send else (a.peer, r)


class Rendezvous:
    """p2p.py rules 2-3: the k-th SEND a->b pairs with the k-th RECV on b from a, and an op completes
    once its partner is posted; the batch ends `cost_comm` after the last partner's posting."""

    def __init__(self, cost_comm: float = 0.0):
        self.cost_comm = cost_comm
        self.posted: dict[tuple[int, int, bool], list[float]] = defaultdict(list)  # (src, dst, send?) -> times
        self.open: dict[int, list[tuple[Action, int, tuple]]] = {}  # rank -> (op, its ordinal, partner's key)
        self.at: dict[int, float] = {}         # rank -> when it posted its open batch

    def post(self, r: int, batch: list[Action], at: float) -> None:
        self.open[r], self.at[r] = [], at
        for a in batch:
            self.add(r, a)

    def add(self, r: int, a: Action) -> None:
        """Post one more op in `r`'s open batch."""
        send = a.is_send
        src, dst = _channel(r, a)
        times = self.posted[(src, dst, send)]
        self.open[r].append((a, len(times), (src, dst, not send)))
        times.append(self.at[r])

    def unmatched(self, r: int) -> list[tuple[Action, int]]:
        return [(a, k) for a, k, other in self.open[r] if len(self.posted[other]) <= k]

    def close(self, r: int) -> float | None:
        """When `r`'s open batch completes (and it is closed), or None while a partner is not posted."""
        end = self.at[r]
        for _, k, other in self.open[r]:
            times = self.posted[other]
            if len(times) <= k:
                return None
            end = max(end, times[k] + self.cost_comm)
        del self.open[r], self.at[r]
        return end


@dataclass
class Replayed:
    rows: list[list[Action]]                      # the lists as run (`repair` may have moved RECVs)
    spans: list[list[tuple[float, float, Action]]]  # per rank, (start, end, action) of each compute


class _Replay:
    """The state of one replay; `replay` runs it."""

    def __init__(self, actions: list[list[Action]], p: int, v: int, dur: dict, cost_comm: float,
                 blocking: bool, vshape: bool):
        self.rows = [[list(it) if isinstance(it, tuple) else it for it in p2p_batches(acts)] for acts in actions]
        self.p, self.dur, self.blocking = p, dur, blocking
        self.flow, self.rv = Dataflow(p, v, vshape, cost_comm), Rendezvous(cost_comm)
        self.pos, self.clock = [0] * p, [0.0] * p
        self.spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]

    def step(self, r: int, it) -> bool | None:
        """Run `it` on rank r if it can: True if it ran, False if it waits, None if it waits after
        posting its batch (which may free a partner, so another round is due)."""
        if isinstance(it, list):
            if not self.blocking:
                return True
            fresh = r not in self.rv.open
            if fresh:
                self.rv.post(r, it, self.clock[r])
            end = self.rv.close(r)
            if end is None:
                return None if fresh else False
            self.clock[r] = max(self.clock[r], end)
            return True
        ready = self.flow.input_at(r, it.kind, it.chunk, it.mb)
        if ready is None:
            return False
        start = max(self.clock[r], ready)
        self.clock[r] = start + (self.dur[r] if isinstance(self.dur, list) else self.dur)[it.kind]
        self.spans[r].append((start, self.clock[r], it))
        self.flow.ran(r, it.kind, it.chunk, it.mb, self.clock[r])
        return True

    def rounds(self) -> list[int]:
        """Ranks take turns until a round moves nobody; the ranks left stuck."""
        moved = True
        while moved:
            moved = False
            for r in range(self.p):
                while self.pos[r] < len(self.rows[r]):
                    ran = self.step(r, self.rows[r][self.pos[r]])
                    moved = moved or ran is None
                    if not ran:
                        break
                    self.pos[r] += 1
                    moved = True
        return [r for r in range(self.p) if self.pos[r] < len(self.rows[r])]

    def hoist_one(self, stuck: list[int]) -> bool:
        """Move one later RECV into the blocked batch of its receiver (receiving early into a buffer is
        always data-safe); False if none fits."""
        rows, pos = self.rows, self.pos
        for r in stuck:
            if not isinstance(rows[r][pos[r]], list):
                continue
            for a, _k in self.rv.unmatched(r):
                if not a.is_send:
                    continue
                q = a.peer
                if pos[q] >= len(rows[q]) or not isinstance(rows[q][pos[q]], list):
                    continue
                for j in range(pos[q] + 1, len(rows[q])):
                    it = rows[q][j]
                    if not isinstance(it, list):
                        continue
                    hit = next((x for x in it if not x.is_send and x.peer == r), None)
                    if hit is None:
                        continue
                    it.remove(hit)
                    if not it:   # an emptied batch leaves two computes adjacent: fine
                        del rows[q][j]
                    rows[q][pos[q]].append(hit)
                    self.rv.add(q, hit)
                    return True
        return False

    def why(self, r: int) -> str:
        idx = sum(len(it) if isinstance(it, list) else 1 for it in self.rows[r][:self.pos[r]])
        it = self.rows[r][self.pos[r]]
        if isinstance(it, list):
            a, k = self.rv.unmatched(r)[0]
            other = "RECV" if a.is_send else "SEND"
            src, dst = _channel(r, a)
            return (f"rank {r} blocked at action #{idx + it.index(a)} {a}: waits for rank {a.peer} to post "
                    f"its {other} #{k} on channel {src}->{dst}")
        return f"rank {r} blocked at action #{idx} {it}: waits for {self.flow.missing(r, it)}"


def replay(actions: list[list[Action]], p: int, v: int, dur: dict | None = None, cost_comm: float = 0.0,
           blocking: bool = True, vshape: bool = False, repair: bool = False) -> Replayed:
    """Replay `actions` with compute durations `dur` ({"F", "B", "I", "W"}, or a list of such, one per
    rank, when stages differ; None: untimed) and p2p
    batches that block (rendezvous) or, with `blocking=False`, cost nothing.

    A rank that can never go on raises ScheduleError naming every stuck rank, its action and what it
    waits for; with `repair` a blocked SEND first pulls its receiver's next RECV from that rank into the
    receiver's open batch, until nothing is stuck or nothing fits. Message contents are not compared
    here (check.match_p2p)."""
    run = _Replay(actions, p, v, dur or dict.fromkeys("FBIW", 0.0), cost_comm, blocking, vshape)
    while stuck := run.rounds():
        if not (repair and run.hoist_one(stuck)):
            raise ScheduleError("deadlock: " + "; ".join(run.why(r) for r in stuck))
    return Replayed([[a for it in row for a in (it if isinstance(it, list) else [it])] for row in run.rows],
                    run.spans)


def run_blocking(actions: list[list[Action]], p: int, v: int, repair: bool = False,
                 vshape: bool = False) -> list[list[Action]]:
    """Replay `actions` under the blocking batch model (p2p.py); return the (repaired) lists."""
    return replay(actions, p, v, vshape=vshape, repair=repair).rows
