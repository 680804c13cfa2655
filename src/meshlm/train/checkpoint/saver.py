"""Saving: synchronously or from a host snapshot in a background thread, committed by a rename once every
rank has written, the newest `keep` kept; a failed save removes its `.tmp` and says why in one line."""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ...distributed.comm import Comm
from .directory import dir_bytes, free_bytes, list_checkpoints
from .index import CheckpointError
from .pieces import Pieces


# -- saving ----------------------------------------------------------------------------------------
class SaveError(CheckpointError):
    """A checkpoint that could not be written (checkpoint.on_error = "stop"): one line naming the
    directory, the bytes it needed and the bytes free; its `.tmp` is gone, the last checkpoint intact."""


def _write_errors() -> tuple:
    """What a failed DCP write raises: DCP's CheckpointException is a BaseException, not an Exception."""
    from torch.distributed.checkpoint.api import CheckpointException
    return Exception, CheckpointException


def _root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (every rank gets one)."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if failures else e


def _out_of_space(e: BaseException | None) -> bool:
    """Whether an error says the file system is full (or over quota), wherever it was wrapped."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


class Checkpointer:
    """Writes checkpoints under `root`: synchronously, or (async) from a host snapshot in a background
    thread on a gloo group of its own, made visible by the rename only when every rank has finished.
    A save that fails (a full disk; any OSError) removes its `.tmp` on every rank's say and leaves the
    last checkpoint as it was: `on_error` "stop" raises SaveError on every rank, "continue" prints the
    line and reports it (`done`), and the next due save tries again."""

    def __init__(self, root: str, world: Comm, keep: int, use_async: bool, on_error: str = "stop"):
        self.root, self.world, self.keep, self.use_async = root, world, keep, use_async
        self.on_error = on_error
        self.pending: tuple[Future, str, str, dict, int, int] | None = None
        # step -> None: called once a checkpoint's tensors are written and before it is committed
        # (renamed), sync or async; a plugin's hook (train/plugins.py), e.g. the tests' fault injection.
        self.on_written = None
        self.dcp_group = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if use_async else None
        if use_async and world.size > 1:
            self.dcp_group = dist.new_group(backend="gloo")
        self.done: list[dict] = []  # finished saves not yet reported: {step, write_s, bytes} or {step, error}

    def save(self, step: int, state: dict[str, Pieces], meta: dict) -> dict:
        """Write `state`; returns {save_s: wall time this call blocked} (with `error`: the line, when a
        synchronous save failed and on_error is "continue").
        Pieces kept in files (offload = "nvme") are written synchronously, one file per piece, so one
        piece is in memory at a time: a host snapshot would hold the whole state the offload keeps out
        of memory (docs/zero.md "NVMe offload")."""
        t0 = time.perf_counter()
        self.wait()
        final = os.path.join(self.root, f"step_{step:08d}")
        tmp = final + ".tmp"
        made, error = 0.0, None
        if self.world.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
            except OSError as e:
                made, error = 1.0, e
        # every rank's bytes to write (the whole checkpoint's, for the message), and whether tmp exists
        failed, need = self.world.all_reduce_scalars([made, float(sum(p.nbytes() for p in state.values()))])
        need = int(need)
        if failed:
            return self._failed(step, tmp, need, error, t0)
        lazy = any(p.backing is not None for p in state.values())
        if self.use_async and not lazy:
            snap = {k: v.to_host() for k, v in state.items()}
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
            fut = self.pool.submit(self._write, snap, tmp, self.dcp_group)
            self.pending = (fut, tmp, final, meta, step, need)
            return {"save_s": time.perf_counter() - t0}
        try:
            write_s = self._write(state, tmp, None, one_file_per_piece=lazy)
        except _write_errors() as e:  # DCP raised it on every rank
            return self._failed(step, tmp, need, e, t0)
        self._written(step)
        out = self._commit(tmp, final, meta, step, write_s, need)
        return dict(out or {}, save_s=time.perf_counter() - t0)

    @staticmethod
    def _write(state: dict[str, Pieces], tmp: str, group, one_file_per_piece: bool = False) -> float:
        """DCP's writer keeps every tensor of a file alive until the file closes: pieces read from
        files one at a time therefore get a file each."""
        import torch.distributed.checkpoint as dcp  # on the first save only (pieces.py)

        from .dcp_io import PiecesSavePlanner
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=not one_file_per_piece),
                 planner=PiecesSavePlanner(), process_group=group)
        return time.perf_counter() - t0

    def _written(self, step: int) -> None:
        if self.on_written is not None:
            self.on_written(step)

    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending[0].done()

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, meta, step, need = self.pending
        self.pending = None
        try:
            write_s = fut.result()
        except _write_errors() as e:  # every rank's write failed with it
            self._failed(step, tmp, need, e)
            return
        self._written(step)  # on this (the training) thread, like the sync path
        self._commit(tmp, final, meta, step, write_s, need)

    def _commit(self, tmp: str, final: str, meta: dict, step: int, write_s: float, need: int) -> dict | None:
        """Rank 0 writes meta.json and renames; every rank learns whether that worked (the collective
        that also ends the save: no rank goes on before the rename)."""
        self.world.barrier()
        failed, error = 0.0, None
        if self.world.rank == 0:
            try:
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump(meta, f, indent=1)
                size = dir_bytes(tmp)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            except OSError as e:
                failed, error = 1.0, e
            else:
                for _, old in list_checkpoints(self.root)[:-self.keep] if self.keep > 0 else []:
                    shutil.rmtree(old, ignore_errors=True)
                self.done.append({"step": step, "write_s": write_s, "bytes": size})
        if self.world.all_reduce_scalars([failed])[0]:
            return self._failed(step, tmp, need, error)
        return None

    def _failed(self, step: int, tmp: str, need: int, error: BaseException | None, t0: float | None = None) -> dict:
        """Every rank is here (each learned the failure from a collective): rank 0 removes the `.tmp`
        once no rank writes into it, then each rank judges from the free bytes whether it was space."""
        self.world.barrier()
        if self.world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self.world.barrier()
        line = save_error_line(self.root, step, need, error, list_checkpoints(self.root))
        if self.on_error == "stop":
            raise SaveError(line) from (_root_cause(error) if error is not None else None)
        if self.world.rank == 0:
            print(f"meshlm: {line}; training goes on (checkpoint.on_error = continue)", file=sys.stderr, flush=True)
        self.done.append({"step": step, "error": line})
        return {"error": line, "save_s": time.perf_counter() - t0} if t0 is not None else {"error": line}

    def close(self, finished: bool = True) -> None:
        """`finished`: commit a save still being written first; otherwise (the run failed) leave it:
        its peers may be gone, and the thread ends with the run's process groups."""
        if finished:
            self.wait()
        if self.pool is not None:
            self.pool.shutdown(wait=finished, cancel_futures=True)


def save_error_line(root: str, step: int, need: int, error: BaseException | None,
                    newest: list[tuple[int, str]]) -> str:
    left = f"newest checkpoint {os.path.basename(newest[-1][1])}" if newest else "no checkpoint yet"
    return write_failure(f"checkpoint step {step} not saved in {root}", root, need, error, f".tmp removed; {left}")


def write_failure(what: str, where: str, need: int, error: BaseException | None, after: str) -> str:
    """One line for a write that failed (its partial output already removed): `what`, whether it was
    space (the bytes needed against those free where it goes, or the error itself says so), and
    `after` (what is left)."""
    free = free_bytes(where)
    cause = _root_cause(error) if error is not None else None
    if free < need or _out_of_space(cause):
        return f"{what}: no space: needs {need:,} bytes, {free:,} free ({after})"
    text = (str(cause).strip().splitlines() or [""])[0][:200] if cause is not None else ""
    why = f"{type(cause).__name__}: {text}" if cause is not None else "failed on rank 0"
    return f"{what}: {why} (needs {need:,} bytes, {free:,} free; {after})"
