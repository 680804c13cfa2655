"""Bytes a Block saves for backward on one rank, and the transient buffers beside it (the loss, the
attention mask, context parallelism's exchange). What meshlm's Block really saves is checked against
saved-tensor hooks (tests/test_plan.py, tests/test_saved_set.py); `korthikanti_block_bytes` keeps the
textbook GPT formula for comparison. memory.py adds these up per pipeline rank."""
from __future__ import annotations

from functools import lru_cache

from ...core.choices import AC_MODES
from ...core.model_args import padded_vocab
from .attn_widths import AttnWidths, attn_widths
from ..spec import Shape


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def vocab_rows(args, tp: int) -> int:
    """Embedding / head rows on one TP rank: the vocabulary padded as the runtime pads it, split by tp."""
    return padded_vocab(args.vocab_size, args.vocab_multiple, tp) // tp


def vocab_real(args, tp: int) -> int:
    """Real (unpadded) ids in the largest rank's slice: the logits the loss keeps and saves."""
    return min(vocab_rows(args, tp), args.vocab_size)


def korthikanti_block_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT block (Korthikanti et al. 2022, Table 2): 2-byte activations,
    4h MLP, dropout; s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    score = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh * (34 + score) / t
    return sbh * (10 + 24 / t + score / t)



# ---------------------------------------------------------------------------------- meshlm's Block

def minimal_block_bytes(d: int, ffn: int, heads: int, kv_heads: int, head_dim: int, tp: int = 1,
                        sp: bool = False, e: int = 2) -> float:
    """Bytes one eager Block saves per token of the sequence on one rank (docs/planner.md, "Saved set").

    With t = tp, d' = d/t under SP (else d), H = heads/t, q = H·head_dim, k = ceil(kv/t)·head_dim:
      norm inputs (block input x and the residual h): 2·e·d'; their rstd: 2·4·d'/d (fp32, per local token);
      norm outputs (inputs of wq/wk/wv and w1/w3; under SP the shard, gathered again in backward): 2·e·d';
      attention: q, k, v after RoPE (e·(q + 2k)), its output (also wo's input: e·q), log-sum-exp 4·H;
      SwiGLU: gate and up (2·e·ffn/t); the product and silu(gate) are rebuilt in backward.
    RoPE's cos/sin tables (4·head_dim per token) are shared by all blocks and counted once per forward."""
    t = tp
    dsp = d / t if (sp and t > 1) else d
    h = heads // t
    q, k = h * head_dim, ceil_div(kv_heads, t) * head_dim
    return 4 * e * dsp + 8 * dsp / d + e * (2 * q + 2 * k) + 4 * h + 2 * e * ffn / t


