"""Bytes per step per collective kind, the link that carries them, and their time.

Mesh order (docs/architecture.md): pp, dp_replicate, dp_shard, cp, tp with tp innermost, so a group of `size`
ranks that are `stride` apart stays inside one node when size × stride <= GPUs per node (NVLink).
A group that spans nodes is limited by the NICs: its members on one node (k of them) drive k NICs in
parallel, so it gets min(NVLink, k × IB) per rank. Ring algorithms: an all-reduce puts 2(n-1)/n of
the buffer on the wire per rank, all-gather / reduce-scatter / all-to-all (n-1)/n, a p2p send all of
it. Achieved bandwidth is `comm_efficiency` of the link (NCCL bus bandwidth is ~80% of NVLink's);
each call also pays the link's latency, which is that of a two-rank call, times the depth of its ring
or tree (plan/cost/scale.py: n − 1 hops for a ring all-gather, fewer for a tree all-reduce).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.choices import DTYPE_BYTES, HELD
from ...core.layout import fp8_comm_in_use
from ..hardware import GPU, MIB
from .attn_widths import attn_widths
from .scale import depth
from .stages import float8_expert_amaxes, float8_params_local
from ...core.facts.quant import QUANT_BLOCK, packed_bytes
from .volume import cp_traffic, ep_traffic, moe_bias_bytes, tp_traffic, tp_weight_traffic

LATENCY_S = {"nvlink": 10e-6, "ib": 25e-6}
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0,
        "all_reduce_amax": lambda n: 2 * (n - 1) / n}  # fp8's scale all-reduce (volume.tp_traffic)


def latency(gpu: GPU, link_name: str) -> float:
    """Fixed seconds per collective call: the device's own when it has one (a calibrated CPU), else
    the link's."""
    return gpu.link_latency_s if gpu.link_latency_s is not None else LATENCY_S[link_name]


