"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format, keyed by single-process names.

Every rank hands DCP only the pieces it owns (`Pieces`: rectangles of the full tensor with their
offsets, from the placement records, parallel/placement.py); DCP writes each element once, and at load
time every rank asks for the rectangles its own layout holds, whatever layout wrote them: DCP reads the
overlapping parts of the stored chunks (resharding). No rank gathers a full tensor: a rank holds its
own share plus one stored chunk at a time (at most one parameter) while loading.

Keys are `master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` (fp32) and `rng/cpu`; everything else
(step, sampler position, loss scale, config) is `meta.json`. A checkpoint is written into `step_N.tmp`
and renamed to `step_N` only when every rank has finished. DCP stores its index (`.metadata`) as a
pickle: it is read here with an unpickler that admits DCP's own metadata classes only, and tensors
with `weights_only=True` (DCP's reader), so loading never runs arbitrary code.

One module per job: pieces.py (what a rank writes and reads), dcp_io.py (DCP's planners over pieces),
index.py (reading without arbitrary code), directory.py (which checkpoints exist, which one resumes,
the checks before start), saver.py (sync and async saves, commit, failures). Callers import from the
package. DCP itself is imported on the first save or load, not with the package: a worker start that
never saves or resumes would otherwise pay 0.4-0.7 CPU-s for it (with DTensor).
"""
from __future__ import annotations

from .directory import check_islands, check_room, find_resume, islands_of, list_checkpoints, meta_of, preflight
from .index import CheckpointError, check_files, check_shapes, read_full, read_metadata
from .pieces import Pieces
from .saver import Checkpointer, SaveError, write_failure


def __getattr__(name: str):
    if name in ("load", "save_streaming"):  # DCP's planners, imported when first asked for
        from . import dcp_io
        return getattr(dcp_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["CheckpointError", "Checkpointer", "Pieces", "SaveError", "check_files", "check_islands", "check_room",
           "check_shapes", "find_resume", "islands_of", "list_checkpoints", "load", "meta_of", "preflight", "read_full", "read_metadata", "save_streaming",
           "write_failure"]
