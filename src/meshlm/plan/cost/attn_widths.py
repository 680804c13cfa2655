"""The widths one tensor-parallel rank's attention works over, per token: one description of grouped-
query attention (Llama, Qwen, Mixtral) and multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi,
Moonlight) that the planner's compute (ops.py), memory (activations.py) and traffic (volume.py) read,
so none of them re-derives head sizes.

GQA: heads × head_dim queries, ceil(kv heads / tp) × head_dim keys and values (kv heads fewer than tp
ranks are replicated). MLA (model/mla.py): q/k heads of qk_nope + qk_rope, value heads of v_head_dim;
training expands the latent into per-head keys and values, so the attention core sees heads × qk keys
and heads × v values on a rank. Its latent down-projections (wq_a, wkv_a with the shared RoPE key) and
their norms are replicated over tp (docs/deepseek_v3.md), so their widths do not divide.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class AttnWidths:
    heads: int          # query heads on the rank
    kv_heads: int       # distinct key/value heads on the rank (MLA: every query head has its own)
    qk: int             # one query / key head
    v_head: int         # one value head
    q: int              # query width: heads · qk
    k: int              # key width: kv_heads · qk
    v: int              # value width: kv_heads · v_head
    out: int            # the core's output, wo's input: heads · v_head
    rope: int           # rotated numbers per token: q and k (MLA: the decoupled parts, k_rope once)
    latent_saved: int   # MLA: latent numbers per token its backward keeps (q latent in and out, the kv
    #                     projection's output, the normed kv latent); 0 for GQA
    latent_norms: int   # MLA: widths of the q and kv latent RMSNorms (replicated); 0 for GQA
    gemms: tuple        # (name, output width, input width) of each projection on the rank
    replicated: tuple   # (name, weight elements) of projections every TP rank holds whole (their
    #                     gradients are summed over tp per micro-batch)
    mla: bool = False


def _gqa(a, t: int) -> AttnWidths:
    hd, h = a.head_dim, a.n_heads // t
    kvh = -(-a.n_kv_heads // t)
    q, kv = h * hd, kvh * hd
    gemms = (("wq", q, a.dim), ("wk", kv, a.dim), ("wv", kv, a.dim), ("wo", a.dim, q))
    whole = a.n_kv_heads * hd * a.dim  # every kv head's rows: the runtime sums the whole weight's gradient
    repl = (("wk", whole), ("wv", whole)) if t > a.n_kv_heads else ()
    return AttnWidths(h, kvh, hd, hd, q, kv, kv, q, q + kv, 0, 0, gemms, repl)


def _mla(a, t: int) -> AttnWidths:
    h, qk, vh = a.n_heads // t, a.qk_head_dim, a.v_head_dim
    ql, kl, r = a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim
    if ql:
        q_gemms = (("wq_a", ql, a.dim), ("wq_b", h * qk, ql))
        repl_q = (("wq_a", ql * a.dim),)
    else:
        q_gemms, repl_q = (("wq", h * qk, a.dim),), ()
    gemms = q_gemms + (("wkv_a", kl + r, a.dim), ("wkv_b", h * (a.qk_nope_head_dim + vh), kl),
                       ("wo", a.dim, h * vh))
    repl = repl_q + (("wkv_a", (kl + r) * a.dim),) if t > 1 else ()
    latent = (2 * ql if ql else 0) + (kl + r) + kl
    return AttnWidths(h, h, qk, vh, h * qk, h * qk, h * vh, h * vh, h * r + r, latent, ql + kl, gemms, repl,
                      mla=True)


@lru_cache(maxsize=1024)
def attn_widths(args, tp: int = 1) -> AttnWidths:
    """The attention of `args` (core/model_args.py ModelArgs) on one of `tp` ranks."""
    return _mla(args, tp) if args.mla else _gqa(args, tp)
