"""Every enumerated configuration value, in one place: the config checks (core/config/sections.py), the
runtime (parallelize, the trainer) and the planner all read these lists, so a value exists everywhere
or nowhere. A pipeline schedule is listed here only once it has a runtime (core/schedule/schedules.py
asserts that its registry is exactly this list), so an unimplemented name gets the same one-line
refusal as any unknown value. What each precision holds in bytes (HELD) is here too, for the same
reason. Pure Python: the planner imports it without torch.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao float8 recipe names (training.fp8_recipe)
FP8_COMMS = ("zero", "sp", "ep")  # collectives that move float8 under fp8 (training.fp8_comm, docs/fp8.md)
AC_MODES = ("none", "op", "selective", "full")  # in order of recompute cost (the planner's search)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
PP_TAKES_VIRTUAL = ("interleaved", "zbv")
PP_V_SHAPED = ("zbv",)  # two chunks per rank placed in a V (core/schedule/actions.py: vshape)
OFFLOAD = ("none", "optimizer", "nvme")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
CP_IMPLS = ("ring", "ulysses", "allgather")
ATTN_IMPLS = ("auto", "sdpa", "flex")  # model.attn_impl; auto resolves in layout.attn_kernel
ZERO_STAGES = (0, 1, 2, 3)
SPIKE_ACTIONS = ("skip", "rollback")  # training.spike_action
ELASTIC = ("fail", "replan")  # parallel.elastic
EXPORT_DTYPES = ("bf16", "fp32")  # checkpoint.export_dtype
ON_ERROR = ("stop", "continue")  # checkpoint.on_error: what a failed save or export does
# checkpoint.on_signal: every signal name but the two no process can catch
CATCHABLE_SIGNALS = tuple(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))
OPTIMIZERS = ("adamw", "muon")  # optim.name
LR_SCHEDULES = ("cosine", "wsd", "constant", "linear")  # optim.schedule (docs/training.md)
DECAY_TYPES = ("linear", "sqrt", "cosine")  # optim.decay_type: the shape of WSD's decay
OUTER_QUANTIZE = ("none", "bf16", "fp8", "int8")  # training.outer.quantize: the outer gradients on the wire

# Bytes per element of each dtype name (reductions, exports); a precision's tensors: HELD.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Held:
    """Bytes per element of what one training precision holds. The planner's memory, traffic and
    optimizer time all read this one table rather than each deciding what fp32 means in bytes."""
    param: int  # parameters (the compute copy) and the collectives that move them
    act: int    # activations
    grad: int   # gradients: accumulated in fp32 at every precision
    optim: int  # AdamW state per parameter: fp32 m and v, plus an fp32 master when param is below fp32

    @property
    def master(self) -> bool:
        """An fp32 master beside the parameters: the optimizer writes the compute copy back each step."""
        return self.param < DTYPE_BYTES["fp32"]


# fp8 (torchao float8 training) holds bf16 parameters and activations: only the block matmuls cast, and
# Float8Linear saves its high-precision input and weight for backward (torchao/float8/float8_linear.py)
HELD = {"fp32": Held(param=4, act=4, grad=4, optim=8), "bf16": Held(param=2, act=2, grad=4, optim=12),
        "fp16": Held(param=2, act=2, grad=4, optim=12), "fp8": Held(param=2, act=2, grad=4, optim=12)}
# torch attribute of each dtype name (parallel/compose.py `torch_dtype` looks it up)
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def choose(value, allowed, key: str, error: type[Exception] = ValueError):
    """`value` if it is one of `allowed`, else `error` with one line naming the key."""
    if value not in allowed:
        raise error(f"{key}: '{value}' is not one of {', '.join(map(str, allowed))}")
    return value


def param_dtype(precision: str) -> str:
    """The dtype parameters and activations are held in: fp8 training is bf16 with its block linears'
    matmuls in float8 (parallel/features/float8.py)."""
    return "bf16" if precision == "fp8" else precision
