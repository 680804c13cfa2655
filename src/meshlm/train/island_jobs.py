"""Island jobs (training.outer.on_island_loss = "continue"; docs/diloco.md, "Losing an island"): one
torchrun per island, so that a lost rank ends its island's job and no other. This launcher hosts the
islands' store (distributed/link.py) and runs their coordinator (distributed/membership.py): an island
whose torchrun ends is out at once (a new membership epoch, which releases the others from a sync waiting
for it); an island restarted (`--max-restarts R`, per island) asks to join and takes the others' state at
their next outer sync. Inside an island nothing changes: its torchrun, its checkpoints (RUN_DIR/checkpoints
for island 0, RUN_DIR/checkpoints/island{k} for the others), its watchdog. `serve_link` is the coordinator
alone, for islands that other schedulers start (one per data centre)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from ..distributed import link
from ..distributed.membership import Coordinator
from .launch import DONE_PREFIX, PREEMPTED_PREFIX, fresh_logs, preempted, torchrun

POLL_S = 0.05


class IslandJobs:
    """The island torchruns of one launch and what became of each."""

    def __init__(self, nproc: int, islands: int, config_path: str, run_dir: str, max_restarts: int,
                 timeout_s: float):
        self.nproc, self.islands, self.size = nproc, islands, nproc // islands
        self.config_path, self.run_dir, self.max_restarts = config_path, run_dir, max_restarts
        self.logs = fresh_logs(run_dir)
        self.store = link.connect(timeout_s, is_master=True)
        self.coordinator = Coordinator(self.store, islands, lost_after_s=timeout_s)
        self.restarts = {k: 0 for k in range(islands)}
        self.procs = {k: self._start(k) for k in range(islands)}
        self.ended: dict[int, int | str] = {}  # island -> "finished" or the exit status it was lost with

    def _start(self, k: int) -> subprocess.Popen:
        logs = os.path.join(self.logs, f"island{k}" + (f"_restart{self.restarts[k]}" if self.restarts[k] else ""))
        cmd, env = torchrun(self.size, 0, logs, self.config_path, self.run_dir, threads_of=self.nproc)
        env.update({link.ENV_ISLAND: str(k), link.ENV_ISLANDS: str(self.islands),
                    link.ENV_STORE: f"127.0.0.1:{self.store.port}"})
        return subprocess.Popen(cmd, env=env)

    def _finished(self, k: int) -> bool:
        """Every rank of island k recorded that its run finished or saved on a signal."""
        names = set(os.listdir(self.logs))
        return all(f"{DONE_PREFIX}{r}.txt" in names or f"{PREEMPTED_PREFIX}{r}.txt" in names
                   for r in range(k * self.size, (k + 1) * self.size))

    def watch(self) -> None:
        """Until every island's job ended: each that ends is out; a lost one restarts while it has restarts
        left (it asks to join, and the coordinator takes it in)."""
        while self.procs:
            time.sleep(POLL_S)
            for line in self.coordinator.poll():
                print(f"meshlm: {line}", file=sys.stderr, flush=True)
            for k, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del self.procs[k]
                self.coordinator.out(k)
                if code == 0 or self._finished(k):
                    self.ended[k] = "finished"
                    continue
                print(f"meshlm: island {k} lost (its torchrun exited {code}); the other islands go on without it",
                      file=sys.stderr, flush=True)
                if self.restarts[k] < self.max_restarts:
                    self.restarts[k] += 1
                    self.coordinator.expect(k)  # the others wait for it at their next outer sync
                    self.procs[k] = self._start(k)
                    print(f"meshlm: island {k} restarting ({self.restarts[k]} of {self.max_restarts}): it rejoins "
                          f"at the other islands' next outer sync", file=sys.stderr, flush=True)
                else:
                    self.ended[k] = code

    def outcome(self) -> int:
        """0 when an island finished the run (the lost ones named); the preemption status when every rank
        saved on a signal; else the first lost island's status."""
        stopped = preempted(self.run_dir)
        if len(stopped) == self.nproc:
            from .resilience.preempt import exit_status, message
            name, step, saved = stopped[0]
            print(f"meshlm: {message(name, step, saved)}", file=sys.stderr)
            return exit_status(name)
        lost = {k: c for k, c in sorted(self.ended.items()) if c != "finished"}
        if len(lost) < self.islands:
            for k, code in lost.items():
                print(f"meshlm: island {k} was lost (exit {code}) and did not come back; the run finished "
                      f"without it", file=sys.stderr)
            return 0
        return next(iter(lost.values())) or 1


def spawn_islands(nproc: int, islands: int, config_path: str, run_dir: str, max_restarts: int = 0,
                  timeout_s: float = 300.0) -> int:
    """Run `meshlm train` as `islands` island jobs of nproc / islands local workers each; the exit status."""
    jobs = IslandJobs(nproc, islands, config_path, run_dir, max_restarts, timeout_s)
    try:
        jobs.watch()
    finally:
        for proc in jobs.procs.values():  # the launcher stopped early (Ctrl-C): no island left behind
            proc.terminate()
    return jobs.outcome()


def serve_link(port: int, islands: int, timeout_s: float) -> int:
    """`meshlm train --link-server PORT`: the islands' store and coordinator, for island jobs that other
    schedulers start (MESHLM_ISLAND, MESHLM_ISLANDS and MESHLM_LINK = this host:PORT in their environment),
    until every island finished, or none is left. An island silent for parallel.timeout_s is lost."""
    store = link.connect(timeout_s, is_master=True, port=port)
    coordinator = Coordinator(store, islands, lost_after_s=timeout_s)
    print(f"meshlm: island link on port {store.port} for {islands} islands", file=sys.stderr, flush=True)
    while not coordinator.done():
        for line in coordinator.poll():
            print(f"meshlm: {line}", file=sys.stderr, flush=True)
        time.sleep(POLL_S)
    left = sorted(coordinator.finished)
    print(f"meshlm: island link closed; islands that finished: {left}", file=sys.stderr, flush=True)
    return 0 if left else 1
