"""What tensor and context parallelism send: one set of formulas for the planner (plan/comm.py prices
them), the runtime's byte checks (Comm's books equal them exactly: tests/test_tp.py, tests/test_cp.py)
and the docs (docs/tensor_parallel.md, docs/context_parallel.md).

Each function gives one rank's traffic per micro-batch as (kind, calls, buffer bytes) rows; `booked`
turns them into what `Comm` books per step (an all-reduce 2× its buffer, an all-gather its output,
a reduce-scatter its input, a send its tensor: sends and receives booked apart, equal).
"""
from __future__ import annotations

Traffic = list[tuple[str, float, float]]


def tp_traffic(args, tokens: float, layers: float, first: bool, last: bool, sp: bool, ac: str, act_bytes: int,
               param_bytes: int = 4, moe_ffn: float = 0.0) -> Traffic:
    """One tensor-parallel rank of a stage holding `layers` blocks (`first`: the embedding, `last`: the
    head and loss), `tokens` per micro-batch on this rank's sequence (before SP's split).

    Entering a TP region (each block half, the head) reduces in backward, leaving one (each block half,
    the embedding) in forward. Full or op-level AC reruns each block's forward in backward, entering
    both halves again but leaving only the attention half (torch's checkpoint stops once w2's input is
    rebuilt). SP turns each into an all-gather / reduce-scatter of the same volume, and backward entries
    re-gather the shard the column-parallel linears saved (not a MoE block's FFN, `moe_ffn` of them:
    its experts read routed tokens, so its entry gathers unfused). The vocab-parallel loss adds a max
    and a (sum-exp, target-logit) all-reduce of fp32 [tokens]; SP one gain-gradient all-reduce per norm,
    kv replicas (tp > kv heads) one per wk/wv, q/k norms one per gain."""
    act = act_bytes * tokens * args.dim
    entries, leaves = 2 * layers + last, 2 * layers + first
    full = ac in ("full", "op")
    again_in, again_out = (2 * layers, layers) if full else (0, 0)
    out: Traffic = []
    if sp:
        regather = 2 * layers - moe_ffn + last
        out.append(("all_gather", entries + leaves + regather + again_in, act))
        out.append(("reduce_scatter", leaves + entries + again_out, act))
        out.append(("all_reduce", 2 * layers + last, param_bytes * args.dim))  # norm gains' gradients
    else:
        out.append(("all_reduce", entries + leaves + again_out, act))
    if last:
        out.append(("all_reduce", 1, 4 * tokens))  # max logit
        out.append(("all_reduce", 1, 8 * tokens))  # sum-exp and target logit
    return out


def tp_weight_traffic(args, tp: int, layers: float, param_bytes: int = 4) -> Traffic:
    """Gradient all-reduces of weights replicated inside the TP group, per micro-batch: wk, wv (and their
    biases) when tp > kv heads, Qwen3's q/k norm gains."""
    out: Traffic = []
    if tp > args.n_kv_heads:
        kv_rows = args.n_kv_heads * args.head_dim
        out.append(("all_reduce", 2 * layers, param_bytes * kv_rows * args.dim))
        if args.qkv_bias:
            out.append(("all_reduce", 2 * layers, param_bytes * kv_rows))
    if args.qk_norm:
        out.append(("all_reduce", 2 * layers, param_bytes * args.head_dim))
    return out


def cp_traffic(args, tokens: float, layers: float, cp: int, impl: str, tp: int, ac: str, act_bytes: int) -> Traffic:
    """One context-parallel rank, `tokens` = its local tokens per micro-batch, kv = kv heads per TP rank ×
    head_dim, q likewise:
      ring: forward (c-1) sends of k,v (2·e·T·kv each); backward (c-1) again and c sends of the fp32
            gradient accumulators dk,dv (2·4·T·kv); full AC runs the forward again.
      ulysses: all-to-alls of q, k, v and the output (e·T·(2q + 2kv')/4 each, kv' = max(kv heads, c) ×
            head_dim: kv heads are repeated up to c), forward and backward; full AC adds a forward.
      allgather: forward an all-gather of k,v (output c·2·e·T·kv), backward a reduce-scatter of dk,dv in
            the activation dtype (input c·2·e·T·kv); full AC gathers again. Document masking adds one
            all-gather of the int64 document ids per forward of a stage (8·c·T), not counted here."""
    if cp == 1:
        return []
    fwd = 2 if ac == "full" else 1
    hkv = max(1, args.n_kv_heads // tp)
    kv = 2 * act_bytes * tokens * hkv * args.head_dim
    if impl == "ring":
        return [("p2p", layers * (cp - 1) * (fwd + 1), kv), ("p2p", layers * cp, kv * 4 / act_bytes)]
    if impl == "allgather":
        return [("all_gather", layers * fwd, cp * kv), ("reduce_scatter", layers, cp * kv)]
    qkvo = act_bytes * tokens * args.head_dim * (2 * (args.n_heads // tp) + 2 * max(hkv, cp))
    return [("all_to_all", 4 * layers * (fwd + 1), qkvo / 4)]


BOOKED_PER_BUFFER = {"all_reduce": 2}


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
                  act_bytes: int = 4, param_bytes: int = 4) -> dict[str, tuple[int, int]]:
    """What one process's TP group books per optimizer step, the whole model on it (pp = 1, cp = 1)."""
    if tp == 1:
        return {}
    L = args.n_layers
    return booked(tp_traffic(args, micro_batch * seq_len, L, True, True, sp, ac, act_bytes, param_bytes)
                  + tp_weight_traffic(args, tp, L, param_bytes), accum)


def cp_step_bytes(args, micro_batch: int, seq_len: int, accum: int, cp: int, impl: str, tp: int = 1,
                  ac: str = "none", act_bytes: int = 4) -> dict[str, tuple[int, int]]:
    """What one process's CP group books per optimizer step, the whole model on it (pp = 1)."""
    return booked(cp_traffic(args, micro_batch * seq_len // cp, args.n_layers, cp, impl, tp, ac, act_bytes), accum)


# -- ZeRO-3 and ZeRO++ (docs/zero.md "ZeRO++"): parallel/dims/zero/quantize.py packs rows this way
QUANT_BLOCK = 256  # elements per fp32 scale in ZeRO++'s int8 rows


def packed_bytes(n: int) -> int:
    """Bytes of one int8 row of n values with its fp32 block scales (4 per QUANT_BLOCK elements)."""
    return n + 4 * -(-n // QUANT_BLOCK)


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
