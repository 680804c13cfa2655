"""What tensor and context parallelism send: one set of formulas for the planner (plan/cost/comm.py prices
them), the runtime's byte checks (Comm's books equal them exactly: tests/test_tp.py, tests/test_cp.py)
and the docs (docs/tensor_parallel.md, docs/context_parallel.md).

Each function gives one rank's traffic per micro-batch as (kind, calls, buffer bytes) rows; `booked`
turns them into what `Comm` books per step (an all-reduce 2× its buffer, an all-gather its output,
a reduce-scatter its input, a send its tensor: sends and receives booked apart, equal).
"""
from __future__ import annotations

from functools import lru_cache

from ...core.facts.quant import packed_bytes
from .attn_widths import attn_widths

Traffic = list[tuple[str, float, float]]


def tp_traffic(args, tokens: float, layers: float, first: bool, last: bool, sp: bool, ac: str, act_bytes: int,
               param_bytes: int = 4, moe_ffn: float = 0.0, seq_len: int = 0, fp8: frozenset | None = None) -> Traffic:
    """One tensor-parallel rank of a stage holding `layers` blocks (`first`: the embedding, `last`: the
    head and loss), `tokens` per micro-batch on this rank's sequence (before SP's split).

    Entering a TP region (each block half, the head) reduces in backward, leaving one (each block half,
    the embedding) in forward. Full or op-level AC reruns each block's forward in backward, entering
    both halves again but leaving only the attention half (torch's checkpoint stops once w2's input is
    rebuilt). SP turns each into an all-gather / reduce-scatter of the same volume, and backward entries
    re-gather the shard the column-parallel linears saved (not a MoE block's FFN, `moe_ffn` of them:
    its experts read routed tokens, so its entry gathers unfused; nor MLA's attention, whose latent
    projections are replicated: the entry gathers by a hook and keeps the whole input). The vocab-parallel loss adds a max
    and a (sum-exp, target-logit) all-reduce of fp32 [tokens]; SP one gain-gradient all-reduce per norm,
    kv replicas (tp > kv heads) one per wk/wv, q/k norms one per gain.

    MTP modules (model.mtp_depth, on the stage holding the head; `layers` counts their blocks) embed
    the tokens ahead (leaving the embedding's region again), run the head again (entering it), and
    their losses cover the positions that have a target k + 1 ahead (tokens · (seq_len − k) / seq_len,
    `seq_len` needed then); under SP their projection reads the residual stream (its gradient summed)
    and their three norms (two inputs, the head's) are sequence-split like the others.

    fp8 (`fp8`: the training.fp8_comm entries in use, layout.fp8_comm_in_use; None: another precision):
    under SP every block region's entry gathers by a hook and keeps what it gathered, so nothing is
    re-gathered but the head's input; with "sp" the entries whose readers all multiply in float8 (a
    dense attention's, a dense FFN's: not MLA's latent projections, not a MoE block's router) gather one
    byte an element after one all-reduce of their fp32 amax ("all_reduce_amax"). Docs: docs/fp8.md."""
    act = act_bytes * tokens * args.dim
    mtp = args.mtp_depth if last else 0
    heads = (1 + mtp) if last else 0
    entries, leaves = 2 * layers + heads, 2 * layers + first + mtp
    full = ac in ("full", "op")
    again_in, again_out = (2 * (layers - mtp), layers - mtp) if full else (0, 0)  # MTP blocks are not rerun
    out: Traffic = []
    if sp and fp8 is not None:
        f8 = (layers - moe_ffn + (0 if args.mla else layers)) if "sp" in fp8 else 0
        f8_again = f8 * again_in / (2 * layers) if layers else 0
        out.append(("all_gather", entries + leaves + heads + again_in - f8 - f8_again, act))
        if f8:
            out.append(("all_gather", f8 + f8_again, act / act_bytes))
            out.append(("all_reduce_amax", f8 + f8_again, 4))
    if sp and fp8 is None:
        regather = 2 * layers - moe_ffn - (layers if args.mla else 0) + heads  # MLA's entry gathers whole
        out.append(("all_gather", entries + leaves + regather + again_in, act))
    if sp:
        out.append(("reduce_scatter", leaves + entries + again_out, act))
        out.append(("all_reduce", 2 * layers + last + 3 * mtp, param_bytes * args.dim))  # norm gains' gradients
        out += [("all_reduce", mtp, param_bytes * 2 * args.dim * args.dim)] if mtp else []  # MTP projections
    else:
        out.append(("all_reduce", entries + leaves + again_out, act))
    for k in range(heads):
        rows = tokens if k == 0 else tokens * (seq_len - k) / seq_len
        out.append(("all_reduce", 1, 4 * rows))  # max logit
        out.append(("all_reduce", 1, 8 * rows))  # sum-exp and target logit
    return out