def link(gpu: GPU, size: int, stride: int) -> tuple[str, float]:
    """(link name, bytes/s per rank) for a group of `size` ranks `stride` apart."""
    gpn = gpu.gpus_per_node
    if size * stride <= gpn:
        return "nvlink", gpu.nvlink_bw
    per_node = max(1, min(size, gpn // stride))
    return "ib", min(gpu.nvlink_bw, per_node * gpu.ib_bw)


@dataclass
class Collective:
    """One kind of traffic of one group, per step on one rank of the worst stage.

    `window` names the compute it can hide behind: none, forward, backward, attention (the ring
    steps of context parallelism), pipeline (sends overlap the next micro-batch; only the fill and
    drain hops are exposed) or step (nothing: after the pipeline flush)."""
    group: str
    kind: str
    link: str
    size: int
    calls: float
    buffer_bytes: float   # bytes of one call's logical buffer
    seconds: float = 0.0
    exposed_s: float = 0.0
    window: str = "none"
    per: str = "microbatch"  # microbatch: repeats every micro-batch; step: once per step
    tail_calls: float = 0.0  # calls that start only when their window ends (the last gradient bucket)
    depth_s: float = 0.0     # of `seconds`, the latency hops beyond a two-rank call's (scale.depth)

    @property
    def wire_bytes(self) -> float:
        return self.calls * self.buffer_bytes * WIRE[self.kind](self.size) if self.size > 1 else 0.0

    def as_dict(self) -> dict:
        return {"group": self.group, "kind": self.kind, "link": self.link, "group_size": self.size,
                "calls": self.calls, "bytes": self.wire_bytes, "seconds": self.seconds,
                "exposed_s": self.exposed_s, "overlaps_with": self.window, "per": self.per,
                "latency_depth_s": self.depth_s}


def make(gpu: GPU | None, group: str, kind: str, size: int, stride: int, calls: float, nbytes: float,
         window: str = "none", per: str = "microbatch", comm_efficiency: float = 0.8,
         tail_calls: float = 0.0) -> Collective:
    """A Collective with its time filled in (zero when no GPU is known or the group is one rank)."""
    if gpu is None:
        name, bw = ("nvlink" if size * stride <= 8 else "ib"), 0.0
    else:
        name, bw = link(gpu, size, stride)
    c = Collective(group, kind, name, size, calls, nbytes, window=window, per=per, tail_calls=tail_calls)
    if bw > 0 and size > 1 and calls > 0:
        alpha = calls * latency(gpu, name)
        c.depth_s = alpha * (depth(kind, size) - 1)
        c.seconds = c.wire_bytes / (bw * comm_efficiency) + alpha + c.depth_s
    return c


def by_kind(traffic) -> list[tuple[str, float, float]]:
    """(kind, calls, total bytes) per kind: one row a kind, its buffer the mean (latency counts calls)."""
    out: dict[str, list[float]] = {}
    for kind, calls, buf in traffic:
        row = out.setdefault(kind, [0.0, 0.0])
        row[0] += calls
        row[1] += calls * buf
    return [(k, c, b) for k, (c, b) in out.items() if c]


def _fp8_comm(s):
    """The float8 collectives `s` runs (layout.fp8_comm_in_use, as the runtime asks), None without fp8."""
    return fp8_comm_in_use(s.precision, "tensorwise", s.fp8_comm, s) if s.precision == "fp8" else None


def ep_collectives(shape, s, layers: int, ac: str, gpu: GPU | None, comm_efficiency: float = 0.8) -> list[Collective]:
    """The expert-parallel all-to-alls of a stage of `layers` blocks under AC mode `ac` (plan/cost/volume.py
    ep_traffic: the routed copies out and back, and the split sizes); nothing hides them. The search's
    lower bound (search.py) counts them too."""
    a = shape.args
    fp8 = _fp8_comm(s)
    tokens = s.micro_batch * s.seq_len / s.cp
    traffic = ep_traffic(a, tokens, layers * a.n_moe_blocks / a.n_layers, ac, HELD[s.precision].act,
                         shape.capacity_factor, fp8 is not None and "ep" in fp8)
    return [make(gpu, "ep", kind, s.ep, s.tp, calls * s.accum, nbytes / calls, comm_efficiency=comm_efficiency)
            for kind, calls, nbytes in by_kind(traffic)]


def collectives(shape, s, sp_dense: float, sp_expert: float, layers: int, first: bool, last: bool,
                gpu: GPU | None, comm_efficiency: float = 0.8) -> list[Collective]:
    """Every collective one rank of a stage runs in one step (before overlap is applied).

    sp_dense / sp_expert: that rank's dense and expert parameters before ZeRO sharding."""
    a = shape.args
    e, pb = HELD[s.precision].act, HELD[s.precision].param
    rb = DTYPE_BYTES[s.reduce_dtype]
    t, cp, dp, m = s.tp, s.cp, s.dp, s.accum
    tokens = s.micro_batch * s.seq_len / cp
    sq = s.sp_enabled
    out: list[Collective] = []

    def add(*args, **kw):
        out.append(make(gpu, *args, comm_efficiency=comm_efficiency, **kw))

    fp8 = _fp8_comm(s)
    if s.tp_enabled:  # plan/cost/volume.py: the runtime's own formulas, checked byte for byte against Comm's books
        moe_ffn = layers * a.n_moe_blocks / a.n_layers if shape.moe else 0
        for kind, calls, nbytes in by_kind(tp_traffic(a, tokens, layers, first, last, sq, s.ac, e, pb, moe_ffn, s.seq_len, fp8)
                                           + tp_weight_traffic(a, t, layers, pb, moe_ffn)):
            add("tp", kind, t, 1, calls * m, nbytes / calls)
    # the ring's sends hide behind its block attention; Ulysses' all-to-alls and allgather's gather and
    # reduce-scatter sit on the critical path (the attention waits for them)
    for kind, calls, nbytes in by_kind(cp_traffic(a, tokens, layers, cp, s.cp_impl, t, s.ac, e, last)):
        add("cp", kind, cp, t, calls * m, nbytes / calls, window="attention" if kind == "p2p" else "none")
    if s.ep_enabled:
        out += ep_collectives(shape, s, layers, s.ac, gpu, comm_efficiency)
    if moe_bias_bytes(a):  # auxiliary-loss-free balancing: one all-reduce of the counts a step, every rank
        add("world", "all_reduce", s.world_size, 1, 1, moe_bias_bytes(a), per="step", window="step")
    if s.pp_enabled:  # activations forward and their gradients backward, once per chunk boundary
        hidden = e * (a.dim / t if sq else a.dim) * tokens
        add("pp", "p2p", 2, t * cp * dp, 2 * s.pp_virtual * m, hidden, window="pipeline", per="step")
    # data parallel: gradients over dp×cp (cp ranks hold the same weights), ZeRO over dp_shard×cp
    n, reps = s.shard_group, s.dp_replicate  # as ZeRO sees them (used when zero >= 1)
    psi = sp_dense + sp_expert
    if s.zero == 0:
        if s.dp_cp_enabled:  # one call per gradient bucket (parallel/dims/data_parallel.py closes a bucket at
            # bucket_mb); the last one fills when the backward ends, so nothing hides it
            buckets = max(1, int(rb * psi // (s.bucket_mb * MIB)))
            add("dp", "all_reduce", dp * cp, t, buckets, rb * psi / buckets, window="backward", per="step",
                tail_calls=1)
    else:
        k = s.hpz_group or n  # ZeRO++ groups (docs/zero.md): k consecutive shard ranks, a node
        q = packed_bytes(QUANT_BLOCK) / QUANT_BLOCK  # int8 plus its fp32 block scales, per element
        if s.zero >= 2 and s.quantize_grads:  # qgZ: int8 all-to-all inside the group, then across
            if k > 1:
                add("dp_shard", "all_to_all", k, t, m, q * psi, window="backward")
            if n // k > 1:
                add("dp_shard", "all_to_all", n // k, t * k, m, q * psi / k, window="backward")
        elif s.zero >= 2:
            add("dp_shard", "reduce_scatter", n, t, m, rb * psi, window="backward")
        else:
            add("dp_shard", "reduce_scatter", n, t, 1, rb * psi, window="backward", per="step")
        if s.dp_replicate_enabled:
            add("dp_replicate", "all_reduce", reps, t * n, 1, rb * psi / n, per="step", window="step")
        if s.zero >= 3:  # plan/cost/volume.py zero3_step_bytes: the runtime's formula per unit
            first = (q if s.quantize_weights else pb) * psi  # qwZ: int8 gathers over the shard group
            if fp8 is not None and "zero" in fp8:  # float8 linears' weights: one byte, after their amax
                f8 = min(psi, layers * float8_params_local(shape, t, s.ep))
                first -= (pb - 1) * f8
                aw = attn_widths(a, t)  # one amax per split projection, the FFN's three
                linears = sum(1 for g, _, _ in aw.gemms if g not in dict(aw.replicated)) + 3
                add("dp_shard", "all_reduce_amax", n, t, 2 * m * layers,
                    4 * (linears + float8_expert_amaxes(shape, t, s.ep)), window="forward")
            if s.hpz_group:  # hpZ: the step's first gather over the shard group, every other in the group
                add("dp_shard", "all_gather", n, t, 1, first, window="forward")
                add("dp_shard", "all_gather", k, t, 2 * m - 1, pb * psi, window="backward")
            else:
                add("dp_shard", "all_gather", n, t, m, first, window="forward")
                add("dp_shard", "all_gather", n, t, m, first, window="backward")
        else:  # updated parameters back to every rank after the sharded optimizer step
            add("dp_shard", "all_gather", n, t, 1, pb * psi, per="step", window="step")
    return out
