"""The job's watchdog: per-rank heartbeats and a flight recorder of collectives in the job's store, so
a collective that times out names the ranks that never entered it (docs/fault_tolerance.md)."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections import defaultdict, deque

import torch.distributed as dist


class Watchdog:
    """Per-rank heartbeats and a small flight recorder in the job's key-value store, so a collective
    that times out names the ranks that never entered it instead of hanging or failing anonymously.

    Every collective a rank enters gets a sequence number per group (the same on every member when
    they agree); the last few are kept in memory. A daemon thread publishes the numbers to the store
    about every `period` seconds (never on the collective's path: a store round trip per collective
    would cost milliseconds per step). A frozen rank stops publishing, so what the others read is
    where it froze, give or take one period; that is how the error can say "rank 1 never entered
    all_reduce #57 on group 'dp'" when both ranks had beaten the same step.
    """

    # Liveness (docs/fault_tolerance.md): besides the progress record, the thread stamps
    # meshlm/alive/{rank} every LIVE_PERIOD s whatever the rank does (a long step included), and reads
    # the others' stamps; a rank silent for `silent_s` is lost (its process or node is gone, or frozen),
    # and `on_silent` gets one line naming the silent ranks: by default it is printed, left for the
    # launcher and the process exits, failing its pending collective at once instead of after
    # parallel.timeout_s, so the elastic agent restarts the survivors within seconds.
    LIVE_PERIOD = 1.0
    JOIN_S = 10.0  # close() waits this long for a store call in flight (one takes milliseconds)

    def __init__(self, store, rank: int, world: int, period: float = 0.2, keep: int = 16,
                 silent_s: float = 0.0, on_silent=None):
        self.store, self.rank, self.world, self.period = store, rank, world, period
        self.silent_s, self.on_silent = silent_s, on_silent or exit_silent
        self._last_live, self._seen = 0.0, {}  # rank -> (stamp text, when it last changed here)
        self.step = -1
        self.seq: dict[str, int] = defaultdict(int)
        self.recent: deque = deque(maxlen=keep)  # (group, seq, kind, step, time)
        self._dirty, self._stop, self._lock = True, threading.Event(), threading.Lock()
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="meshlm-flight-recorder", daemon=True)
        self._thread.start()

    @classmethod
    def for_job(cls, rank: int, world: int, silent_s: float = 0.0, on_silent=None) -> "Watchdog | None":
        if world == 1 or not dist.is_initialized():
            return None
        from torch.distributed.distributed_c10d import _get_default_store
        return cls(_get_default_store(), rank, world, silent_s=silent_s, on_silent=on_silent)

    def beat(self, step: int) -> None:
        self.step = step
        self.store.set(f"meshlm/beat/{self.rank}", str(step))
        self._publish()  # also once a step on the main thread: the record is at most a step old

    def enter(self, group: str, kind: str) -> None:
        """A collective is being issued on `group` (cheap: no store access here)."""
        with self._lock:
            self.seq[group] += 1
            self.recent.append((group, self.seq[group], kind, self.step, time.time()))
            self._dirty = True

    def _publish(self) -> None:
        with self._lock:
            self._dirty = False
            record = {"seq": dict(self.seq), "step": self.step, "time": time.time(),
                      "last": self.recent[-1] if self.recent else None}
        self.store.set(f"meshlm/fr/{self.rank}", json.dumps(record))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                if self._dirty:
                    self._publish()
                if self.silent_s > 0 and time.monotonic() - self._last_live >= self.LIVE_PERIOD:
                    self._live()
            except Exception:  # noqa: BLE001 - the store went away with the job
                if self.silent_s > 0 and not self._stop.is_set():  # not after close(): the job is over
                    self.on_silent(f"rank {self.rank}: the job's store stopped answering (its host is lost; "
                                   f"docs/fault_tolerance.md: keep the store off the worker nodes)")
                return

    def _live(self) -> None:
        """Stamp this rank alive; name the ranks whose stamp has not changed for `silent_s`. Each rank
        judges by its own clock (when it last saw a stamp change), so clocks need not agree."""
        now = time.monotonic()
        self._last_live = now
        self.store.set(f"meshlm/alive/{self.rank}", f"{self.step}:{now}")
        keys = [f"meshlm/alive/{r}" for r in range(self.world) if r != self.rank]
        have = [k for k in keys if self.store.check([k])]
        stamps = dict(zip(have, self.store.multi_get(have))) if have else {}
        silent = []
        for k in keys:
            r, stamp = int(k.rsplit("/", 1)[1]), stamps.get(k)
            old = self._seen.get(r)
            if old is None or old[0] != stamp:
                self._seen[r] = (stamp, now)
            elif stamp not in (None, LEFT.encode()) and now - old[1] > self.silent_s:
                silent.append((r, now - old[1]))
        if silent and not self._stop.is_set():
            names = ", ".join(f"rank {r} (silent {t:.0f} s)" for r, t in silent)
            self._stop.set()
            self.on_silent(f"rank {self.rank}: lost {names} at step {self.step}: no heartbeat for over "
                           f"{self.silent_s:g} s (parallel.heartbeat_s); failing this rank's pending collective so "
                           f"the job can restart")

    def close(self) -> str | None:
        """Stop and join the thread; a rank that leaves on purpose (done, or failing with its own error)
        says so, so the others are not told it was lost. The callback goes too: it is usually a bound
        method of the trainer, and autograd graphs (C++, invisible to Python's cycle collector) hold
        Comms that hold this watchdog, so keeping it would keep the trainer and its process groups alive.

        The join is what makes the exit clean: a daemon thread still inside a store call when the
        interpreter finalizes is ended by pthread_exit while C++ frames are on its stack, and the
        forced unwind through them calls std::terminate ("terminate called without an active
        exception", exit 134 after a finished run). Returns a line when the thread would not stop."""
        self._stop.set()
        self.on_silent = exit_silent
        self._thread.join(self.JOIN_S)
        if self.silent_s > 0:
            try:
                self.store.set(f"meshlm/alive/{self.rank}", LEFT)
            except Exception:  # noqa: BLE001 - the store is gone with the job
                pass
        if self._thread.is_alive():
            return (f"rank {self.rank}: the flight recorder thread did not stop within {self.JOIN_S:g} s "
                    f"(blocked in the job's store)")
        return None

    def _read(self, key: str):
        return self.store.get(key) if self.store.check([key]) else None

    def describe(self, group: str | None = None, ranks: list[int] | None = None) -> str:
        """Who is missing from the collective this rank is stuck in (on `group`), and who is behind."""
        mine = self.seq.get(group, 0) if group else 0
        kind = next((e[2] for e in reversed(self.recent) if e[0] == group), "collective")
        missing, behind = [], []
        try:
            for r in ranks if ranks is not None else range(self.world):
                if r == self.rank:
                    continue
                fr = self._read(f"meshlm/fr/{r}")
                if group and fr is not None:
                    rec = json.loads(fr)
                    theirs = rec["seq"].get(group, 0)
                    if theirs < mine:
                        last = rec["last"]
                        where = (f"last reported: {last[2]} #{last[1]} on '{last[0]}' at step {last[3]}"
                                 if last else "it reported none")
                        missing.append(f"rank {r} never entered {kind} #{mine} on group '{group}' ({where}; "
                                       f"reported {time.time() - rec['time']:.0f} s ago)")
                beat = self._read(f"meshlm/beat/{r}")
                step = int(beat) if beat is not None else -1
                if step < self.step:
                    behind.append(f"rank {r} at step {step}" if step >= 0 else f"rank {r} never started")
        except Exception:  # noqa: BLE001 - the store itself may be gone with the failed peer
            return "; peers' progress unknown (store unreachable)"
        out = "; " + "; ".join(missing) if missing else ""
        if behind:
            out += f"; stopped answering: {', '.join(behind)} (this rank is at step {self.step})"
        return out

    def dump(self) -> None:
        """The flight record of this rank (its last collectives), to stderr, i.e. its log file."""
        print(f"meshlm flight recorder, rank {self.rank} (step {self.step}), last collectives:", file=sys.stderr)
        for group, seq, kind, step, t in self.recent:
            print(f"  {time.strftime('%H:%M:%S', time.localtime(t))} step {step} {kind} #{seq} on '{group}'",
                  file=sys.stderr)


def exit_silent(line: str) -> None:
    """A peer is lost: say so (stderr is the rank's log) and end this process, which fails whatever
    collective the main thread is blocked in (gloo cannot abort one from another thread)."""
    import os
    print(f"meshlm: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


LEFT = "left"  # the alive stamp of a rank whose watchdog closed
EXIT_PEER_LOST = 75  # a worker ended because a peer went silent (not its own failure)
