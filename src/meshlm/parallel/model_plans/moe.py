"""The model plan of a mixture-of-experts Llama (model/moe.py): LlamaModelPlan plus the MoE feed-forwards.

- tensor parallelism: the whole MoE feed-forward is one TP region. Experts are sharded over tp like
  the dense FFN (w1/w3 by hidden rows, w2 by hidden columns of every expert; Megatron's expert tensor
  parallelism = tp), the shared expert likewise, and the router is replicated. Every TP rank routes
  the same (full, gathered under SP) tokens identically, so dispatch needs no TP communication. Each
  rank's output is a partial sum, so the router's gradient is partial too: it is summed over tp
  (`SumGradLinear`), and each rank feeds 1/tp of the aux-loss gradient (the input gradient and the
  router gradient are summed over tp anyway).
- ZeRO: each MoE block's experts are a unit of their own (their gradients reduce over the
  expert-data group, the rest of the block over the data-parallel group), gathered inside the block.
- selective activation checkpointing: the SwiGLU products of the routed experts and of the shared one.
"""
from __future__ import annotations

from torch import nn

from ...model.init import canonical_name
from ...model.moe import MoE
from ..dims.expert_parallel import parallel_moe
from ..dims.tensor_parallel import SumGradLinear
from ..swap import swap_in
from .llama import LlamaModelPlan, TPLinear, TPRegion, UnitSpec


class MoEModelPlan(LlamaModelPlan):
    def moe_layers(self, model: nn.Module) -> dict[int, MoE]:
        """The MoE feed-forwards this rank holds by global block index; an MTP module's block k counts as
        block n_layers + k (model/llama.py MTPModule), so routing statistics, the bias update, expert
        and context parallelism reach it like any other."""
        out = {int(k): _inner(b).feed_forward for k, b in model.layers.items()
               if isinstance(_inner(b).feed_forward, MoE)}
        n = model.args.n_layers
        for k, m in (model.mtp or {}).items():
            if isinstance(m.block.feed_forward, MoE):
                out[n + int(k)] = m.block.feed_forward
        return out

    def expert_params(self, model: nn.Module) -> set[str]:
        return {canonical_name(f"{fqn}.experts.{p}") for fqn, m in model.named_modules() if isinstance(m, MoE)
                for p, _ in m.experts.named_parameters()}

    # -- tensor parallelism --------------------------------------------------------------------
    def tp_regions(self, model: nn.Module) -> list[TPRegion]:
        moes = {fqn: m for fqn, m in model.named_modules() if isinstance(m, MoE)}
        out = [r for r in super().tp_regions(model) if not any(r.fqn.startswith(f + ".") for f in moes)]
        for fqn, m in moes.items():
            h = m.experts.w1.shape[1]
            ex = f"{fqn}.experts"
            lins = [TPLinear(ex, m.experts, "rows", h, param="w1"), TPLinear(ex, m.experts, "rows", h, param="w3"),
                    TPLinear(ex, m.experts, "cols", h, param="w2")]
            if m.shared is not None:
                f, sh = m.shared.w1.weight.shape[0], m.shared
                lins += [TPLinear(f"{fqn}.shared.w1", sh.w1, "rows", f), TPLinear(f"{fqn}.shared.w3", sh.w3, "rows", f),
                         TPLinear(f"{fqn}.shared.w2", sh.w2, "cols", f)]
            out.append(TPRegion(fqn, m, tuple(lins), fused_entry=False))
        return out

    def tp_extra(self, model: nn.Module, comm) -> None:
        for m in [m for m in model.modules() if isinstance(m, MoE)] if comm.size > 1 else []:
            m = parallel_moe(model, m)
            m.aux_share = 1.0 / comm.size
            swap_in(model, m.router, SumGradLinear, tp_comm=comm)

    # -- ZeRO ----------------------------------------------------------------------------------
    def zero_units(self, model: nn.Module, split_tied: bool) -> tuple[list[UnitSpec], list[UnitSpec]]:
        """LlamaModelPlan's units, each MoE block's experts split off as a unit entered after its block
        (and left before it: the exit order takes the experts' parameters first)."""
        entry, exit_ = super().zero_units(model, split_tied)
        experts = {}
        blocks = [(f"layers.{k}", _inner(b)) for k, b in model.layers.items()]
        for name, b in blocks + [(f"mtp.{k}", m.block) for k, m in (model.mtp or {}).items()]:
            ff = b.feed_forward
            if isinstance(ff, MoE):
                experts[name] = UnitSpec(f"{name}.experts", (ff.experts,), ff.experts, ff.experts)

        def expand(specs, after: bool):
            out = []
            for s in specs:
                e = experts.get(s.name)
                out += ([s, e] if after else [e, s]) if e is not None else [s]
            return out
        return expand(entry, True), expand(exit_, False)

    # -- activation checkpointing ---------------------------------------------------------------
    def ac_targets(self, model: nn.Module, mode: str) -> list[tuple[nn.Module, str]]:
        if mode != "selective":
            return super().ac_targets(model, mode)
        out = []
        for b in model.layers.values():
            out.append((b.attention, "core"))
            ff = b.feed_forward
            if isinstance(ff, MoE):  # dense FFNs and shared experts fuse the product into w2 (model/ops.py)
                out.append((ff.experts, "act"))
        return out


def _inner(block: nn.Module) -> nn.Module:
    """A block under full AC / compile wrappers."""
    for attr in ("_wrapped", "_orig_mod"):
        while hasattr(block, attr):
            block = getattr(block, attr)
    return block


MOE_PLAN = MoEModelPlan()


def model_plan_for(model: nn.Module) -> LlamaModelPlan:
    """The plan of a model: MoE when it has experts."""
    from .llama import LLAMA_PLAN

    return MOE_PLAN if model.args.moe else LLAMA_PLAN