def block_activation_bytes(shape: Shape, tokens: float, seq_len: int, act_bytes: int, tp: int = 1,
                           sp: bool = False, ac: str = "none", flash: bool = True,
                           attn_math_bytes: int | None = None, compiled: bool = False, cp: int = 1,
                           cp_impl: str = "ring", recompute_gemms: tuple = ()) -> float:
    """Bytes one Block saves for backward on one rank, for `tokens` local tokens (micro_batch×seq/cp).

    none: `minimal_block_bytes` (the saved set of model/ops.py and the SP linears). The unfused math
    attention path (no flash kernel) keeps the softmax probabilities (m·H·S, m = attn_math_bytes)
    instead of the log-sum-exp. selective recomputes the attention core: its output stays saved (it is
    wo's input), only the log-sum-exp goes. op (per-op selective checkpointing of each block) keeps
    the block input and the outputs of the matmuls (q, k, v before RoPE, the attention output and its
    log-sum-exp, gate, up, and the wo / w2 outputs before their TP reduction, e·d each) and recomputes
    the norms, RoPE and the residual adds; under another framework's op policy the matmuls it runs
    again (`recompute_gemms`, estimate.Options) keep no output (torchtitan's: wk, wo, w3). full keeps
    the block input only (e·d').

    `compiled` (training.compile, fused attention, cp = 1): inductor's partitioner keeps the
    same set (the SwiGLU-down node is opaque to it, model/ops.py), except that under selective the
    recomputed core's output feeds wo directly (e·q less) and under op only one of the wo / w2 outputs
    is needed (e·d less; at tp = 1 only: with TP an op-checkpointed block holds collectives whose byte
    accounting dynamo will not trace inside a checkpoint, so parallelize leaves those blocks eager). Measured in tests/test_plan_compiled.py and tests/test_saved_set.py.

    Context parallelism (cp > 1) swaps the attention core for one that saves q, k, v, its output and
    the log-sum-exp whatever the kernel and AC mode (the ring's custom Function; Ulysses' inner fused
    attention), so the attention term is the fused one. Under Ulysses k and v count max(kv heads, cp)
    heads (kv heads fewer than cp are repeated before the all-to-all) and wo's input is the all-to-all's
    output, not a view of the attention output: one more e·d/t. Under allgather the attention saves
    the gathered k and v of the whole sequence (cp × the local ones). Selective AC leaves that core alone.
    MoE blocks (`_moe_bytes`): each routed copy keeps its gathered input, gate, up, silu(gate), the
    product (4·e·F'/t; 3 under selective), the expert's output and, eager, its gate-weighted copy; the
    router its scores and indices (`_routing_bytes`) and its gathered input (e·d) instead of the norm
    output shard. Measured against saved-tensor hooks in tests/test_plan_dsv3.py (MLA, sigmoid group
    routing, MTP) and, compiled, tests/test_plan_compiled.py.
    """
    a, t, e = shape.args, tp, act_bytes
    d = a.dim
    dsp = d / t if (sp and t > 1) else d
    if ac == "full":
        return tokens * e * dsp
    w = attn_widths(a, t)
    hq, dq = w.heads, w.q
    kvd = w.k
    f_local = a.ffn_dim / t
    compiled_core = compiled and flash and cp == 1 and not w.mla  # MoE blocks' attention too
    attn = _attention_saved(w, e, seq_len, ac, flash, compiled, attn_math_bytes, cp, cp_impl)
    if w.mla:  # the latents (replicated over tp), their norms' rstd; under SP the region's gathered input
        attn += e * w.latent_saved + 4 * (2 if a.q_lora_rank else 1) + (e * (d - dsp) if ac != "full" else 0)
    if ac == "op":  # block input; the matmul outputs (wo / w2 before their TP reduction: e·d each)
        norm, ffn = e * dsp, 2 * e * f_local + (1 if compiled_core and t == 1 else 2) * e * d
    else:
        norm, ffn = 4 * e * dsp + 8 * dsp / d, 2 * e * f_local  # norm inputs + outputs, rstd; gate, up
    if compiled_core and ac == "selective":
        attn -= e * dq  # the recomputed core's output is wo's input: not saved
    if ac == "op" and recompute_gemms:  # outputs recomputed, not kept (a CP core keeps its own q, k, v)
        width = {"wq": dq, "wk": kvd, "wv": kvd, "wo": d, "w1": f_local, "w3": f_local, "w2": d}
        outs = ("w1", "w3") + (("wo", "w2") if not (compiled_core and t == 1) else ())
        attn -= 0 if cp > 1 else e * sum(width[g] for g in recompute_gemms if g in ("wq", "wk", "wv"))
        ffn -= e * sum(width[g] for g in recompute_gemms if g in outs)
    if shape.moe:  # averaged over the blocks: MoE ones (moe.every, moe.first_dense) and dense ones
        ffn = frac_moe(a) * _moe_bytes(shape, e, d, dsp, t, ac, compiled) + (1 - frac_moe(a)) * ffn
    return tokens * (norm + attn + ffn)


def frac_moe(a) -> float:
    return a.n_moe_blocks / a.n_layers


