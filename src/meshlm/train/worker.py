"""One worker's life: start, train, say how it ended, tear down. `meshlm train` (cli.py) runs it in every
process that trains, after the entry (preflight.py) resolved the layout."""
from __future__ import annotations

from ..distributed.mesh import thread_ids
from .launch import record_done, record_preempted, teardown
from .trainer import start


def run_worker(cfg, run_dir: str, restarts: int | None = None, layout=None) -> dict:
    """Entry point of one worker (or of the only process); `restarts` and `layout` as in trainer.py
    `start`. A finished run says so in the run directory before the teardown (launch.py `record_done`): the
    outcome, not how the process ends, decides the job's exit status."""
    ctx, finished, before = None, False, thread_ids()
    try:
        trainer = start(cfg, run_dir, restarts, layout)
        ctx = trainer.ctx
        try:
            last = trainer.fit()
        finally:
            del trainer  # its graphs and hooks hold the groups: they go before the teardown
        if "preempted" in last:  # saved and stopped on checkpoint.on_signal: the launcher says so
            record_preempted(run_dir, ctx.rank, last["preempted"])
        else:
            record_done(run_dir, ctx.rank, last)
        finished = True
        return last
    finally:
        teardown(ctx, finished, before)
