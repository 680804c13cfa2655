"""Prove a schedule is complete, ordered and deadlock-free before anyone runs it.

A wrong schedule on real GPUs hangs silently in NCCL or trains on the wrong
tensor; here it raises `ScheduleError` that names the rank and the action.

Execution model: the one in p2p.py that the runtime must follow (adjacent
SEND/RECV form one batch, k-th SEND a->b pairs with k-th RECV on b from a,
rendezvous completion).

In-flight accounting: a micro-batch's activations on (rank, chunk) count as
held from its F until its B, or until its W when the backward is split (W
still needs the saved layer inputs), so split schedules report the
conservative number.
"""
from __future__ import annotations

from .actions import COMPUTE_KINDS, Action, ScheduleError, message_of, source_of, stage_index
from .replay import p2p_batches, run_blocking


def _where(r: int, i: int, a: Action) -> str:
    return f"rank {r} action #{i} {a}"


def _check_shape(actions, p: int, m: int, v: int) -> None:
    if len(actions) != p:
        raise ScheduleError(f"expected {p} per-rank lists, got {len(actions)}")
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r} item #{i} is not an Action: {a!r}")
            if not 0 <= a.mb < m:
                raise ScheduleError(f"{_where(r, i, a)}: micro-batch out of range 0..{m - 1}")
            if not 0 <= a.chunk < v:
                raise ScheduleError(f"{_where(r, i, a)}: chunk out of range 0..{v - 1}")
            if a.is_p2p and not (a.peer is not None and 0 <= a.peer < p and a.peer != r):
                raise ScheduleError(f"{_where(r, i, a)}: bad peer {a.peer!r}")


def _check_local(actions, p: int, m: int, v: int, vs: bool) -> None:
    """Coverage, same-rank ordering and SEND/RECV positions, one rank at a time."""
    for r, acts in enumerate(actions):
        done: set[tuple[str, int, int]] = set()   # ("F"|"B"|"I"|"W", mb, chunk)
        sent: set[tuple[str, int, int]] = set()
        recvd: set[tuple[str, int, int]] = set()
        for i, a in enumerate(acts):
            key = (a.kind, a.mb, a.chunk)
            s = stage_index(r, a.chunk, p, vs)
            if a.is_compute:
                if key in done:
                    raise ScheduleError(f"{_where(r, i, a)}: duplicate {a.kind} for stage {s} mb {a.mb}")
                if a.kind in ("B", "I"):
                    if ("B", a.mb, a.chunk) in done or ("I", a.mb, a.chunk) in done:
                        raise ScheduleError(f"{_where(r, i, a)}: stage {s} mb {a.mb} already has a backward")
                    if ("F", a.mb, a.chunk) not in done:
                        raise ScheduleError(f"{_where(r, i, a)}: backward before its forward F{a.mb}")
                if a.kind == "W" and ("I", a.mb, a.chunk) not in done:
                    raise ScheduleError(f"{_where(r, i, a)}: W before its I (input-grad backward)")
                need = "F" if a.kind == "F" else "B"
                src = source_of(a, r, p, v, vs)   # None for W and for the first/last stage
                if src is not None and src[0] != r and (need, a.mb, a.chunk) not in recvd:
                    raise ScheduleError(
                        f"{_where(r, i, a)}: no RECV_{need} from rank {src[0]} before it")
                done.add(key)
                continue
            suffix = a.kind[-1]
            mkey = (suffix, a.mb, a.chunk)
            if a.is_send:
                produced = ("F", a.mb, a.chunk) in done if suffix == "F" else (
                    ("B", a.mb, a.chunk) in done or ("I", a.mb, a.chunk) in done)
                if not produced:
                    raise ScheduleError(f"{_where(r, i, a)}: sends a tensor not produced yet")
            compute = Action("F" if suffix == "F" else "B", a.mb, a.chunk)
            # a send must match the message its stage sends, a recv the one it receives, each once
            peer = (message_of(compute, r, p, v, vs) or (None, None))[1] if a.is_send else \
                (source_of(compute, r, p, v, vs) or (None,))[0]
            what, seen = ("send", sent) if a.is_send else ("recv", recvd)
            if peer != a.peer:
                verb = f"send {suffix} to" if a.is_send else f"receive {suffix} from"
                raise ScheduleError(f"{_where(r, i, a)}: stage {s} does not {verb} rank {a.peer}")
            if mkey in seen:
                raise ScheduleError(f"{_where(r, i, a)}: duplicate {what}")
            seen.add(mkey)
        for c in range(v):
            for mb in range(m):
                s = stage_index(r, c, p, vs)
                has = {k for k in COMPUTE_KINDS if (k, mb, c) in done}
                if "F" not in has:
                    raise ScheduleError(f"rank {r}: stage {s} mb {mb} has no forward F")
                if has - {"F"} not in ({"B"}, {"I", "W"}):
                    raise ScheduleError(
                        f"rank {r}: stage {s} mb {mb} needs one B or one I and one W, has {sorted(has - {'F'})}")
                for suffix in ("F", "B"):
                    msg = message_of(Action(suffix, mb, c), r, p, v, vs)
                    if msg is not None and (suffix, mb, c) not in sent:
                        raise ScheduleError(
                            f"rank {r}: stage {s} mb {mb} never sends SEND_{suffix} to rank {msg[1]}")


