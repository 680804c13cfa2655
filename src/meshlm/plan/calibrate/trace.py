"""A run's profiler trace of one step (RUN_DIR/profile.json, `metrics.profile_step`), for --calibrate:
each op sorted into a category by name (GEMM, attention kernel, communication, element-wise), the
element-wise ops' seconds split into a per-call dispatch cost and a per-element byte cost, and the
run's step split by category (`split_profile`). calibrate.py fits rates to those seconds."""
from __future__ import annotations

import json
import os

from ..spec import PlanError

PROFILE = "profile.json"  # train/observe/metrics.StepProfiler writes it (metrics.profile_step)
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv", "aten::addmv"}
ATTENTION_OPS = ("scaled_dot_product_flash_attention", "scaled_dot_product_efficient_attention",
                 "scaled_dot_product_cudnn_attention", "aten::_flash_attention", "aten::_efficient_attention")
COMM_OPS = ("c10d::", "gloo:", "nccl:", "record_param_comms")
# meshlm's autograd functions that run a blocking collective (distributed/functional.py, vocab_parallel.py,
# context_parallel.py, zero/sync.py), forward and backward: the collective's c10d op only launches it
# and the wait for the peers falls in the function's own self time, so that is comm, not dispatch (a
# tp 2 trace books ~4 ms per call of _ReduceFrom, against ~15 µs for the identity _CopyTo forward)
COLLECTIVE_FUNCTIONS = ("_CopyTo", "_ReduceFrom", "_SeqCollective", "_GatherLinears", "_SumGradOverReplicas",
                        "AllToAll", "_Float8Dispatch", "_Float8Combine", "_VocabParallelCE", "_RingAttention",
                        "_PreBackward")
# aten ops that move no data (views, metadata, allocation) or whose work is their children's (wrappers):
# their time is dispatch. Every non-aten event (autograd nodes, Python autograd functions) is too.
NO_DATA = {"aten::" + n for n in (
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "t", "transpose", "permute", "expand", "expand_as",
    "reshape", "select", "slice", "narrow", "split", "chunk", "unbind", "unsqueeze", "squeeze", "alias",
    "view_as", "flatten", "unflatten", "detach", "resolve_conj", "resolve_neg", "empty", "empty_strided",
    "empty_like", "zeros", "zeros_like", "ones_like", "lift_fresh", "contiguous", "to", "type_as", "clone",
    "linear", "matmul", "scaled_dot_product_attention", "result_type", "promote_types", "item",
    "_local_scalar_dense", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "log_softmax", "embedding",
    "embedding_backward", "scalar_tensor")}


def op_category(name: str) -> str:
    """gemm, attention, comm (collectives and the functions that block in them), or elementwise
    (everything else: norms, activations, the optimizer, copies, and the dispatch of views and
    autograd nodes)."""
    if name in GEMM_OPS:
        return "gemm"
    if any(k in name for k in ATTENTION_OPS):
        return "attention"
    if name.startswith(COMM_OPS + COLLECTIVE_FUNCTIONS):
        return "comm"
    return "elementwise"


def read_json(run_dir: str, name: str, what: str, parse):
    """parse(the JSON of RUN_DIR/name), None when the file is absent; one line naming `what` it is not."""
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return parse(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"--calibrate: {path} is not {what} ({e})") from None


def read_profile(run_dir: str) -> dict | None:
    """RUN_DIR/profile.json, or None when the run wrote none."""
    def parse(prof: dict) -> dict:
        prof["ops"], prof["wall_s"], prof["step"] = dict(prof["ops"]), float(prof["wall_s"]), int(prof["step"])
        return prof
    return read_json(run_dir, PROFILE, "a profile meshlm wrote", parse)


def dispatch_and_bytes(ops: dict) -> tuple[float, float]:
    """(seconds per call, seconds per input element) of the element-wise ops: least squares of each op
    name's seconds on its calls and its data elements (none for NO_DATA and non-aten events), both
    kept non-negative."""
    rows = [(o["calls"], _elems(n, o), _seconds(o)) for n, o in ops.items() if op_category(n) == "elementwise"]
    nn, nx, xx = (sum(a * b for a, b in pairs) for pairs in
                  ([(r[0], r[0]) for r in rows], [(r[0], r[1]) for r in rows], [(r[1], r[1]) for r in rows]))
    ns, xs = sum(r[0] * r[2] for r in rows), sum(r[1] * r[2] for r in rows)
    det = nn * xx - nx * nx
    c, b = ((ns * xx - xs * nx) / det, (xs * nn - ns * nx) / det) if det > 0 else (-1.0, -1.0)
    if c < 0 or b < 0:  # one of the two explains nothing: the other alone
        c1, b1 = (ns / nn if nn else 0.0), (xs / xx if xx else 0.0)
        resid = lambda c_, b_: sum((s_ - c_ * n_ - b_ * x_) ** 2 for n_, x_, s_ in rows)  # noqa: E731
        c, b = (c1, 0.0) if resid(c1, 0.0) <= resid(0.0, b1) else (0.0, b1)
    return c, b


def _elems(name: str, op: dict) -> float:
    return 0.0 if not name.startswith("aten::") or name in NO_DATA else float(op.get("elems", 0))


def _seconds(op: dict) -> float:
    """Device time on a GPU trace (the host only launches there), host time on a CPU."""
    return op.get("device_s") or op["self_s"]


def split_profile(prof: dict, step_s: float) -> dict:
    """Seconds per step of the run by category: the trace's shares of its profiled step, scaled to the
    run's median step (the profiler's own cost per op inflates that one step, not the shares).
    `overhead` is the step's time outside every op; comm's seconds are priced by the link instead."""
    ops = prof["ops"]
    by = {"gemm": 0.0, "attention": 0.0, "comm": 0.0, "elementwise": 0.0}
    for name, o in ops.items():
        by[op_category(name)] += _seconds(o)
    c, b = dispatch_and_bytes(ops)
    calls = sum(o["calls"] for n, o in ops.items() if op_category(n) == "elementwise")
    elems = sum(_elems(n, o) for n, o in ops.items() if op_category(n) == "elementwise")
    d, x = c * calls, b * elems
    ew = by.pop("elementwise")  # its two parts in the fitted proportion, adding up to what was measured
    by["dispatch"], by["bytes"] = (ew * d / (d + x), ew * x / (d + x)) if d + x > 0 else (ew, 0.0)
    by["overhead"] = max(0.0, prof["wall_s"] - sum(by.values()))
    scale = step_s / prof["wall_s"] if prof["wall_s"] > 0 else 0.0
    return {k: v * scale for k, v in by.items()}