def _moe_bytes(shape: Shape, e: int, d: int, dsp: float, t: int, ac: str, compiled: bool) -> float:
    """A MoE block's feed-forward saved bytes per token. Each routed copy keeps its gathered input and
    its experts' gate, up, silu(gate) and product (3 of them under selective, which recomputes the
    SwiGLU: parallel/model_plans/moe.py); eager weighs the experts' output in fp32 and keeps two copies of
    it (2·e·d at fp32; in bf16 two fp32 copies and one more e·d per token, not priced), a compiled
    combine (model/moe.py: routing and combining compiled, the experts eager) keeps the output as it
    is (e·d). Measured against the compiled graph's saved set in tests/test_plan_compiled.py; a block
    under op AC with TP stays eager."""
    a = shape.args
    x_local = a.expert_dim / t
    n_ffn = 3 if ac == "selective" else 4
    fused = compiled and not (ac == "op" and t > 1)
    per_copy = e * d + (e * d if fused else 2 * e * d) + n_ffn * e * x_local
    return _routing_bytes(a) + shape.top_k * shape.capacity_factor * per_copy \
        + shape.shared_experts * 2 * e * x_local + e * (d - dsp)


def _routing_bytes(a) -> float:
    """What a router keeps per token (model/moe.py): fp32 scores (4·E), the top-k indices and weights
    and their sorted copies (32·k + 4); DeepSeek-V3's path also each group's top-2 (int64) and the
    chosen-group mask (one byte per expert)."""
    plain = 4 * a.num_experts + 32 * a.top_k + 4
    return plain if a.plain_routing else plain + 4 + 16 * a.n_group + a.num_experts


def _attention_saved(w: AttnWidths, e: int, seq_len: int, ac: str, flash: bool, compiled: bool,
                     attn_math_bytes: int | None, cp: int, cp_impl: str) -> float:
    """Bytes per token the attention core and its projections' outputs keep: q, k, v, the output (wo's
    input) and the log-sum-exp (block_activation_bytes)."""
    hq = w.heads
    if cp > 1:
        if cp_impl == "ulysses":  # the all-to-all back makes wo's input a tensor of its own (+e·out)
            # its inner core is SDPA: without a fused kernel (a CPU with MLA's unequal head sizes) it
            # keeps the probabilities of its heads over the whole sequence
            lse = 4 * hq if flash else (attn_math_bytes or e) * hq * seq_len
            return e * (w.q + 2 * w.out + max(w.kv_heads, cp) * (w.qk + w.v_head)) + lse
        # ring: the local k, v; allgather: the gathered ones. MLA's values are padded to the key's size,
        # so the core's output is too, and wo's input is its cut copy
        v, out = (w.k, w.q + w.out) if w.mla else (w.v, w.out)
        return e * (w.q + out + (w.k + v) * (cp if cp_impl == "allgather" else 1)) + 4 * hq
    if ac == "selective":
        return e * (w.q + w.k + w.v + w.out)
    if flash or compiled or ac == "op":
        return e * (w.q + w.k + w.v + w.out) + 4 * hq
    m = attn_math_bytes or e  # the math path: k and v expanded to every query head, the probabilities
    return m * (w.q + hq * w.qk + hq * w.v_head) + m * hq * seq_len + e * w.out



@lru_cache(maxsize=65536)
def block_bytes_per_token(shape: Shape, seq_len: int, e: int, t: int, sp: bool, ac: str, flash: bool,
                          amb: int | None, compiled: bool = False, cp: int = 1, cp_impl: str = "ring",
                          recompute_gemms: tuple = ()) -> float:
    """block_activation_bytes per local token, cached: the search asks for the same few shapes often."""
    return block_activation_bytes(shape, 1.0, seq_len, e, t, sp, ac, flash, amb, compiled, cp, cp_impl,
                                  recompute_gemms)



@lru_cache(maxsize=16384)
def block_bytes_all_ac(shape: Shape, seq_len: int, e: int, t: int, sp: bool, flash: bool, amb: int | None,
                       compiled: bool, cp: int, cp_impl: str, recompute_gemms: tuple) -> tuple[float, ...]:
    """block_bytes_per_token under each of choices.AC_MODES, in their order: what one rank's memory
    needs for every AC mode at once (memory.stage_memory)."""
    return tuple(block_bytes_per_token(shape, seq_len, e, t, sp, ac, flash, amb, compiled, cp, cp_impl,
                                       recompute_gemms) for ac in AC_MODES)


