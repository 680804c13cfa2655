"""The cross-island link of island jobs (training.outer.on_island_loss = "continue"; docs/diloco.md,
"Losing an island"): each island is a c10d job of its own, and the ranks at the same place in every island
meet over this link only at DiLoCo's outer syncs. An island that dies does not take the others with it.

Who is in: one coordinator (distributed/membership.py) is the only writer of the *membership*: epoch e and
the islands in it, in a store it hosts (the store outlives every worker). It starts a new epoch when an
island is lost or finished, and when a new start of one asks to join.

Each round (one outer sync, or an island's first meeting) runs in a *slot* of this place's sequence: the
first rank to reach slot n fixes its epoch (compare-and-set), every member of that epoch meets on a gloo
group built for it over the store, runs the round's collectives, and records whether they went through.
One decision per slot, also by compare-and-set: *commit* once every member recorded success, *abort* once
one failed or the launcher named a newer epoch first. Nothing changes before the commit (a round returns
the function that applies it), so an aborted round is run again, whole, in the next slot with the members
left. Each place keeps its own sequence: a round may commit with a peer at one place and without it at
another (every island computes the same θ_outer at each place all the same).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import CollectiveError, Comm
from .membership import Heartbeat, current_epoch, members_of, register

POLL_S = 0.01
ENV_STORE, ENV_ISLAND, ENV_ISLANDS = "MESHLM_LINK", "MESHLM_ISLAND", "MESHLM_ISLANDS"


class LinkError(RuntimeError):
    """The link gave up: no peer answered in time, or this island is no longer a member."""


class RunOver(LinkError):
    """A rejoining island found every other island finished: nothing left to join."""


def island_job() -> tuple[int, int] | None:
    """(this island, the island count) when this process is a rank of one island job, else None."""
    if ENV_ISLAND not in os.environ:
        return None
    return int(os.environ[ENV_ISLAND]), int(os.environ[ENV_ISLANDS])


def job_world() -> int:
    """The mesh's world size as this process sees it: WORLD_SIZE, times the islands in an island job."""
    job = island_job()
    return int(os.environ.get("WORLD_SIZE", "1")) * (job[1] if job else 1)


def connect(timeout_s: float, is_master: bool = False, port: int = 0) -> dist.TCPStore:
    """The coordinator's store (is_master: host it, on `port` of every interface, 0 = a free one), or a
    worker's client of it (MESHLM_LINK = host:port)."""
    if is_master:
        return dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    host, port = os.environ[ENV_STORE].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def gloo_group(store, rank: int, size: int, timeout_s: float):
    """A gloo process group over `store` outside the job's own (every dist.* collective takes it)."""
    pg = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


class LinkComm(Comm):
    """The `islands` Comm of an island job: each collective is waited for while watching the membership, so
    that a round a member left is given up at once. (gloo fails a collective fast only on the ranks that
    talk to the lost one; the others would wait for their timeout.)"""

    def __init__(self, name: str, ranks: list[int], rank: int):
        super().__init__(name, None, ranks, rank)
        self.given_up: Callable[[], bool] = lambda: False  # set by the Link for the epoch in use
        self.on_release: list[Callable[[], None]] = []  # the Link's heartbeat ends with the groups
        self.groups: dict[int, object] = {}  # epoch -> its gloo group (made once, when every member came)
        self._links = False  # gloo's own work, polled while the membership is watched: never a blocking socket

    def drop_before(self, epoch: int) -> None:
        """Abort the groups of older epochs: one may still wait in a collective given up, which only an
        abort ends (deleting it would wait for gloo's timeout)."""
        for old in [e for e in self.groups if e < epoch]:
            pg = self.groups.pop(old)
            if pg is not None:
                pg._get_backend(torch.device("cpu")).abort()

    def release(self) -> None:
        for end in self.on_release:
            end()
        self.drop_before(float("inf"))
        super().release()

    def _run(self, kind, nbytes, wire_factor, fn, async_op, after=None, **kw):
        handle = super()._run(kind, nbytes, wire_factor, fn, True, after, **kw)
        while not handle.done():
            if self.given_up():
                raise CollectiveError(f"rank {self.global_rank}: {kind} on group '{self.name}' given up: "
                                      f"a member left (a new membership epoch)")
            time.sleep(POLL_S)
        handle.wait()
        return handle if async_op else None