def tp_weight_traffic(args, tp: int, layers: float, param_bytes: int = 4, moe_layers: float = 0.0) -> Traffic:
    """Gradient all-reduces of weights replicated inside the TP group, per micro-batch: wk, wv (and their
    biases) when tp > kv heads, Qwen3's q/k norm gains; MLA's latent down-projections (wq_a, wkv_a) and
    their norms' gains (attn_widths.replicated); each MoE block's router (`moe_layers` of the blocks)."""
    out: Traffic = [("all_reduce", layers, param_bytes * n) for _, n in attn_widths(args, tp).replicated]
    if moe_layers and tp > 1:
        out.append(("all_reduce", moe_layers, param_bytes * args.dim * args.num_experts))
    if tp > args.n_kv_heads and args.qkv_bias:
        out.append(("all_reduce", 2 * layers, param_bytes * args.n_kv_heads * args.head_dim))
    if args.qk_norm:
        out.append(("all_reduce", 2 * layers, param_bytes * args.head_dim))
    if args.mla and tp > 1:
        out += [("all_reduce", layers, param_bytes * n) for n in (args.q_lora_rank, args.kv_lora_rank) if n]
    return out


def cp_traffic(args, tokens: float, layers: float, cp: int, impl: str, tp: int, ac: str, act_bytes: int,
               last: bool = False) -> Traffic:
    """One context-parallel rank, `tokens` = its local tokens per micro-batch, kv = kv heads per TP rank ×
    head_dim, q likewise:
      ring: forward (c-1) sends of k,v (2·e·T·kv each); backward (c-1) again and c sends of the fp32
            gradient accumulators dk,dv (2·4·T·kv); full AC runs the forward again.
      ulysses: all-to-alls of q, k, v and the output (e·T·(2q + 2kv')/4 each, kv' = max(kv heads, c) ×
            head_dim: kv heads are repeated up to c), forward and backward; full AC adds a forward.
      allgather: forward an all-gather of k,v (output c·2·e·T·kv), backward a reduce-scatter of dk,dv in
            the activation dtype (input c·2·e·T·kv); full AC gathers again. Document masking adds one
            all-gather of the int64 document ids per forward of a stage (8·c·T), not counted here.
    MTP modules (`last`: the stage holds them, `layers` counts their blocks) are never recomputed and
    all-gather the micro-batch's targets (int64, 8·c·T): the tokens ahead of a chunk's end."""
    if cp == 1:
        return []
    mtp = args.mtp_depth if last else 0
    rerun = layers - mtp if ac == "full" else 0  # blocks whose forward full AC runs again
    w = attn_widths(args, tp)
    kv = 2 * act_bytes * tokens * w.k  # k and v stacked; MLA's values padded to the key's width
    out: Traffic = [("all_gather", 1, 8 * cp * tokens)] if mtp else []
    if impl == "ring":
        return out + [("p2p", (cp - 1) * (2 * layers + rerun), kv), ("p2p", layers * cp, kv * 4 / act_bytes)]
    if impl == "allgather":
        return out + [("all_gather", layers + rerun, cp * kv), ("reduce_scatter", layers, cp * kv)]
    qkvo = act_bytes * tokens * (w.q + w.out + max(w.kv_heads, cp) * (w.qk + w.v_head))
    return out + [("all_to_all", 4 * (2 * layers + rerun), qkvo / 4)]


def ep_traffic(args, tokens: float, layers: float, ac: str, act_bytes: int, capacity: float = 1.0,
               fp8: bool = False) -> Traffic:
    """One expert-parallel rank holding `layers` MoE blocks, `tokens` routed per micro-batch (every TP
    rank dispatches the full tokens itself): each block sends its routed copies out and back in forward
    (again under full AC) and both ways in backward, top_k copies a token (× the capacity factor; the
    planner assumes a balanced load). Copies bound for one rank are not merged, so group-limited routing
    (moe.n_group / topk_group), which bounds the ranks a token reaches, moves the same bytes here (a
    dispatch that deduplicates per node, DeepEP's, would move ≤ topk_group copies across nodes: meshlm
    has none, docs/deepseek_v3.md). The split sizes (E int64 a block and forward) go first. A rank
    books what it sends: the combine direction sends what its experts received, so one rank's bytes
    vary with the routing and their mean over the ep ranks is this (exact when dropless). `fp8`
    (training.fp8_comm "ep"): the dispatch direction (the forward's tokens to the experts, the
    backward's gradients to the down-projections) moves one byte an element and a 4-byte scale a row,
    the combine direction stays in the activation dtype (DeepSeek-V3's choice, docs/fp8.md)."""
    fwd = 2 if ac == "full" else 1
    rows = tokens * args.top_k * capacity
    routed = act_bytes * args.dim * rows
    split = ("all_to_all", layers * fwd, 8 * args.num_experts)
    if not fp8:
        return [("all_to_all", layers * 2 * (fwd + 1), routed), split]
    return [("all_to_all", layers * (fwd + 1), routed), ("all_to_all", layers * (fwd + 1), (args.dim + 4) * rows),
            split]