def head_bytes(a, t: int, dsp: float, e: int, compiled: bool, chunks: int = 0) -> tuple[float, float]:
    """(saved, loss backward buffer) bytes per local token of the final norm, the head and the loss.
    Eager: the norm's input and rstd, the head input (under SP the shard, gathered again in backward),
    the fp32 log-probs (real ids
    only) and the target ids; backward holds fp32 grads of the log-probs and of the (padded) logits.
    A compiled loss (tp = 1; the vocab-parallel one has collectives and stays eager) saves the logits
    in the compute dtype plus two fp32 statistics per token, and its backward writes only the logits'
    gradient in the compute dtype. A chunked loss (training.loss_chunks > 0) saves no logits: one
    chunk's fp32 logits and their gradient are alive at a time, made again in backward."""
    norm_head = 2 * e * dsp + 4 * dsp / a.dim + 8
    if chunks > 0:
        return norm_head, 8 * vocab_rows(a, t) / chunks
    if compiled and t == 1:
        return norm_head + e * vocab_rows(a, t) + 8, e * vocab_rows(a, t)
    return norm_head + 4 * vocab_real(a, t), (vocab_real(a, t) + vocab_rows(a, t)) * 4


def dense_mask_bytes(micro_batch: int, seq_len: int, attn_mask: str = "dense", cp: int = 1,
                     cp_impl: str = "ring") -> float:
    """The boolean mask SDPA is given, held for the micro-batch's forward and backward: the [B, 1, S, S]
    document mask (model.attn_impl = "sdpa"); under allgather CP its rows are this rank's S/cp queries,
    and without documents the core's causal rows [S/cp, S] (shared by the batch). Flex's BlockMask is a
    few index tensors per block row; other causal attention takes no mask."""
    rows = seq_len / cp if cp > 1 and cp_impl == "allgather" else seq_len
    if attn_mask == "dense":
        return float(micro_batch) * rows * seq_len
    return rows * seq_len if attn_mask == "rows" else 0.0


def saved_mask_bytes(micro_batch: int, seq_len: int, attn_mask: str, cp: int, cp_impl: str, ac: str,
                     e: int) -> float:
    """Bytes of mask one block saves per micro-batch: SDPA turns a boolean mask into an additive one in
    the activation dtype on every call and keeps it for backward (seen in a saved-tensor probe of the
    all-gather core, bench/cp.py), so each block holds its own e-byte copy of the rows it attends
    (rows × S per sequence, a document mask; all-gather CP: this rank's S/cp rows, and without documents
    one [S/cp, S] for the batch, "rows"). None where the core is recomputed."""
    if attn_mask not in ("dense", "rows") or ac == "full" or (cp == 1 and ac == "selective"):
        return 0.0
    rows = seq_len / cp if cp > 1 and cp_impl == "allgather" else seq_len
    return float(e) * (micro_batch if attn_mask == "dense" else 1) * rows * seq_len


def cp_buffer_bytes(a, t: int, cp: int, impl: str, e: int) -> float:
    """Transient bytes per local token of one CP attention core in backward (the larger pass). Ring:
    the k,v block held and the one arriving (4·e·kv), the fp32 dk,dv accumulator held and arriving
    (16·kv) and the fp32 dq (4·q). Ulysses: send and receive buffers of q, k, v (2·e·(q + 2·kv')).
    Allgather: dk,dv of the whole sequence and their rank-order copy for the reduce-scatter (2·2·e·c·kv)
    and its output (2·e·kv)."""
    w = attn_widths(a, t)
    kvd, dq = w.k, w.q  # MLA under ring / allgather: values padded to the key's width, as wide as k
    if impl == "ring":
        return (4 * e + 16) * kvd + 4 * dq
    if impl == "allgather":
        return 2 * e * kvd * (2 * cp + 1)
    return 2 * e * (dq + max(w.kv_heads, cp) * (w.qk + w.v_head))
