"""The vocabulary of pipeline schedules: actions and the stage layout.

Layout: p ranks, v chunks (virtual stages) per rank; (rank r, chunk c) holds
model stage ``c * p + r`` (Megatron's looping stage order). S = p * v stages;
stage 0 owns the embedding, stage S-1 the loss. V-shaped schedules (ZB-V,
``vshape=True``, v = 2) place chunk 0 of rank r at stage r and chunk 1 at
stage 2p-1-r: rank 0 holds both the first and the last stage, and the hand-off
from stage p-1 to stage p stays on rank p-1.
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


def stage_index(rank: int, chunk: int, p: int, vshape: bool = False) -> int:
    """Model stage held by (rank, chunk): looping stage order, or the V when `vshape`."""
    if vshape:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_owner(stage: int, p: int, vshape: bool = False) -> tuple[int, int]:
    """(rank, chunk) that holds `stage`."""
    if vshape:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def _consumer(action: Action, rank: int, p: int, v: int, vshape: bool):
    """(suffix 'F'/'B', rank, chunk) of the stage that consumes what `action` produces, or None."""
    s = stage_index(rank, action.chunk, p, vshape)
    if action.kind == "F" and s < p * v - 1:
        kind, dst = "F", s + 1
    elif action.kind in ("B", "I") and s > 0:
        kind, dst = "B", s - 1
    else:
        return None
    return (kind,) + stage_owner(dst, p, vshape)


def message_of(action: Action, rank: int, p: int, v: int, vshape: bool = False):
    """For a producing compute: (suffix 'F'/'B', dst rank, dst chunk), else None.

    F sends its output to stage s+1, B or I sends its input-grad to s-1. None
    also when that neighbour lives on the same rank (p == 1, or the V's turn):
    a local hand-off (see `local_target`).
    """
    msg = _consumer(action, rank, p, v, vshape)
    return None if msg is None or msg[1] == rank else msg


def local_target(action: Action, rank: int, p: int, v: int, vshape: bool = False):
    """(suffix, chunk) of a same-rank consumer of what `action` produces, else None; the runtime
    hands such tensors over without p2p."""
    msg = _consumer(action, rank, p, v, vshape)
    return (msg[0], msg[2]) if msg is not None and msg[1] == rank else None


def source_stage(kind: str, stage: int, n_stages: int) -> int | None:
    """The stage whose output a compute of `kind` at `stage` consumes (F: s-1, B/I: s+1), or None."""
    if kind not in ("F", "B", "I"):
        return None
    src = stage - 1 if kind == "F" else stage + 1
    return src if 0 <= src < n_stages else None


def source_of(action: Action, rank: int, p: int, v: int, vshape: bool = False):
    """(rank, chunk) whose output the compute consumes (F: stage s-1, B/I: s+1), or None."""
    src = source_stage(action.kind, stage_index(rank, action.chunk, p, vshape), p * v)
    return None if src is None else stage_owner(src, p, vshape)
