"""Bytes per GPU for one layout, for the worst pipeline stage (not an average).

Conventions (they are how the trainer reports `mem.*`, so prediction and measurement compare):
Ψ_local is the rank's share of the parameters. fp32: params 4Ψ, grads 4Ψ, optim 8Ψ (Adam m, v; the
fp32 master is the parameter). bf16/fp16: params 2Ψ (compute copy), grads 4Ψ (fp32, reduced in fp32),
optim 12Ψ (fp32 master + m + v). ZeRO-1 shards optim, ZeRO-2 also grads, ZeRO-3 also params over the
shard group. Activations follow the tensors that meshlm's Block really saves for backward (checked
against saved-tensor hooks in tests/test_plan.py); `korthikanti_block_bytes` keeps the textbook GPT
formula for comparison.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..model.args import padded_vocab
from ..schedule.actions import stage_index
from ..schedule.stage import estimate_costs, partition
from ..choices import AC_MODES, HELD
from .spec import Shape, Spec
from .volume import packed_bytes

MIB = 2 ** 20


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def vocab_rows(args, tp: int) -> int:
    """Embedding / head rows on one TP rank: the vocabulary padded as the runtime pads it, split by tp."""
    return padded_vocab(args.vocab_size, args.vocab_multiple, tp) // tp


def vocab_real(args, tp: int) -> int:
    """Real (unpadded) ids in the largest rank's slice: the logits the loss keeps and saves."""
    return min(vocab_rows(args, tp), args.vocab_size)


# ---------------------------------------------------------------------------------- textbook formulas

def zero_state_bytes(psi: float, n_shard: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                     optim_bytes: float = 12) -> dict:
    """Model states per GPU under ZeRO (Rajbhandari et al.): (2 + 2 + K)Ψ with stage-wise sharding.

    The paper's defaults are fp16 params and grads and K = 12 (fp32 master, m, v); meshlm's own
    convention is param_bytes = 2, grad_bytes = 4, optim_bytes = 12 (bf16) or 4, 4, 8 (fp32).
    """
    p = param_bytes * psi / (n_shard if stage >= 3 else 1)
    g = grad_bytes * psi / (n_shard if stage >= 2 else 1)
    o = optim_bytes * psi / (n_shard if stage >= 1 else 1)
    return {"params": p, "grads": g, "optim": o, "total": p + g + o}


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(params, grads, optim) bytes per parameter in meshlm's convention (choices.HELD)."""
    h = HELD[precision]
    return h.param, h.grad, h.optim


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
    q, k = h * head_dim, _ceil(kv_heads, t) * head_dim
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

    `compiled` (training.compile, fused attention, dense FFN, cp = 1): inductor's partitioner keeps the
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
    MoE blocks: the routed experts keep gate, up, silu(gate) and the product (4·e·F'/t, 3 under
    selective) for each routed copy, the router its gathered input (e·d) instead of the norm output
    shard. Measured against saved-tensor hooks in tests/test_plan_vs_measured.py.
    """
    a, t, e = shape.args, tp, act_bytes
    d = a.dim
    dsp = d / t if (sp and t > 1) else d
    if ac == "full":
        return tokens * e * dsp
    hq = a.n_heads // t
    dq = hq * a.head_dim
    kvd = _ceil(a.n_kv_heads, t) * a.head_dim
    f_local = a.ffn_dim / t
    compiled_core = compiled and flash and not shape.moe and cp == 1
    if cp > 1:
        if cp_impl == "ulysses":  # the all-to-all back makes wo's input a tensor of its own (+e·q)
            attn = e * (3 * dq + 2 * max(_ceil(a.n_kv_heads, t), cp) * a.head_dim) + 4 * hq
        else:  # ring: the local k, v; allgather: the gathered ones
            attn = e * (2 * dq + 2 * kvd * (cp if cp_impl == "allgather" else 1)) + 4 * hq
    elif ac == "selective":
        attn = e * (2 * dq + 2 * kvd)
    elif flash or compiled or ac == "op":
        attn = e * (2 * dq + 2 * kvd) + 4 * hq
    else:
        m = attn_math_bytes or e
        attn = 3 * m * dq + m * hq * seq_len + e * dq
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
        x_local, frac = a.expert_dim / t, a.n_moe_blocks / a.n_layers
        n_ffn = 3 if ac == "selective" else 4
        routed = shape.top_k * shape.capacity_factor
        moe = 4 * shape.num_experts + routed * (2 * e * d + n_ffn * e * x_local) \
            + shape.shared_experts * 2 * e * x_local + e * (d - dsp)
        ffn = frac * moe + (1 - frac) * ffn
    return tokens * (norm + attn + ffn)


# ---------------------------------------------------------------------------------- parameters

@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds on a stage: `dense` shards over the ZeRO group, `expert` over
    zero_group/ep; `unit` is the largest piece ZeRO-3 gathers at once (a block or the embedding)."""
    dense: float
    expert: float
    unit: float
    layers: int
    embed: bool
    head: bool
    chunks: tuple = ()   # blocks of each local chunk, in chunk order
    rank: int = 0