def match_p2p(actions, p: int, vshape: bool = False) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair every p2p action with its partner by per-channel order.

    Returns {(rank, index in rank list): (peer rank, peer index)}; raises if
    the k-th send and k-th recv on a channel carry different tensors.
    """
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if a.is_send:
                sends.setdefault((r, a.peer), []).append(i)
            elif a.is_p2p:
                recvs.setdefault((a.peer, r), []).append(i)
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for ch in sorted(set(sends) | set(recvs)):
        a_, b_ = ch
        ss, rr = sends.get(ch, []), recvs.get(ch, [])
        for k in range(max(len(ss), len(rr))):
            if k >= len(rr):
                x = actions[a_][ss[k]]
                raise ScheduleError(
                    f"{_where(a_, ss[k], x)}: no matching RECV on rank {b_} (send #{k} on {a_}->{b_})")
            if k >= len(ss):
                y = actions[b_][rr[k]]
                raise ScheduleError(
                    f"{_where(b_, rr[k], y)}: no matching SEND from rank {a_} (recv #{k} on {a_}->{b_})")
            x, y = actions[a_][ss[k]], actions[b_][rr[k]]
            s_src = stage_index(a_, x.chunk, p, vshape)
            s_dst = stage_index(b_, y.chunk, p, vshape)
            ok = x.kind[-1] == y.kind[-1] and x.mb == y.mb and s_dst == s_src + (1 if x.kind == "SEND_F" else -1)
            if not ok:
                raise ScheduleError(
                    f"channel {a_}->{b_} message #{k}: {_where(a_, ss[k], x)} would pair with "
                    f"{_where(b_, rr[k], y)} (different tensor)")
            pairs[(a_, ss[k])] = (b_, rr[k])
            pairs[(b_, rr[k])] = (a_, ss[k])
    return pairs


def inflight_profile(actions) -> list[int]:
    """Per rank, peak count of (mb, chunk) activations held (F done, B/W not yet)."""
    peaks = []
    for acts in actions:
        cur = peak = 0
        for a in acts:
            if a.kind == "F":
                cur += 1
                peak = max(peak, cur)
            elif a.kind in ("B", "W"):
                cur -= 1
        peaks.append(peak)
    return peaks


def inflight_by_chunk(actions) -> list[list[int]]:
    """Per rank, per chunk, the peak count of held activations (what the planner weighs per stage)."""
    out = []
    for acts in actions:
        v = 1 + max((a.chunk for a in acts), default=0)
        cur, peak = [0] * v, [0] * v
        for a in acts:
            if a.kind == "F":
                cur[a.chunk] += 1
                peak[a.chunk] = max(peak[a.chunk], cur[a.chunk])
            elif a.kind in ("B", "W"):
                cur[a.chunk] -= 1
        out.append(peak)
    return out


def check_schedule(actions, p: int, m: int, v: int = 1, vshape: bool = False) -> dict:
    """Validate `actions` for (p, m, v) (`vshape`: the V stage order of actions.py); return stats or
    raise ScheduleError.

    Returns {"peak_inflight": per-rank peak of held (mb, chunk) activations,
    "peak_activations": the same divided by v (units of a full micro-batch
    through all of that rank's layers), "p2p_batches": batches per rank,
    "actions": compute actions per rank}.
    """
    _check_shape(actions, p, m, v)
    _check_local(actions, p, m, v, vshape)
    match_p2p(actions, p, vshape)
    run_blocking(actions, p, v, vshape=vshape)
    peaks = inflight_profile(actions)
    return {
        "peak_inflight": peaks,
        "peak_activations": [x / v for x in peaks],
        "p2p_batches": [sum(isinstance(it, tuple) for it in p2p_batches(acts)) for acts in actions],
        "actions": [sum(a.is_compute for a in acts) for acts in actions],
    }
