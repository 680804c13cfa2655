"""Bytes per GPU for one layout on one pipeline rank: the one memory model, `stage_memory`, which both
`meshlm estimate` and the search call (the search reads every AC mode and offload choice of one layout
from the same StageMemory that estimate reads its layout's own from).

Conventions (they are how the trainer reports `mem.*`, so prediction and measurement compare):
Ψ_local is the rank's share of the parameters. fp32: params 4Ψ, grads 4Ψ, optim 8Ψ (Adam m, v; the
fp32 master is the parameter). bf16/fp16: params 2Ψ (compute copy), grads 4Ψ (fp32, reduced in fp32),
optim 12Ψ (fp32 master + m + v). ZeRO-1 shards optim, ZeRO-2 also grads, ZeRO-3 also params over the
shard group. Activations follow the tensors that meshlm's Block really saves for backward
(activations.py); what each pipeline rank holds is stages.py's.
"""
from __future__ import annotations

from functools import lru_cache

from ...core.choices import AC_MODES, HELD
from .activations import block_bytes_all_ac, cp_buffer_bytes, dense_mask_bytes, head_bytes, saved_mask_bytes
from ..hardware import MIB
from .muon import muon_memory
from .options import Options
from ..spec import Shape, Spec
from .stages import StageParams, held_layers, inflight, stage_params_of
from ...core.facts.quant import packed_bytes

DEFAULT_OPTIONS = Options()


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


# ---------------------------------------------------------------------------------- one pipeline rank

class StageMemory:
    """One pipeline rank's bytes for its Spec's layout under every AC mode and offload choice: the
    search tries them all (`total`), `meshlm estimate` prints the Spec's own (`breakdown`). Both add the
    same terms in the same order, so the search prices a layout exactly as estimate does."""
    __slots__ = ("spec", "stage", "params_of", "units", "params", "grads", "adam", "muon", "block", "acts",
                 "buffers", "working", "bufs")

    def __init__(self, spec: Spec, stage: str, params_of: StageParams, params: float, grads: float, adam: float):
        self.spec, self.stage, self.params_of = spec, stage, params_of
        self.params, self.grads, self.adam = params, grads, adam  # adam: optimizer state without offload
        self.muon = 0.0          # optim.name = "muon": its change to the optimizer state (negative: saved)
        self.units = 0.0         # micro-batches in flight at the rank's peak
        self.block: dict[str, float] = {}    # per AC mode: one block's saved bytes per micro-batch
        self.acts: dict[str, float] = {}     # per AC mode: every activation the rank holds at its peak
        self.buffers: dict[str, float] = {}  # transient buffers that no AC mode changes, in print order
        self.working: dict[str, float] = {}  # per AC mode: the backward working set of one block
        self.bufs: dict[str, float] = {}     # per AC mode: all buffers

    def optim(self, offload: str) -> float:
        """Optimizer-state bytes left on the device."""
        return (self.adam if offload == "none" else 0.0) + self.muon

    def total(self, ac: str | None = None, offload: str | None = None) -> float:
        """Device bytes under this AC mode and offload choice (default: the Spec's own)."""
        return self.totals([(ac or self.spec.ac, offload or self.spec.offload)])[0]

    def totals(self, choices: list[tuple[str, str]]) -> list[float]:
        """Device bytes of each (AC mode, offload) choice: params + grads + optim + activations + buffers."""
        states, adam, muon, acts, bufs = self.params + self.grads, self.adam, self.muon, self.acts, self.bufs
        return [states + ((adam if off == "none" else 0.0) + muon) + acts[ac] + bufs[ac] for ac, off in choices]

    def host(self, offload: str) -> tuple[float, float]:
        """(host, disk) bytes of the optimizer state under this offload choice. Optimizer offload: host
        memory holds a separate fp32 master (the device keeps the compute copy), Adam's m and v and an
        fp32 staging buffer for the gradient shard, 16 bytes per sharded parameter; nvme: `nvme_bytes`."""
        per_param = state_bytes_per_param(self.spec.precision)[2]
        if offload == "optimizer":
            return self.adam * 16 / per_param, 0.0
        if offload == "nvme":
            return nvme_bytes(self.adam / per_param, self.spec.offload_buffer_mb)
        return 0.0, 0.0

    def breakdown(self, ac: str | None = None, offload: str | None = None, detail: bool = True) -> dict:
        """The per_gpu dict `meshlm estimate` prints (plus `detail`), for this AC mode and offload."""
        ac, offload = ac or self.spec.ac, offload or self.spec.offload
        cpu_optim, disk_optim = self.host(offload)
        out = {"params": self.params, "grads": self.grads, "optim": self.optim(offload), "activations": self.acts[ac],
               "buffers": self.bufs[ac], "total": self.total(ac, offload), "cpu_optim": cpu_optim,
               "disk_optim": disk_optim}
        if detail:
            p = self.params_of
            out["detail"] = {"stage": self.stage, "layers": p.layers, "params_local": p.dense + p.expert,
                             "block_activation_bytes": self.block[ac], "inflight_microbatches": self.units,
                             "buffers": {"backward_working": self.working[ac], **self.buffers},
                             "shard_group": self.spec.shard_group}
        return out


