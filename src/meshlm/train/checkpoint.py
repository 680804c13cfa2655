"""Checkpoints in torch.distributed.checkpoint (DCP) format, keyed by single-process parameter names.

Tensors (fp32 masters, Adam moments, RNG states) go through DCP, which writes each distinct tensor
once however many ranks hold it and loads by name into whatever this rank allocated. Everything else
(step, sampler position, loss scale, config) is a small JSON file: nothing is ever unpickled.
A checkpoint is written into `step_N.tmp` and renamed to `step_N` only when complete.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..distributed.comm import Comm

STEP_DIR = re.compile(r"^step_(\d{8})$")
# One-process runs use DCP without a process group on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "meta.json")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def find_resume(root: str, resume: str) -> str | None:
    """The checkpoint to start from: newest for `auto`, none for `never`, else the given path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1][1] if found else None
    if not os.path.isfile(os.path.join(resume, "meta.json")):
        raise FileNotFoundError(f"checkpoint.resume: no checkpoint at {resume}")
    return resume


class Checkpointer:
    def __init__(self, root: str, world: Comm, keep: int, use_async: bool):
        self.root, self.world, self.keep, self.use_async = root, world, keep, use_async
        self.pending = None  # (future, tmp, final, meta) of an async save in flight
        self.on_written = None  # fault-injection hook (train/fault.py TestHooks): step -> None
        self.dcp_group = None
        if use_async and world.size > 1:
            # Async saves need a CPU-capable group of their own to stay off the training stream.
            self.dcp_group = dist.new_group(backend="gloo")

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.wait()
        final = os.path.join(self.root, f"step_{step:08d}")
        tmp = final + ".tmp"
        if self.world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
        self.world.barrier()
        if self.use_async:
            fut = dcp.async_save(tensors, checkpoint_id=tmp, process_group=self.dcp_group)
            self.pending = (fut, tmp, final, meta)
        else:
            dcp.save(tensors, checkpoint_id=tmp)
            if self.on_written is not None:
                self.on_written(step)
            self._commit(tmp, final, meta)

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, meta = self.pending
        self.pending = None
        fut.result()
        self._commit(tmp, final, meta)

    def _commit(self, tmp: str, final: str, meta: dict) -> None:
        self.world.barrier()
        if self.world.rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for _, old in list_checkpoints(self.root)[:-self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        self.world.barrier()


def load(path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Fill `tensors` in place from the checkpoint at `path`; returns its JSON metadata."""
    dcp.load(tensors, checkpoint_id=path)
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)