class Link:
    """This rank's side: the ranks at place `place` (its rank inside its island) of every member island.
    `comm` is the `islands` Comm everything books through; its group is this epoch's."""

    def __init__(self, store, island: int, place: int, timeout_s: float, comm: LinkComm):
        self.store, self.island, self.timeout_s, self.comm = store, island, timeout_s, comm
        self.islands = int(os.environ.get(ENV_ISLANDS, str(island + 1)))
        self.prefix = f"p{place}/"
        # this start of the island, and the first epoch it may meet in (0: a first start, in from the outset)
        self.incarnation, self.admitted = register(store, island, place, self._wait)
        self.slot: int | None = 0 if self.admitted == 0 else None  # a rejoining island looks for it
        self.heart = Heartbeat(lambda: connect(timeout_s), island) if place == 0 else None  # its island's beat
        if self.heart is not None:
            comm.on_release.append(self.heart.close)
        self.groups = comm.groups
        comm.given_up = lambda: self._lost(self.using)
        self.members: list[int] = []
        self.using = 0  # the epoch of the group in use
        self._complete: dict[int, int] = {}  # epoch -> the newest later epoch known to hold all its members

    def finish(self) -> None:
        """The run ended (or stopped on a signal): the coordinator counts this island out, not lost."""
        if self.heart is not None:
            self.heart.close(finished=True)

    # -- the store ----------------------------------------------------------------------------
    def _key(self, *parts) -> str:
        return self.prefix + "/".join(map(str, parts))

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _agree(self, key: str, value: str) -> str:
        """The value every rank reads at `key`: the first one proposed."""
        return self.store.compare_set(key, "", value).decode()

    def epoch(self) -> int:
        return current_epoch(self.store)

    def _lost(self, epoch: int) -> bool:
        """A member of `epoch` left since (it is missing from a later epoch): a round in `epoch` cannot
        finish. An island that only joined does not end a round (it meets the others at the next one)."""
        newest = self.epoch()
        if newest == epoch:
            return False
        members = set(members_of(self.store, epoch))
        for e in range(max(epoch, self._complete.get(epoch, epoch)) + 1, newest + 1):
            if not members <= set(members_of(self.store, e)):
                return True
            self._complete[epoch] = e  # checked up to here: epochs do not change once written
        return False

    def _wait(self, ready: Callable[[], object], what: str):
        """Poll `ready` until it returns something other than None, or give up after timeout_s."""
        end = time.monotonic() + self.timeout_s
        while (out := ready()) is None:
            if time.monotonic() > end:
                raise LinkError(f"island {self.island}: no answer over the island link within "
                                f"{self.timeout_s:.0f} s ({what}; parallel.timeout_s)")
            time.sleep(POLL_S)
        return out

    # -- rounds -------------------------------------------------------------------------------
    def run(self, round_fn: Callable[[Comm], Callable[[], None]]) -> list[int]:
        """One round, run again in later slots until a slot commits it; the members it committed with.
        `round_fn(comm)` runs the collectives and returns what applies their result."""
        while True:
            n, epoch = self._next_slot()
            ok, commit = False, None
            if self._gather(epoch):
                try:
                    commit, ok = round_fn(self.comm), True
                except CollectiveError:
                    pass  # a member went away mid-round: decided below, like everyone
            self.store.set(self._key("s", n, "ok", self.island), "1" if ok else "0")
            if self._decide(n, epoch) == "commit":
                commit()
                return list(self.members)
            self._wait(lambda e=epoch: True if self._lost(e) else None, "a new membership after a lost island")

    def _next_slot(self) -> tuple[int, int]:
        """This rank's next slot and its epoch (fixed by the first rank there). A rejoining island takes
        the first slot fixed at or after the epoch that admitted it."""
        if self.slot is None:
            self.slot = int(self._get(self._key("latest")) or 0)
        while True:
            n = self.slot
            self.slot += 1
            if self.admitted == 0 or self._get(self._key("s", n, "epoch")) is not None:
                epoch = int(self._agree(self._key("s", n, "epoch"), str(self.epoch())))
            else:  # a rejoining island waits for the members to open the slot
                epoch = int(self._wait(lambda n=n: self._opened(n), "the next outer sync"))
            self.store.set(self._key("latest"), str(n))
            if epoch >= self.admitted:
                if self.island not in members_of(self.store, epoch):
                    raise LinkError(f"island {self.island}: dropped from the islands' membership (epoch {epoch})")
                self.admitted = 0
                return n, epoch

    def _opened(self, n: int) -> str | None:
        """Slot n's epoch once the members opened it; a rejoining island that is alone opens it itself, and
        one whose every peer finished the run has nothing to join (RunOver)."""
        opened = self._get(self._key("s", n, "epoch"))
        if opened is not None:
            return opened
        others = [i for i in range(self.islands) if i != self.island]
        if all(self.store.check([f"finished/{i}"]) for i in others):
            raise RunOver(f"island {self.island}: the other islands finished the run; nothing left to rejoin")
        if members_of(self.store, self.epoch()) == [self.island]:
            return self._agree(self._key("s", n, "epoch"), str(self.epoch()))
        return None

    def _gather(self, epoch: int) -> bool:
        """Every member of `epoch` is here and this place's group for it exists (False: the launcher named
        a newer epoch before all came: a member is gone)."""
        if epoch in self.groups:
            self._use(epoch)
            return True
        members = members_of(self.store, epoch)
        self.store.set(self._key("e", epoch, "here", self.island), "1")
        here = [self._key("e", epoch, "here", i) for i in members]
        came = self._wait(lambda: True if self.store.check(here) else (False if self._lost(epoch) else None),
                          f"the members {members} of epoch {epoch}")
        if not came:
            return False
        if len(members) > 1:
            store = dist.PrefixStore(self._key("e", epoch, "pg"), self.store)
            self.groups[epoch] = gloo_group(store, members.index(self.island), len(members), self.timeout_s)
        else:
            self.groups[epoch] = None
        self._use(epoch)
        return True

    def _use(self, epoch: int) -> None:
        self.members, self.using = members_of(self.store, epoch), epoch
        c = self.comm
        c.group, c.ranks, c.size, c.rank = self.groups[epoch], list(self.members), len(self.members), \
            self.members.index(self.island)
        c._gloo = True  # CUDA tensors go through host memory (comm._staged): the link is gloo
        c.drop_before(epoch)  # never used again

    def _decide(self, n: int, epoch: int) -> str:
        """commit or abort for slot n: the first proposal wins, so every member reads the same."""
        members = members_of(self.store, epoch)
        keys = [self._key("s", n, "ok", i) for i in members]

        def outcome():
            decided = self._get(self._key("s", n, "decision"))
            if decided is not None:
                return decided
            if self.store.check(keys):
                values = [self.store.get(k).decode() for k in keys]
                proposed = "commit" if all(v == "1" for v in values) else "abort"
            elif self._lost(epoch):  # the launcher saw a member go before it recorded
                proposed = "abort"
            else:
                return None
            return self._agree(self._key("s", n, "decision"), proposed)
        return self._wait(outcome, f"slot {n}'s outcome")