@lru_cache(maxsize=256)
def moe_blocks(args) -> int:
    """MoE blocks of the model, its MTP modules' included (the rows of the bias update)."""
    return sum(args.is_moe_block(i) for i in range(args.n_layers + args.mtp_depth))


def moe_bias_bytes(args) -> int:
    """The auxiliary-loss-free bias update's all-reduce buffer, once a step over the world: every MoE
    block's tokens per expert, float64 (parallel/dims/expert_parallel.py MoEStats)."""
    balancing = args.expert_bias and args.bias_update_rate > 0
    return 8 * moe_blocks(args) * args.num_experts if balancing else 0


BOOKED_PER_BUFFER = {"all_reduce": 2, "all_reduce_amax": 2}


def booked(traffic: Traffic, accum: int) -> dict[str, tuple[int, int]]:
    """{kind: (calls, bytes)} as `Comm` books `traffic` over a step of `accum` micro-batches (p2p as
    `send` and `recv`)."""
    out: dict[str, list[float]] = {}
    for kind, calls, buf in traffic:
        for k in ("send", "recv") if kind == "p2p" else (kind,):
            c = out.setdefault(k, [0, 0])
            c[0] += calls * accum
            c[1] += calls * accum * buf * BOOKED_PER_BUFFER.get(kind, 1)
    return {k: (round(v[0]), round(v[1])) for k, v in out.items()}


def tp_step_bytes(args, micro_batch: int, seq_len: int, accum: int, tp: int, sp: bool, ac: str = "none",
                  act_bytes: int = 4, param_bytes: int = 4, fp8: frozenset | None = None) -> dict[str, tuple[int, int]]:
    """What one process's TP group books per optimizer step, the whole model on it (pp = 1, cp = 1)."""
    if tp == 1:
        return {}
    L, moe = args.n_layers + args.mtp_depth, moe_blocks(args)
    return booked(tp_traffic(args, micro_batch * seq_len, L, True, True, sp, ac, act_bytes, param_bytes, moe, seq_len,
                             fp8) + tp_weight_traffic(args, tp, L, param_bytes, moe), accum)


def ep_step_bytes(args, tokens: int, accum: int, ac: str = "none", act_bytes: int = 4,
                  fp8: bool = False) -> dict[str, tuple[int, int]]:
    """What one process's EP group books per optimizer step, the whole model on it (pp = 1, tp = 1)."""
    return booked(ep_traffic(args, tokens, moe_blocks(args), ac, act_bytes, fp8=fp8), accum)


def cp_step_bytes(args, micro_batch: int, seq_len: int, accum: int, cp: int, impl: str, tp: int = 1,
                  ac: str = "none", act_bytes: int = 4) -> dict[str, tuple[int, int]]:
    """What one process's CP group books per optimizer step, the whole model on it (pp = 1)."""
    return booked(cp_traffic(args, micro_batch * seq_len // cp, args.n_layers + args.mtp_depth, cp, impl, tp, ac,
                             act_bytes, True), accum)


# -- ZeRO-3 and ZeRO++ (docs/zero.md "ZeRO++"): parallel/dims/zero/quantize.py packs rows this way
def zero3_step_bytes(units: list[tuple[int, bool]], n: int, k: int, accum: int, elem: int, reduce_elem: int,
                     quantize_weights: bool = False, hpz: bool = False, quantize_grads: bool = False) -> dict[str, int]:
    """Bytes one ZeRO-3 rank books per optimizer step by kind, for units [(padded elements, kept gathered
    from forward into backward)], shard group n, ZeRO++ group k (k | n), `accum` micro-batches, no AC or
    pipeline. Per unit of P = n·S elements and micro-batch:
      gathers: forward, and backward unless kept. The step's first is over the shard group: P·elem, or
        n·packed(S) with qwZ ("all_gather"); with hpZ every later one is inside the group, P·elem
        ("all_gather_hpz").
      reduction: P·reduce_elem ("reduce_scatter"); with qgZ k·packed(m·S) inside the group
        ("all_to_all_intra", k > 1) and m·packed(S) across (m = n/k groups, "all_to_all_inter", m > 1)."""
    out: dict[str, int] = {}

    def add(kind: str, b: int) -> None:
        out[kind] = out.get(kind, 0) + b

    m = n // k
    for padded, keep in units:
        s = padded // n
        gathers = accum * (1 if keep else 2)
        first = n * packed_bytes(s) if quantize_weights else padded * elem
        add("all_gather", first * (1 if hpz else gathers))
        if hpz and gathers > 1:
            add("all_gather_hpz", (gathers - 1) * padded * elem)
        if not quantize_grads:
            add("reduce_scatter", accum * padded * reduce_elem)
            continue
        if k > 1:
            add("all_to_all_intra", accum * k * packed_bytes(m * s))
        if m > 1:
            add("all_to_all_inter", accum * m * packed_bytes(s))
    return out


CROSS_GROUP = ("all_gather", "reduce_scatter", "all_to_all_inter")  # kinds whose groups span several nodes
