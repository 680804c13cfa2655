"""fp8 training (training.precision = "fp8"): bf16 parameters and activations, fp32 masters, and the
blocks' linears multiplying in float8 through torchao's float8 training (an optional dependency:
`pip install meshlm[gpu]`; model/fp8_kernels.py check_fp8_device refuses what this torch cannot run before workers start).

Applied after tensor parallelism and materialisation, before compile and ZeRO: each linear then holds
its local shard, so a column- or row-parallel linear is a plain linear over its slice and converts as
one (its float8 scales are its shard's). TP's kv-head replicas (`ReplicatedKVLinear`) keep their
gradient summation in a float8 subclass; under SP the regions' entry gathers through a hook rather than
inside the linears (tensor_parallel `fuse_entry`), so they stay convertible. MoE experts run their grouped
GEMMs in float8 (model/fp8_grouped.py, `Experts.gemms`; the shared expert, a dense feed-forward, converts
as one). The embedding, the output head, the norms and MoE routers stay
bf16. Float8Linear keeps the ordinary `weight` / `bias` parameters and no buffers (dynamic scaling), so
state_dict keys, placements and checkpoints are those of a bf16 run. torchao's float8 all-gather is a
hook of torch FSDP2's DTensor parameters, which our flat-buffer ZeRO does not use: under training.fp8_comm
"zero" our ZeRO-3 gathers the weights in float8 itself and `Float8ZeroLinear` (the experts' `Float8Gemms`)
takes them as they arrive (dims/zero/float8.py, features/float8_comm.py; docs/fp8.md).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from ...distributed.functional import sum_grad_over_replicas
from ...model.fp8_grouped import Float8Gemms
from ..dims.tensor_parallel import ReplicatedKVLinear, linear_bias
from ..swap import swap_in


def float8_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig for a recipe name ("tensorwise", "rowwise"); `emulate`: the float8
    matmuls run as casts plus high-precision matmuls, on any device."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


@functools.cache
def _float8_classes() -> tuple[type, type]:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    from .float8_comm import precast

    class Float8ZeroLinear(Float8Linear):
        """torchao's Float8Linear whose weight ZeRO-3 may gather already in float8 (training.fp8_comm
        "zero"): `weight_cast()` gives the gathered codes and scale, which the GEMM takes without
        re-casting (features/float8_comm.py); None: the weight is cast here, as Float8Linear does."""
        weight_cast = None

        def hp_weight(self) -> torch.Tensor:
            return self.weight

        def hp_bias(self) -> torch.Tensor | None:
            return self.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.hp_weight()
            if self.weight_cast is not None:
                w = precast(w, *self.weight_cast(), self.linear_mm_config)
            out = matmul_with_hp_or_float8_args.apply(x, w.t(), self.linear_mm_config, self.config)
            b = self.hp_bias()
            return out if b is None else out + b.to(out.dtype)

    class Float8ReplicatedKVLinear(Float8ZeroLinear):
        """wk / wv holding a kv head shared by `tp_rep` TP ranks (tensor_parallel.ReplicatedKVLinear),
        multiplying in float8: the same summed-gradient weight, torchao's float8 matmul."""
        tp_comm: object
        tp_rep: int

        def hp_weight(self) -> torch.Tensor:
            return sum_grad_over_replicas(self.weight, self.tp_comm, self.tp_rep)

        def hp_bias(self) -> torch.Tensor | None:
            return linear_bias(self)

    return Float8ZeroLinear, Float8ReplicatedKVLinear


def convertible(mod: nn.Module) -> bool:
    """A linear float8 hardware can multiply: both local dimensions multiples of 16 (torchao's own
    filter's rule); others stay bf16."""
    out_f, in_f = mod.weight.shape
    return out_f % 16 == 0 and in_f % 16 == 0


def convert_to_float8(model: nn.Module, plan, recipe: str, emulate: bool, zero_cast: bool = False) -> list[str]:
    """Replace the model plan's block linears (`plan.float8_linears`) by torchao's Float8Linear modules
    holding the same parameters under the same names, and give the MoE experts float8 grouped GEMMs
    (`convert_experts`); returns the converted module names. `zero_cast`: ZeRO-3 gathers their weights
    in float8, so they take the `Float8ZeroLinear` form (`float8_weights`)."""
    from torchao.float8 import convert_to_float8_training

    targets = set(plan.float8_linears(model))
    mods = dict(model.named_modules())
    for fqn in targets:
        if type(mods[fqn]) not in (nn.Linear, ReplicatedKVLinear):  # SP's fused entry is off under fp8
            raise ValueError(f"training.precision: fp8 cannot convert {fqn} ({type(mods[fqn]).__name__})")
    chosen = {fqn for fqn in targets if convertible(mods[fqn])}
    replicas = {fqn: (mods[fqn].tp_comm, mods[fqn].tp_rep) for fqn in chosen
                if isinstance(mods[fqn], ReplicatedKVLinear)}
    convert_to_float8_training(model, config=float8_config(recipe, emulate),
                               module_filter_fn=lambda mod, fqn: fqn in chosen)
    plain, kv = _float8_classes()
    for fqn in chosen:
        if fqn in replicas:
            swap_in(model, model.get_submodule(fqn), kv, tp_comm=replicas[fqn][0], tp_rep=replicas[fqn][1])
        elif zero_cast:
            swap_in(model, model.get_submodule(fqn), plain)
    return sorted(chosen | set(convert_experts(model, plan, emulate)))


def zero_float8(model: nn.Module) -> tuple[frozenset[int], torch.dtype, frozenset[int]] | None:
    """(ids of the weights ZeRO-3 gathers in float8 tensorwise: the `Float8ZeroLinear` ones, their float8
    dtype, ids of the routed experts' weights it gathers with row-wise scales: those multiplying in
    float8), or None where there are none (dims/zero/float8.py)."""
    plain, _ = _float8_classes()
    mods = [m for m in model.modules() if isinstance(m, plain)]
    experts = frozenset(id(w) for m in _float8_experts(model) for w in (m.w1, m.w2, m.w3))
    if not mods and not experts:
        return None
    return (frozenset(id(m.weight) for m in mods),
            mods[0].config.cast_config_weight.target_dtype if mods else torch.float8_e4m3fn, experts)


def _float8_experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "gemms", None), Float8Gemms)]


def take_weights_from(model: nn.Module, source, experts_source) -> None:
    """Each `Float8ZeroLinear` takes its weight as `source(weight)` gives it, codes and scale
    (ZeroSync.float8_weight), instead of casting it; the float8 experts' GEMMs theirs as
    `experts_source(weight, cols)` does (ZeroSync.float8_expert_weight)."""
    plain, _ = _float8_classes()
    for m in model.modules():
        if isinstance(m, plain):
            m.weight_cast = functools.partial(source, m.weight)
    for m in _float8_experts(model):
        m.gemms.source = experts_source


def convert_experts(model: nn.Module, plan, emulate: bool) -> list[str]:
    """Every MoE block's routed experts multiply in float8 (`Float8Gemms`, row-wise scales whatever
    training.fp8_recipe says: torchao's MoE recipe) where their local shapes are multiples of 16 (the
    float8 grouped GEMM's rule, as `convertible`); the names of the experts modules converted."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    done = []
    for moe in plan.moe_layers(model).values():
        if all(d % 16 == 0 for d in moe.experts.w2.shape[1:]):  # [E, dim, hidden] local
            moe.experts.gemms = Float8Gemms(emulate)
            done.append(names[id(moe.experts)])
    return done
