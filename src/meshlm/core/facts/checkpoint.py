"""A checkpoint's size, which the saver's free-space check (train/checkpoint/directory.py) and the
planner's goodput (plan/cost/goodput.py) both need: what meshlm checkpoints hold per parameter."""
from __future__ import annotations

STATE_BYTES_PER_PARAM = 12  # fp32 master + Adam exp_avg + exp_avg_sq


def checkpoint_bytes(num_params: int) -> int:
    return STATE_BYTES_PER_PARAM * num_params
