"""The vocabulary of pipeline schedules: actions and the stage layout.

Layout: p ranks, v chunks (virtual stages) per rank; (rank r, chunk c) holds
model stage ``c * p + r`` (Megatron's looping placement). S = p * v stages;
stage 0 owns the embedding, stage S-1 the loss.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B", "I", "W")
P2P_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + P2P_KINDS


class ScheduleError(ValueError):
    """A schedule is incomplete, mis-ordered, mismatched or deadlocks."""


@dataclass(frozen=True)
class Action:
    """One step of one rank.

    Compute kinds: F forward, B full backward, I input-grad backward, W
    weight-grad backward, all on (micro-batch `mb`, local `chunk`). P2P kinds
    move activations (``_F``) or activation grads (``_B``) to/from rank
    `peer`; `chunk` is the local chunk the tensor belongs to (the producer's
    on a SEND, the consumer's on a RECV).
    """

    kind: str
    mb: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("SEND")

    def __str__(self) -> str:
        s = f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")
        if self.peer is not None:
            s += (">" if self.is_send else "<") + str(self.peer)
        return s

    __repr__ = __str__


def stage_index(rank: int, chunk: int, p: int) -> int:
    """Model stage held by (rank, chunk) under looping placement."""
    return chunk * p + rank


def stage_owner(stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) that holds `stage`."""
    return stage % p, stage // p


def message_of(action: Action, rank: int, p: int, v: int):
    """For a producing compute: (suffix 'F'/'B', dst rank, dst chunk), else None.

    F sends its output to stage s+1, B or I sends its input-grad to s-1. None
    also when that neighbour lives on the same rank (p == 1): a local hand-off.
    """
    s = stage_index(rank, action.chunk, p)
    if action.kind == "F" and s < p * v - 1:
        kind, dst = "F", s + 1
    elif action.kind in ("B", "I") and s > 0:
        kind, dst = "B", s - 1
    else:
        return None
    dr, dc = stage_owner(dst, p)
    return None if dr == rank else (kind, dr, dc)


def source_of(action: Action, rank: int, p: int, v: int):
    """(rank, chunk) whose output the compute consumes (F: stage s-1, B/I: s+1), or None."""
    if action.kind not in ("F", "B", "I"):
        return None
    s = stage_index(rank, action.chunk, p)
    src = s - 1 if action.kind == "F" else s + 1
    return stage_owner(src, p) if 0 <= src < p * v else None
