"""Who is in the islands' link (docs/diloco.md, "Losing an island"): epochs of member islands, in the store,
written by one `Coordinator` only (meshlm's launcher runs one; islands started by other schedulers, one per
data centre, use `meshlm train --link-server PORT`).

What the coordinator reads, all from the islands' own keys: a heartbeat counter that place 0 of each island
job bumps every BEAT_S (an island silent for `lost_after_s` is out: no clock is compared across hosts),
`finished/{k}` (an island that ended its run or stopped on a signal is out, not lost), and `join/{k}`: every
start of an island job takes an incarnation number per place; the first start of every island is in epoch 0,
a later one asks to join and waits until the coordinator names the epoch that takes it in. A launcher that
sees an island's processes end may say so at once (`Coordinator.out`), without waiting for the heartbeat.
"""
from __future__ import annotations

import threading
import time

BEAT_S = 1.0
POLL_S = 0.01


def members_of(store, epoch: int) -> list[int]:
    text = store.get(f"members/{epoch}").decode()
    return [int(x) for x in text.split(",")] if text else []


def current_epoch(store) -> int:
    return int(store.get("epoch").decode())


class Membership:
    """The epochs, as written: `members/{e}`, then `epoch` (a reader of e finds its members)."""

    def __init__(self, store, islands: int):
        self.store, self.epoch, self.members = store, 0, list(range(islands))
        self._publish()

    def change(self, members: list[int]) -> int:
        """A new epoch with these members; its number."""
        self.epoch, self.members = self.epoch + 1, sorted(members)
        self._publish()
        return self.epoch

    def _publish(self) -> None:
        self.store.set(f"members/{self.epoch}", ",".join(map(str, self.members)))
        self.store.set("epoch", str(self.epoch))


def register(store, island: int, place: int, wait) -> tuple[int, int]:
    """(this start's incarnation, the first epoch it may meet in). A first start is in epoch 0 (unless the
    coordinator already counted the island out: then it joins like a restart); a later one asks to join
    (place 0 asks for the island) and `wait(ready, what)` polls for the epoch the coordinator admits it in."""
    inc = int(store.add(f"incarnation/{island}/{place}", 1))
    key = f"admitted/{island}/{inc}"
    if inc == 1 and island in members_of(store, current_epoch(store)) and not store.check([key]):
        return inc, 0
    if place == 0 and not store.check([key]):  # a launcher that restarted it may have taken it in already
        store.set(f"join/{island}", str(inc))
    epoch = wait(lambda: store.get(key).decode() if store.check([key]) else None, "the coordinator to take it in")
    return inc, int(epoch)


class Heartbeat:
    """Place 0's beat for its island, on a thread with a store client of its own."""

    def __init__(self, store_factory, island: int):
        self.island, self._stop = island, threading.Event()
        self._store = store_factory()
        self._thread = threading.Thread(target=self._run, name=f"meshlm-island{island}-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(f"beat/{self.island}", 1)
            except Exception:  # noqa: BLE001 - the coordinator went away: nothing left to tell
                return
            if self._stop.wait(BEAT_S):
                return

    def close(self, finished: bool = False) -> None:
        """Stop beating; `finished`: the island ended its run (or stopped on a signal): out, not lost."""
        self._stop.set()
        self._thread.join()
        if finished:
            self._store.set(f"finished/{self.island}", "1")


class Coordinator:
    """The only writer of the membership (see the module's docstring)."""

    def __init__(self, store, islands: int, lost_after_s: float):
        self.store, self.islands, self.lost_after_s = store, islands, lost_after_s
        self.membership = Membership(store, islands)
        now = time.monotonic()
        self.beats = {k: (None, now) for k in range(islands)}  # last counter seen, when it last changed
        self.admitted = {k: 0 for k in range(islands)}  # the last start taken in by a join (first starts: 0)
        self.finished: set[int] = set()

    @property
    def members(self) -> list[int]:
        return self.membership.members

    def out(self, k: int) -> bool:
        """Island k is out (a new epoch) if it was in."""
        if k not in self.members:
            return False
        self.membership.change([m for m in self.members if m != k])
        return True

    def expect(self, k: int, asked: int | None = None) -> int:
        """Take start `asked` of island k in (default: its next start, for a launcher restarting it now:
        the others then wait for it at their next outer sync instead of going on without it). The epoch it
        is in from."""
        if asked is None:
            key = f"incarnation/{k}/0"
            asked = int(self.store.get(key).decode()) + 1 if self.store.check([key]) else 1
        self.out(k)
        epoch = self.membership.change(self.members + [k])
        self.store.set(f"admitted/{k}/{asked}", str(epoch))
        self.admitted[k], self.beats[k] = asked, (None, time.monotonic())
        self.finished.discard(k)
        return epoch

    def poll(self) -> list[str]:
        """One look at the islands' keys; a line for each island counted out or taken in."""
        lines, now = [], time.monotonic()
        for k in list(self.members):
            if self.store.check([f"finished/{k}"]):
                self.finished.add(k)
                self.out(k)
                continue
            beat = int(self.store.get(f"beat/{k}").decode()) if self.store.check([f"beat/{k}"]) else None
            if beat != self.beats[k][0]:
                self.beats[k] = (beat, now)
            elif now - self.beats[k][1] > self.lost_after_s and self.out(k):
                lines.append(f"island {k} lost: no heartbeat for {self.lost_after_s:.0f} s; the other islands "
                             f"go on without it")
        for k in range(self.islands):
            asked = int(self.store.get(f"join/{k}").decode()) if self.store.check([f"join/{k}"]) else 0
            if asked > self.admitted[k]:
                self.expect(k, asked)  # its previous start, if still counted in, is gone
                lines.append(f"island {k} is back (start {asked}): it rejoins at the other islands' next outer sync")
        return lines

    def done(self) -> bool:
        """Every island finished, or none is in and none asked to join for lost_after_s."""
        if len(self.finished) == self.islands:
            return True
        return not self.members and time.monotonic() - max(t for _, t in self.beats.values()) > self.lost_after_s