def block_params_local(shape: Shape, tp: int, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of one Block on one TP rank. Norms are replicated; kv heads are
    replicated when tp exceeds them; experts are split over ep and, like the dense FFN, over tp."""
    a = shape.args
    attn = a.dim * a.head_dim * 2 * (a.n_heads // tp) + a.dim * a.head_dim * 2 * _ceil(a.n_kv_heads, tp)
    mlp = 3 * a.dim * a.ffn_dim / tp
    if shape.moe:  # per block, averaged over MoE and dense blocks (moe.every, moe.first_dense)
        frac, xmlp = a.n_moe_blocks / a.n_layers, 3 * a.dim * a.expert_dim / tp
        dense = attn + 2 * a.dim + frac * (shape.shared_experts * xmlp + a.dim * shape.num_experts) \
            + (1 - frac) * mlp
        return dense, frac * _ceil(shape.num_experts, ep) * xmlp
    return attn + 2 * a.dim + mlp, 0.0


def pipeline_roles(pp: int) -> tuple[str, ...]:
    """The ranks the planner sizes: the first and the last, and with pp >= 3 the middle rank holding
    the most blocks (it sets the pace when the end stages are given fewer blocks)."""
    return ("only",) if pp == 1 else ("first", "last") if pp == 2 else ("first", "last", "middle")


@lru_cache(maxsize=4096)
def stage_chunks(a, pp: int, v: int, stage: str, schedule: str = "1f1b",
                 pp_layers: tuple = ()) -> tuple[int, tuple[int, ...], bool, bool]:
    """(rank, blocks per local chunk, holds the embedding, holds the head) for a planner role, split
    exactly as the runtime splits the blocks (schedule/stage.py: the head costs vocab·dim,
    so the last stage gets fewer blocks; `pp_layers` overrides) and placed as the schedule places
    them (ZB-V's V puts the first and the last stage on rank 0). Layer counts that cannot be split
    fall back to ceil(L/(pp·v)) per chunk; check() reports them."""
    if pp == 1:
        return 0, (a.n_layers,), True, True
    S, vs = pp * v, schedule == "zbv"
    try:
        blocks = [len(b) for b in partition(a.n_layers, S, estimate_costs(
            a.dim, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size), list(pp_layers) or None)]
    except ValueError:
        blocks = [_ceil(a.n_layers, S)] * S

    def held(r: int) -> list[int]:
        return [stage_index(r, c, pp, vs) for c in range(v)]

    if stage == "middle":
        rank = max(range(1, pp - 1), key=lambda r: (sum(blocks[s] for s in held(r)), -r))
    else:
        rank = pp - 1 if stage == "last" else 0
    mine = held(rank)
    return rank, tuple(blocks[s] for s in mine), 0 in mine, S - 1 in mine


def stage_layers(a, pp: int, v: int, stage: str, schedule: str = "1f1b", pp_layers: tuple = ()) -> int:
    """Blocks on one planner role's rank over its v chunks (`stage_chunks`)."""
    return sum(stage_chunks(a, pp, v, stage, schedule, tuple(pp_layers))[1])


def stage_params(shape: Shape, s: Spec, stage: str) -> StageParams:
    """stage: 'first', 'last' or 'only' (pp = 1). The first and the last rank hold the blocks the runtime
    gives them (`stage_layers`). Tied embeddings are stored once with pp = 1 and on both end stages
    otherwise."""
    a = shape.args
    rank, chunks, embed, head = stage_chunks(a, s.pp, s.pp_virtual, stage, s.pp_schedule, s.pp_layers)
    layers = sum(chunks)
    dense_blk, exp_blk = block_params_local(shape, s.tp, s.ep)
    emb = vocab_rows(a, s.tp) * a.dim
    dense = layers * dense_blk
    if embed:
        dense += emb
    if head:
        dense += a.dim
        if not (a.tie_embeddings and embed):
            dense += emb
    unit = max(dense_blk + exp_blk, emb if (embed or head) else 0)
    return StageParams(dense, layers * exp_blk, unit, layers, embed, head, chunks, rank)


def held_layers(schedule: str, p: int, m: int, v: int, rank: int, chunks: tuple) -> float:
    """Block-activations (in blocks × micro-batches) a rank holds at its peak: `inflight` times its
    blocks, except ZB-V's rank 0, whose loss-stage chunk holds one micro-batch (its W runs first,
    schedules.py) while the chunk of stage 0 holds up to 2p (an upper bound: the two peaks need
    not coincide)."""
    if schedule == "zbv" and p > 1 and rank == 0:
        return min(2 * p, m) * chunks[0] + chunks[1]
    return inflight(schedule, p, m, v, rank) * sum(chunks)


def inflight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations rank `rank` holds at its peak, in units of all its layers.

    gpipe: m; 1f1b and zb-h1: min(p - rank, m); interleaved (Megatron): (warm-up chunks + 1)/v =
    p + (p-1)/v on rank 0, the (1 + (p-1)/(p·v)) penalty of Korthikanti et al.; zbv: min(p, m) on
    every rank (2p half-size chunks, checked against the built schedule in tests/test_plan.py)."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) / v
    if schedule == "zbv":
        return float(min(p, m))
    return float(min(p - rank, m))


@lru_cache(maxsize=65536)
def _per_token(shape: Shape, seq_len: int, e: int, t: int, sp: bool, ac: str, flash: bool,
               amb: int | None, compiled: bool = False, cp: int = 1, cp_impl: str = "ring",
               recompute_gemms: tuple = ()) -> float:
    return block_activation_bytes(shape, 1.0, seq_len, e, t, sp, ac, flash, amb, compiled, cp, cp_impl,
                                  recompute_gemms)


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
    kvd = _ceil(a.n_kv_heads, t) * a.head_dim
    dq = a.n_heads // t * a.head_dim
    if impl == "ring":
        return (4 * e + 16) * kvd + 4 * dq
    if impl == "allgather":
        return 2 * e * kvd * (2 * cp + 1)
    return 2 * e * (dq + 2 * max(_ceil(a.n_kv_heads, t), cp) * a.head_dim)


def _stage_static(shape: Shape, s: Spec, stage: str) -> tuple:
    n = s.zero_group * s.cp if s.zero else 1  # ZeRO shards over dp_shard×cp
    return _static(shape, stage, s.tp, s.pp, s.pp_virtual, s.ep, s.zero, n, s.dp * s.cp > 1, s.bucket_mb,
                   s.precision, s.pp_schedule, s.pp_layers)


@lru_cache(maxsize=65536)
def _static(shape: Shape, stage: str, tp: int, pp: int, v: int, ep: int, zero: int, n: int, multi: bool,
            bucket_mb: float, precision: str, schedule: str = "1f1b", pp_layers: tuple = ()) -> tuple:
    """Everything about a stage that does not depend on micro-batch size or AC."""
    sp = _stage_params_cached(shape, Spec(tp=tp, pp=pp, pp_virtual=v, ep=ep, pp_schedule=schedule,
                                          pp_layers=pp_layers), stage)
    pb, gb, ob = state_bytes_per_param(precision)
    ne = max(1, n // ep)
    params = pb * (sp.dense / (n if zero >= 3 else 1) + sp.expert / (ne if zero >= 3 else 1))
    grads = gb * (sp.dense / (n if zero >= 2 else 1) + sp.expert / (ne if zero >= 2 else 1))
    optim = ob * (sp.dense / (n if zero >= 1 else 1) + sp.expert / (ne if zero >= 1 else 1))
    if zero >= 3 and n > 1:
        fixed_buf = ("zero3_gather", sp.unit * (2 * pb + gb))
    elif multi:
        fixed_buf = ("grad_buckets", 2 * bucket_mb * MIB)
    else:
        fixed_buf = None
    return sp, params, grads, optim, fixed_buf


@lru_cache(maxsize=4096)
def _stage_params_cached(shape: Shape, key: Spec, stage: str) -> StageParams:
    return stage_params(shape, key, stage)


def stage_memory(shape: Shape, s: Spec, stage: str, flash: bool = True,
                 attn_math_bytes: int | None = None, detail: bool = True, compiled: bool = False,
                 loss_chunks: int = 0, attn_mask: str = "causal", recompute_gemms: tuple = ()) -> dict:
    """Bytes on one rank of `stage` ('first', 'last' or 'only'): the per_gpu breakdown plus details."""
    a = shape.args
    e = HELD[s.precision].act
    sp, params, grads, optim, fixed_buf = _stage_static(shape, s, stage)
    cpu_optim = disk_optim = 0.0
    if s.offload == "optimizer":
        # Host memory holds a separate fp32 master (the device keeps the compute copy), Adam's m and v,
        # and an fp32 staging buffer for the gradient shard: 16 bytes per sharded parameter.
        cpu_optim, optim = optim * 16 / state_bytes_per_param(s.precision)[2], 0.0
    elif s.offload == "nvme":
        cpu_optim, disk_optim = nvme_bytes(optim / state_bytes_per_param(s.precision)[2], s.offload_buffer_mb)
        optim = 0.0

    tokens = s.micro_batch * s.seq_len / s.cp
    t, sq = s.tp, (s.sp and s.tp > 1)
    dsp = a.dim / t if sq else a.dim
    blk_tok = _per_token(shape, s.seq_len, e, t, sq, s.ac, flash, attn_math_bytes, compiled, s.cp, s.cp_impl,
                         recompute_gemms)
    blk = blk_tok * tokens + saved_mask_bytes(s.micro_batch, s.seq_len, attn_mask, s.cp, s.cp_impl, s.ac, e)
    units = inflight(s.pp_schedule, s.pp, s.accum, s.pp_virtual, sp.rank)
    acts = held_layers(s.pp_schedule, s.pp, s.accum, s.pp_virtual, sp.rank, sp.chunks) * blk
    if sp.embed:
        acts += units * tokens * 8  # token ids kept by the embedding backward
    head_saved, loss_buf = head_bytes(a, t, dsp, e, compiled, loss_chunks)
    if sp.head:
        head_units = s.accum if (s.pp > 1 and s.pp_schedule == "gpipe") else 1
        acts += head_units * tokens * head_saved

    buffers: dict[str, float] = {}
    # Backward of one block: full AC first recomputes all of its activations; otherwise gradient
    # temporaries take about half a block's worth while its saved tensors are being released.
    blk_none = blk if s.ac == "none" else tokens * _per_token(shape, s.seq_len, e, t, sq, "none", flash,
                                                              attn_math_bytes, compiled, s.cp, s.cp_impl) \
        + saved_mask_bytes(s.micro_batch, s.seq_len, attn_mask, s.cp, s.cp_impl, "none", e)
    buffers["backward_working"] = blk_none * (1.0 if s.ac == "full" else 0.5)
    if sp.head:
        buffers["loss"] = tokens * loss_buf
    if fixed_buf:
        buffers[fixed_buf[0]] = fixed_buf[1]
    if s.zero >= 3 and s.hpz_group:  # ZeRO++ hpZ: 1/K of every unit, held from its first gather to the step
        buffers["hpz_secondary"] = state_bytes_per_param(s.precision)[0] * (sp.dense + sp.expert) / s.hpz_group
    if s.zero >= 3 and s.quantize_weights:  # qwZ: the int8 rows of one unit's gather
        buffers["qwz_int8"] = packed_bytes(int(sp.unit))
    mask = dense_mask_bytes(s.micro_batch, s.seq_len, attn_mask, s.cp, s.cp_impl)
    if mask:
        buffers["attn_mask"] = mask
    if s.optim == "muon":  # optim.name = "muon" (plan/muon.py)
        delta, buffers["muon"] = muon_memory(shape, s, sp.layers)
        optim += delta
    if t > 1:
        buffers["tp"] = 2 * e * a.dim * tokens
    if s.pp > 1:
        buffers["pp_p2p"] = 4 * e * dsp * tokens
    if s.cp > 1:
        buffers["cp"] = cp_buffer_bytes(a, t, s.cp, s.cp_impl, e) * tokens
    if s.ep > 1:
        buffers["ep_all_to_all"] = 2 * shape.top_k * shape.capacity_factor * e * a.dim * tokens
    buf = sum(buffers.values())
    total = params + grads + optim + acts + buf
    out = {"params": params, "grads": grads, "optim": optim, "activations": acts, "buffers": buf,
           "total": total, "cpu_optim": cpu_optim, "disk_optim": disk_optim}
    if detail:
        out["detail"] = {"stage": stage, "layers": sp.layers, "params_local": sp.dense + sp.expert,
                         "block_activation_bytes": blk, "inflight_microbatches": units, "buffers": buffers,
                         "shard_group": s.zero_group * s.cp if s.zero else 1}
    return out


def nvme_bytes(shard_params: float, buffer_mb: float) -> tuple[float, float]:
    """offload = "nvme" (parallel/optim/nvme.py): (host, disk) bytes for `shard_params` sharded parameters.
    Disk: fp32 master, m and v, 12 B each. Host: the streaming buffer, three slots of master, m, v and an
    fp32 gradient staging chunk (16 B per element), never more than the state needs."""
    return min(buffer_mb * MIB, 3 * 16 * shard_params), 12 * shard_params


def stage_totals(shape: Shape, stage: str, tp: int, sp: bool, cp: int, pp: int, v: int, ep: int, zero: int,
                 n: int, dp: int, mb: int, accum: int, schedule: str, seq_len: int, precision: str,
                 cp_impl: str = "ring", bucket_mb: float = 25.0, flash: bool = True,
                 amb: int | None = None, compiled: bool = False,
                 pp_layers: tuple = (), loss_chunks: int = 0,
                 attn_mask: str = "causal", optimizer: str = "adamw",
                 recompute_gemms: tuple = ()) -> tuple[float, float, dict[str, float]]:
    """The same totals as stage_memory, split for the search: (bytes that depend on neither AC nor
    offload, optimizer-state bytes, {ac: activation + backward working-set bytes}). Kept lean because
    the search calls it for every candidate; tests check it against stage_memory. `optimizer`: optim.name."""
    a = shape.args
    e = HELD[precision].act
    spp, params, grads, optim, fixed_buf = _static(shape, stage, tp, pp, v, ep, zero, n * cp if zero else 1,
                                                  dp * cp > 1, bucket_mb, precision, schedule, pp_layers)
    tokens = mb * seq_len / cp
    sq = sp and tp > 1
    dsp = a.dim / tp if sq else a.dim
    units = inflight(schedule, pp, accum, v, spp.rank)
    base = params + grads + (fixed_buf[1] if fixed_buf else 0.0)
    if spp.embed:
        base += units * tokens * 8
    if spp.head:
        head_units = accum if (pp > 1 and schedule == "gpipe") else 1
        head_saved, loss_buf = head_bytes(a, tp, dsp, e, compiled, loss_chunks)
        base += head_units * tokens * head_saved + tokens * loss_buf
    base += dense_mask_bytes(mb, seq_len, attn_mask, cp, cp_impl)
    if optimizer == "muon":
        delta, buf = muon_memory(shape, Spec(dp=dp, tp=tp, cp=cp, ep=ep, zero=zero, zero_group=n, bucket_mb=bucket_mb),
                                 spp.layers)
        optim_bytes, base = optim + delta, base + buf
    else:
        optim_bytes = optim
    if tp > 1:
        base += 2 * e * a.dim * tokens
    if pp > 1:
        base += 4 * e * dsp * tokens
    if cp > 1:
        base += cp_buffer_bytes(a, tp, cp, cp_impl, e) * tokens
    if ep > 1:
        base += 2 * shape.top_k * shape.capacity_factor * e * a.dim * tokens
    def block(ac: str) -> float:
        return _per_token(shape, seq_len, e, tp, sq, ac, flash, amb, compiled, cp, cp_impl, recompute_gemms) * tokens \
            + saved_mask_bytes(mb, seq_len, attn_mask, cp, cp_impl, ac, e)
    none = block("none")
    scale = held_layers(schedule, pp, accum, v, spp.rank, spp.chunks)
    acts = {ac: block(ac) * scale + none * (1.0 if ac == "full" else 0.5) for ac in AC_MODES}
    return base, optim_bytes, acts


def memory(shape: Shape, s: Spec, flash: bool = True, attn_math_bytes: int | None = None,
           compiled: bool = False) -> dict:
    """The worst rank's breakdown (largest total over the first and the last stage)."""
    best = None
    for st in pipeline_roles(s.pp):
        m = stage_memory(shape, s, st, flash, attn_math_bytes, compiled=compiled)
        if best is None or m["total"] > best["total"]:
            best = m
    return best


# -- optim.name = "muon" (plan/muon.py prices its time and traffic) --------------------------------
def block_matrices(shape: Shape, ep: int = 1) -> list[tuple[int, int, float]]:
    """(rows, cols, matrices per block on one rank) of Muon's matrices, whole (before TP); MoE blocks
    averaged over the blocks as `memory.block_params_local` does; experts split over ep."""
    a = shape.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    out = [(q, a.dim, 1.0), (kv, a.dim, 2.0), (a.dim, q, 1.0)]
    frac = a.n_moe_blocks / a.n_layers if shape.moe else 0.0
    if frac < 1:
        out += [(a.ffn_dim, a.dim, 2 * (1 - frac)), (a.dim, a.ffn_dim, 1 - frac)]
    if frac > 0:
        experts = -(-shape.num_experts // ep) + shape.shared_experts
        out += [(a.expert_dim, a.dim, 2 * frac * experts), (a.dim, a.expert_dim, frac * experts)]
    return out


def muon_shard_group(s: Spec) -> int:
    return s.zero_group * s.cp if s.zero else 1  # ZeRO shards over dp_shard×cp


def muon_memory(shape: Shape, s: Spec, layers: int) -> tuple[float, float]:
    """(optimizer-state bytes added, negative when saved; transient buffer bytes) on a rank holding
    `layers` blocks."""
    mats = block_matrices(shape, s.ep)
    block = sum(r * c * k for r, c, k in mats) / s.tp  # one block's Muon elements on this TP rank
    n = muon_shard_group(s)
    state = -4 * layers * block / n  # one momentum for Adam's two moments, on this rank's shard under ZeRO
    r, c, batch = _largest_matrix(mats)
    m = min(r, c)
    buf = 4 * batch * (2 * r * c + 2 * m * m)
    if s.zero and n > 1:  # a block's pieces to their owners (its shard) and the owner's matrices (>= the largest)
        buf += 4 * (block / n + max(block / n, batch * r * c / s.tp))
    if s.tp > 1:  # the owner exchange over tp: this rank's slices, its owned matrices' (under ZeRO a block's)
        buf += 8 * block / n if s.zero and n > 1 else muon_tp_bucket_bytes(shape, s, layers)
    return state, buf


def _largest_matrix(mats: list[tuple[int, int, float]]) -> tuple[int, int, float]:
    """(rows, cols, batch) of the largest tensor NS runs on: stacked experts are orthogonalised together."""
    r, c, k = max(mats, key=lambda x: x[0] * x[1] * (x[2] if x[2] > 2 else 1))
    return r, c, k if k > 2 else 1


@lru_cache(maxsize=4096)
def muon_tp_buckets(shape: Shape, tp: int, ep: int, bucket_mb: float, layers: int) -> int:
    """Without ZeRO: how many buckets the tp owner exchange packs a step's split matrices into, filling
    each to max(bucket_mb, the largest slice) in block order (the runtime's receive limit left out)."""
    mats = block_matrices(shape, ep)
    sizes = [r * c / tp for r, c, k in mats for _ in range(max(1, round(k)))] * layers
    cap, out, at = max(bucket_mb * MIB / 4, max(sizes)), 1, 0.0
    for sz in sizes:
        if at and at + sz > cap:
            out, at = out + 1, 0.0
        at += sz
    return out


def muon_tp_bucket_bytes(shape: Shape, s: Spec, layers: int) -> float:
    """Without ZeRO: the largest bucket of the tp owner exchange (parallel/optim/muon.py `buckets`), its send
    buffer (this rank's slices: within max(bucket_mb, the largest slice), at most the step's) and its
    receive buffer (the whole matrices this rank owns: within max(bucket_mb, the largest matrix), at
    most about the step's share, a slice per matrix, plus one matrix), fp32."""
    mats = block_matrices(shape, s.ep)
    step = layers * sum(r * c * k for r, c, k in mats) / s.tp
    r, c, batch = _largest_matrix(mats)
    whole, cap = batch * r * c, s.bucket_mb * MIB / 4
    return 4 * (min(step, max(cap, whole / s.tp)) + min(step + whole, max(cap, whole)))