def stage_memory(shape: Shape, s: Spec, stage: str, o: Options = DEFAULT_OPTIONS) -> StageMemory:
    """Bytes on the rank of `stage` ('first', 'last', 'middle' or 'only': stages.pipeline_roles) for
    every AC mode and offload choice of the layout `s`; `o` says how the code runs (fused attention,
    compile, the chunked loss, the attention mask, another framework's recomputed GEMMs)."""
    sp, params, grads, adam, step_buffers, muon, muon_buf = state_terms(shape, s, stage)
    m = StageMemory(s, stage, sp, params, grads, adam)
    units, block, acts, loss, mask, dims = activation_terms(shape, s, stage, o)
    m.units, m.block, m.acts = units, dict(zip(AC_MODES, block)), dict(zip(AC_MODES, acts))
    b = m.buffers
    b.update(loss)
    b.update(step_buffers)
    b.update(mask)
    if s.optim == "muon":  # optim.name = "muon" (plan/cost/muon.py)
        m.muon, b["muon"] = muon, muon_buf
    b.update(dims)
    rest = tuple(b.values())
    for ac in AC_MODES:
        m.working[ac] = m.block["none"] * (1.0 if ac == "full" else 0.5)
        m.bufs[ac] = sum((m.working[ac], *rest))
    return m


def state_terms(shape: Shape, s: Spec, stage: str) -> tuple:
    """What no micro-batch size, AC mode or offload changes on `stage`'s rank: (stages.StageParams,
    params, grads and optimizer-state bytes, the step's ZeRO / DP buffers as (name, bytes) pairs, Muon's
    change to the optimizer state and its buffer: 0 under AdamW). stage_memory and the search's
    grid (plan/cost/memory_grid.py) both add these up."""
    sp, params, grads, adam, step = _rank_states(
        shape, stage, s.tp, s.ep, s.pp, s.pp_virtual, s.pp_schedule, s.pp_layers, s.zero, s.shard_group, s.precision,
        s.dp_cp_enabled, s.bucket_mb, s.hpz_group, s.quantize_weights)
    muon, muon_buf = muon_memory(shape, s, sp.layers) if s.optim == "muon" else (0.0, 0.0)
    return sp, params, grads, adam, step, muon, muon_buf


def activation_terms(shape: Shape, s: Spec, stage: str, o: Options) -> tuple:
    """What the micro-batch sets on `stage`'s rank, not the ZeRO stage (`stage_activation_terms`)."""
    return stage_activation_terms(shape, stage, s.tp, s.ep_enabled, s.pp, s.pp_virtual, s.pp_schedule, s.pp_layers,
                             s.sp_enabled, s.cp, s.cp_impl, s.micro_batch, s.accum, s.seq_len, s.precision, o)


def state_floor(shape: Shape, s: Spec, stage: str, choices: list[tuple[str, str]]) -> float:
    """The least device bytes of `stage`'s rank under any of `choices` (AC, offload) before any
    activation: parameters, gradients, the optimizer state unless a choice offloads it, the step's
    ZeRO / DP buffers (AdamW's state: Muon's change to it is left to stage_memory). Cheap (cached per
    degrees): the search drops a layout above it unpriced."""
    _, params, grads, adam, step = _rank_states(
        shape, stage, s.tp, s.ep, s.pp, s.pp_virtual, s.pp_schedule, s.pp_layers, s.zero, s.shard_group, s.precision,
        s.dp_cp_enabled, s.bucket_mb, s.hpz_group, s.quantize_weights)
    offloads = any(off != "none" for _, off in choices)
    return params + grads + (0.0 if offloads else adam) + sum(v for _, v in step)


