"""Everything `parallel/` knows about Llama's attribute names, in one place.

The machinery of each dimension is generic: tensor parallelism splits linears it is told about and
hooks the regions it is given, ZeRO groups the parameters of the units it is given, activation
checkpointing wraps the modules it is given, the pipeline keeps the pieces it is told to keep and runs
a stage through the model's own forward. `LlamaModelPlan` answers those questions for `model.llama.Llama`;
a second architecture (the MoE model) gets a plan of its own instead of special cases in each module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...model.init import canonical_name
from ...model.llama import Attention, FeedForward, HeadRMSNorm, RMSNorm
from ...model.mla import MLA


@dataclass(frozen=True)
class TPLinear:
    """A linear inside a TP region: `rows` (column-parallel: output rows split), `cols` (row-parallel:
    input columns split) or `full` (replicated, feeding the split ones: every rank's gradient is a
    part, summed over tp, e.g. MLA's latent down-projections); `size` is the split dimension's full
    size; `kv`: a k/v projection, whose heads are replicated when there are fewer kv heads than ranks;
    `param`: the weight's attribute name (stacked expert weights [E, out, in] are split along their
    last two dimensions the same way)."""
    fqn: str
    module: nn.Module
    style: str
    size: int
    kv: bool = False
    param: str = "weight"


@dataclass(frozen=True)
class TPRegion:
    """A block half: entered (input copied / gathered) before, left (output reduced) after.
    `fused_entry`: under SP the gather may be fused into the column-parallel linears (they are
    nn.Linear modules reading the region's input); a MoE block's experts read routed tokens instead."""
    fqn: str
    module: nn.Module
    linears: tuple[TPLinear, ...]
    fused_entry: bool = True


@dataclass(frozen=True)
class MTPParts:
    """What multi-token prediction's loss (parallel/features/mtp.py) needs of the model, by role: the
    final norm (None on a stage without the head), the MTP modules in depth order, the embedding, the
    head (None where the loss head applies it) and the positional inputs."""
    final_norm: nn.Module | None
    modules: list
    embed: nn.Module
    head: nn.Module | None
    positional: object


@dataclass(frozen=True)
class UnitSpec:
    """A ZeRO unit: the not-yet-taken parameters of `modules`, gathered before `first` runs and
    released after `last` has run."""
    name: str
    modules: tuple[nn.Module, ...]
    first: nn.Module
    last: nn.Module


class LlamaModelPlan:
    # -- pieces --------------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.layers

    def embedding(self, model: nn.Module) -> nn.Module | None:
        return model.tok_embeddings

    def set_embedding(self, model: nn.Module, module: nn.Module) -> None:
        model.tok_embeddings = module

    def head(self, model: nn.Module) -> nn.Module | None:
        return model.output

    def mtp_parts(self, model: nn.Module) -> MTPParts:
        return MTPParts(model.norm, list((model.mtp or {}).values()), model.tok_embeddings,
                        None if model.head_in_loss else model.output, model.positional)

    def vocab_params(self) -> tuple[str, ...]:
        """Parameters with one row per vocabulary id (padded and split by rows under TP); a tied head
        is the embedding's parameter."""
        return ("tok_embeddings.weight", "output.weight")

    def tied_name(self) -> str:
        """The single-process name of the weight shared by the embedding and the head."""
        return "tok_embeddings.weight"

    def tied(self, model: nn.Module) -> bool:
        return bool(model.args.tie_embeddings)

    def embedding_at_head(self, model: nn.Module) -> bool:
        """Whether the stage holding the head needs the embedding's weight too: a tied head, or MTP
        modules (they embed the tokens ahead). Split over two pipeline ranks, it is a tied weight."""
        return bool(model.args.tie_embeddings or model.args.mtp_depth)

    def fragment_of(self, name: str, n_layers: int, fragments: int) -> int:
        """Streaming DiLoCo's fragment of a parameter (docs/diloco.md): contiguous runs of blocks; the
        embedding (a tied head with it) goes with the first, the final norm, the head and MTP with the last."""
        first, _, rest = name.partition(".")
        if first == "layers":
            return int(rest.split(".")[0]) * fragments // n_layers
        return 0 if name == self.tied_name() else fragments - 1

    def block_parts(self, block: nn.Module) -> dict[nn.Module, str]:
        """A block's children by the part they belong to, for measuring tools (train/observe/saved.py):
        `norm` (they read the residual stream), `attention`, `feed_forward`, `other`."""
        return {m: "norm" if isinstance(m, RMSNorm) else name if name in ("attention", "feed_forward") else "other"
                for name, m in block.named_children()}

    # -- tensor parallelism --------------------------------------------------------------------
    def tp_regions(self, model: nn.Module) -> list[TPRegion]:
        """Attention split by heads (wq, wk, wv by rows, wo by columns), SwiGLU by hidden units (w1, w3
        by rows, w2 by columns): one reduction per half forward and one backward. MLA (`_mla_linears`)
        takes its input whole (under SP the region's entry gathers it: the latent projections are not
        column-parallel)."""
        args = model.args
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        out = []
        for fqn, mod in model.named_modules():
            if isinstance(mod, Attention):
                lins = (TPLinear(f"{fqn}.wq", mod.wq, "rows", q), TPLinear(f"{fqn}.wk", mod.wk, "rows", kv, True),
                        TPLinear(f"{fqn}.wv", mod.wv, "rows", kv, True), TPLinear(f"{fqn}.wo", mod.wo, "cols", q))
            elif isinstance(mod, MLA):
                out.append(TPRegion(fqn, mod, self._mla_linears(fqn, mod, args), fused_entry=False))
                continue
            elif isinstance(mod, FeedForward):
                f = args.ffn_dim
                lins = (TPLinear(f"{fqn}.w1", mod.w1, "rows", f), TPLinear(f"{fqn}.w3", mod.w3, "rows", f),
                        TPLinear(f"{fqn}.w2", mod.w2, "cols", f))
            else:
                continue
            out.append(TPRegion(fqn, mod, lins))
        return out

    @staticmethod
    def _mla_linears(fqn: str, mod: MLA, args) -> tuple[TPLinear, ...]:
        """MLA split by heads as Megatron-core does: the up-projections wq_b (or the plain wq) and wkv_b
        by rows (whole heads, head-major), wo by columns; the latent down-projections wq_a and wkv_a
        (with the shared RoPE key) replicated, `full`; their norms are head norms (summed gains)."""
        heads, qk = args.n_heads, args.qk_head_dim
        q = [TPLinear(f"{fqn}.wq", mod.wq, "rows", heads * qk)] if mod.wq is not None else \
            [TPLinear(f"{fqn}.wq_a", mod.wq_a, "full", args.q_lora_rank),
             TPLinear(f"{fqn}.wq_b", mod.wq_b, "rows", heads * qk)]
        return (*q, TPLinear(f"{fqn}.wkv_a", mod.wkv_a, "full", args.kv_lora_rank + args.qk_rope_head_dim),
                TPLinear(f"{fqn}.wkv_b", mod.wkv_b, "rows", heads * (args.qk_nope_head_dim + args.v_head_dim)),
                TPLinear(f"{fqn}.wo", mod.wo, "cols", heads * args.v_head_dim))

    def muon_params(self, model: nn.Module) -> set[str]:
        """Single-process names of the matrices optim.name = "muon" orthogonalises: the weights of every
        TP region's linears (attention and feed-forward projections; stacked experts, per expert). The
        embedding, head, norms, biases and the MoE router stay on AdamW, as the published recipes do."""
        return {canonical_name(f"{lin.fqn}.{lin.param}") for r in self.tp_regions(model) for lin in r.linears}

    def float8_linears(self, model: nn.Module) -> list[str]:
        """The linears fp8 training multiplies in float8 (parallel/features/float8.py): every block's attention and
        feed-forward projections, the TP regions' nn.Linear weights; the head stays bf16."""
        return [lin.fqn for r in self.tp_regions(model) for lin in r.linears
                if lin.param == "weight" and lin.style != "full"]

    def tp_extra(self, model: nn.Module, comm) -> None:
        """Module changes TP needs beyond the regions (none for a dense Llama; model_plans/moe.py)."""

    def stream_linears(self, model: nn.Module) -> list[nn.Module]:
        """Replicated linears outside every TP region that read the residual stream token by token (the
        MTP modules' projections): under SP each rank sees its tokens only, so their gradients are summed."""
        return [m.proj for m in (model.mtp or {}).values()]

    def norms(self, model: nn.Module) -> list[RMSNorm]:
        """The modules that see the residual stream (split along the sequence under SP)."""
        return [m for m in model.modules() if isinstance(m, RMSNorm) and not isinstance(m, HeadRMSNorm)]

    def head_norms(self, model: nn.Module) -> list[RMSNorm]:
        """Norms over each attention head (q/k norm): replicated over tp, each rank sees its heads."""
        return [m for m in model.modules() if isinstance(m, HeadRMSNorm)]

    # -- experts -------------------------------------------------------------------------------
    def expert_params(self, model: nn.Module) -> set[str]:
        """Single-process names of the parameters split over expert parallelism (none in a dense Llama)."""
        return set()

    def moe_layers(self, model: nn.Module) -> dict[int, nn.Module]:
        """MoE feed-forwards by global block index (none in a dense Llama)."""
        return {}

    def attention_cores(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """(parent, attribute) of every attention core, softmax(QKᵀ)V alone: what context parallelism
        swaps for its ring or Ulysses core (found through activation-checkpointing wrappers)."""
        return [(m, "core") for m in model.modules() if isinstance(m, (Attention, MLA))]

    def reserve_positions(self, model: nn.Module, n: int, device: torch.device) -> None:
        """Make the RoPE tables cover positions 0 … n-1 (CP: a rank's tokens reach the full length)."""
        model.rope(n, device)

    # -- pipeline ------------------------------------------------------------------------------
    def prune(self, model: nn.Module, keep: set[str], first: bool, last: bool) -> None:
        """Keep blocks `keep`, the embedding on the first stage, norm + head (+ the MTP modules) on the
        last. With tied embeddings or MTP the last stage keeps the embedding module too (tied: as the
        holder of the shared weight, its forward never runs there; MTP: it embeds the tokens ahead),
        so the copy has the single-process name and initial value."""
        for key in list(model.layers.keys()):
            if key not in keep:
                del model.layers[key]
        if not (first or (last and self.embedding_at_head(model))):
            model.tok_embeddings = None
        if not last:
            model.norm, model.output, model.mtp = None, None, None

    def tied_weight(self, model: nn.Module, first: bool) -> nn.Parameter:
        return (model.tok_embeddings if first else model.output).weight

    def run_stage(self, model: nn.Module, x: torch.Tensor, keys: list[str], first: bool, last: bool,
                  seq_len: int, docs: torch.Tensor | None = None) -> torch.Tensor:
        """The model's own forward over one chunk. Positions: the model's default (0 … local length)
        unless a positions hook (SP, CP: tensor_parallel.positions_hook) passes the true ones; `x` and
        `seq_len` are this rank's (CP: its chunks of each sequence); `docs`: document masking."""
        del seq_len
        return model(x, blocks=keys, embed=first, head=last, docs=docs)

    def stage_modules(self, model: nn.Module, keys: list[str], first: bool, last: bool) -> list[nn.Module]:
        mods = [model.tok_embeddings] if first or (last and model.mtp is not None) else []
        mods += [model.layers[k] for k in keys]
        return mods + ([model.norm, model.output, *(model.mtp or {}).values()] if last else [])

    # -- ZeRO ----------------------------------------------------------------------------------
    def zero_units(self, model: nn.Module, split_tied: bool) -> tuple[list[UnitSpec], list[UnitSpec]]:
        """Units in forward order of entry, and of exit (reversed: the backward order). One per block,
        the embedding, the head (norm + output), each MTP module (run by the loss, after the head).
        Tied weights on one rank: one root unit. Tied weights split over pipeline ends (`split_tied`;
        MTP's embedding copy too): each end's copy is a unit of its own with the same flat layout on
        both stages, so the two reduced shards can be summed over the pipeline ends."""
        emb, norm, out = model.tok_embeddings, model.norm, model.output
        tied = self.tied(model)
        layers = [UnitSpec(f"layers.{k}", (m,), m, m) for k, m in model.layers.items()]
        mtp = [UnitSpec(f"mtp.{k}", (m,), m, m) for k, m in (model.mtp or {}).items()]
        rest = UnitSpec("rest", (model,), model, model)  # anything else: held for the whole forward
        if tied and emb is not None and out is not None and not split_tied:
            root = UnitSpec("root", (emb, norm, out), emb, out)
            return [rest, root] + layers + mtp, layers + [root] + mtp + [rest]
        embed = [UnitSpec("tok_embeddings", (emb,), emb, emb)] if emb is not None and not (tied and out is not None) else []
        if out is None:
            head = []
        elif tied or model.mtp is not None:  # the last stage's copy of the tied weight; MTP calls the head
            head = [UnitSpec("head", (norm,), norm, norm), UnitSpec("output", (out,), out, out)]
        else:
            head = [UnitSpec("head", (norm, out), norm, out)]
        return [rest] + embed + layers + head + mtp, embed + layers + head + mtp + [rest]

    # -- activation checkpointing ---------------------------------------------------------------
    def ac_targets(self, model: nn.Module, mode: str) -> list[tuple[nn.Module, str]]:
        """(parent, attribute) of each module to run under checkpointing. full and op: every block
        (full keeps its input only, op also its matmul outputs: activation_checkpoint.py); selective:
        the attention core (Korthikanti et al.; the SwiGLU product is never saved, model/ops.py)."""
        if mode in ("full", "op"):
            return [(model.layers, k) for k in model.layers.keys()]
        if mode == "selective":
            return [(b.attention, "core") for b in model.layers.values()]
        return []


LLAMA_PLAN = LlamaModelPlan()
