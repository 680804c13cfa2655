"""checkpoint.export_hf: a transformers directory (RUN_DIR/hf/step_N) from the sharded checkpoint of a
step, written as training goes."""
from __future__ import annotations

import os
import time

from . import checkpoint as ckpt


def export_due(every: int | str, step: int, last: bool) -> bool:
    """checkpoint.export_hf: "end" on the last step; N every N steps and on the last."""
    return every == "end" and last or not isinstance(every, str) and (step % every == 0 or last)


def export_hf(checkpointer: ckpt.Checkpointer, world, run_dir: str, step: int, dtype: str, log) -> None:
    """RUN_DIR/hf/step_N from the checkpoint of `step` just written: rank 0 streams it one tensor at a
    time (convert.to_hf), so no rank ever holds more than one full tensor and the layout's shards are
    never gathered. A directory already there (a resumed run exporting the same step again) is kept.
    Every rank learns whether it worked."""
    from .convert import to_hf
    checkpointer.wait()  # async: the checkpoint is committed
    out = os.path.join(run_dir, "hf", f"step_{step:08d}")
    failed, t0 = 0.0, time.perf_counter()
    if world.rank == 0 and not os.path.isdir(out):
        try:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            to_hf(os.path.join(checkpointer.root, f"step_{step:08d}"), out, dtype)
        except (ValueError, OSError, ckpt.CheckpointError) as e:
            failed, error = 1.0, e
    if world.all_reduce_scalars([failed])[0]:
        if world.rank == 0:
            raise RuntimeError(f"checkpoint.export_hf: step {step}: {error}") from error
        raise RuntimeError(f"checkpoint.export_hf: step {step}: failed on rank 0")
    log.message(f"step {step}: exported {out} ({time.perf_counter() - t0:.1f} s)")