@lru_cache(maxsize=65536)
def _rank_states(shape: Shape, stage: str, tp: int, ep: int, pp: int, v: int, schedule: str, pp_layers: tuple, zero: int,
            n: int, precision: str, dp_cp: bool, bucket_mb: float, hpz_group: int, qwz: bool) -> tuple:
    """What no micro-batch size, AC mode or offload changes (cached: the search asks for it per
    micro-batch size): the rank's parameters (stages.StageParams), params, grads and optimizer-state
    bytes, and the buffers ZeRO or DP hold for the step. Dense parameters shard over the ZeRO group
    (`n` ranks), experts over n / ep."""
    sp = stage_params_of(shape, tp, ep, pp, v, schedule, pp_layers, stage)
    pb, gb, ob = state_bytes_per_param(precision)
    ne = max(1, n // ep)
    params = pb * (sp.dense / (n if zero >= 3 else 1) + sp.expert / (ne if zero >= 3 else 1))
    grads = gb * (sp.dense / (n if zero >= 2 else 1) + sp.expert / (ne if zero >= 2 else 1))
    optim = ob * (sp.dense / (n if zero >= 1 else 1) + sp.expert / (ne if zero >= 1 else 1))
    step: dict[str, float] = {}
    if zero >= 3 and n > 1:
        step["zero3_gather"] = sp.unit * (2 * pb + gb)
    elif dp_cp:
        step["grad_buckets"] = 2 * bucket_mb * MIB
    if zero >= 3 and hpz_group:  # ZeRO++ hpZ: 1/K of every unit, held from its first gather to the step
        step["hpz_secondary"] = pb * (sp.dense + sp.expert) / hpz_group
    if zero >= 3 and qwz:  # qwZ: the int8 rows of one unit's gather
        step["qwz_int8"] = packed_bytes(int(sp.unit))
    return sp, params, grads, optim, tuple(step.items())


@lru_cache(maxsize=65536)
def stage_activation_terms(shape: Shape, stage: str, tp: int, ep_on: bool, pp: int, v: int, schedule: str, pp_layers: tuple,
                      sp_on: bool, cp: int, impl: str, mb: int, accum: int, seq: int, precision: str,
                      o: Options) -> tuple:
    """What the micro-batch, not the ZeRO stage, sets (cached: the search asks once per ZeRO choice):
    the micro-batches in flight, per AC mode one block's saved bytes and all the rank holds at its peak
    (its blocks × the micro-batches in flight, the embedding's token ids, the head's saved set), and the
    transient buffers no AC mode changes, apart from ZeRO's and Muon's (stage_memory adds those in order:
    the loss, the step's ZeRO / DP buffers, the attention mask, Muon's, each dimension's exchange). The
    expert degree matters only as on or off (its all-to-all buffer): the blocks a rank holds do not
    depend on it, so ep = 1 stands for every degree here."""
    sp = stage_params_of(shape, tp, 1, pp, v, schedule, pp_layers, stage)
    a, e, tokens = shape.args, HELD[precision].act, mb * seq / cp
    dsp = a.dim / tp if sp_on else a.dim
    head = head_bytes(a, tp, dsp, e, o.compiled, o.loss_chunks) if sp.head else (0.0, 0.0)
    head_saved = (1 + a.mtp_depth) * head[0]  # each MTP module's head and loss keep their own
    units = inflight(schedule, pp, accum, v, sp.rank)
    held = held_layers(schedule, pp, accum, v, sp.rank, sp.chunks)
    ids = units * tokens * 8 if sp.embed else 0.0  # token ids kept by the embedding backward
    head_units = accum if (pp > 1 and schedule == "gpipe") else 1
    head_held = head_units * tokens * head_saved if sp.head else 0.0
    per_token = block_bytes_all_ac(shape, seq, e, tp, sp_on, o.flash, o.attn_math_bytes, o.compiled, cp, impl,
                                   o.recompute_gemms)
    # MTP blocks are never checkpointed: they keep everything; each module also keeps its two input norms'
    # inputs and rstd and the projection's input [embedding; hidden] (4·e·d + 8 per token)
    mtp = a.mtp_depth if sp.head else 0
    block, acts = [], []
    for ac, blk_tok in zip(AC_MODES, per_token):
        blk = blk_tok * tokens + saved_mask_bytes(mb, seq, o.attn_mask, cp, impl, ac, e)
        held_ac = held * blk + head_units * mtp * ((per_token[0] - blk_tok) + 4 * e * a.dim + 8) * tokens
        block.append(blk)
        acts.append(held_ac + ids + head_held)
    loss = (("loss", tokens * head[1]),) if sp.head else ()
    dense = dense_mask_bytes(mb, seq, o.attn_mask, cp, impl)
    mask = (("attn_mask", dense),) if dense else ()
    dims = []
    if tp > 1:
        dims.append(("tp", 2 * e * a.dim * tokens))
    if pp > 1:
        dims.append(("pp_p2p", 4 * e * dsp * tokens))
    if cp > 1:
        dims.append(("cp", cp_buffer_bytes(a, tp, cp, impl, e) * tokens))
    if ep_on:
        dims.append(("ep_all_to_all", 2 * shape.top_k * shape.capacity_factor * e * a.dim * tokens))
    return units, tuple(block), tuple(acts), loss, mask, tuple(dims)


def nvme_bytes(shard_params: float, buffer_mb: float) -> tuple[float, float]:
    """offload = "nvme" (parallel/optim/nvme.py): (host, disk) bytes for `shard_params` sharded parameters.
    Disk: fp32 master, m and v, 12 B each. Host: the streaming buffer, three slots of master, m, v and an
    fp32 gradient staging chunk (16 B per element), never more than the state needs."""
    return min(buffer_mb * MIB, 3 * 16 * shard_params), 12 * shard_params
