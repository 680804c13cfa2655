"""Context parallelism: every micro-batch's sequence split over the CP group (parallel.cp).

Only attention mixes tokens, so only the attention core changes; everything else (norms, linears,
the loss) runs on this rank's tokens unchanged. Two cores (parallel.cp_impl):

- ring: q stays; k and v travel around the ring, one block per step, sent to the next rank while the
  block already held is attended to (`Comm.batch_p2p`, waited only after that block's attention).
  Partial results merge by the log-sum-exp rule. Backward is a custom autograd Function that rotates
  k, v again together with their gradient accumulators (fp32), which end at the block's owner. The
  sequence is never gathered. Causal load balancing: the sequence is cut in 2c chunks and rank i holds
  chunks i and 2c-1-i (zig-zag), so with fully masked blocks skipped every rank does the same work:
  step 0 a causal 2n×2n block, then an unmasked 2n×n (a block from an earlier rank: all queries, its
  first half) or n×2n (a later rank's: the second half of the queries, all of it) each step.
- ulysses (DeepSpeed-Ulysses): an all-to-all swaps the sequence split for a head split, each rank
  attends over the full sequence for H/c heads, and a second all-to-all swaps back. Contiguous split
  (rank i holds chunk i of c): a full-sequence attention is balanced already.
- allgather (Llama 3): k and v all-gathered, local queries against the whole sequence, any mask
  (parallel/dims/cp_allgather.py). The ring's zig-zag split.

Per-block attention goes through a kernel that returns its log-sum-exp: on CUDA torch's fused flash
(bf16/fp16) or memory-efficient (fp32) ops, on CPU a plain implementation. Positions: each rank applies
RoPE at the true positions of its tokens (`CPSplit.positions`, through the model's `positions`
argument, composed with SP's hook). Parameters are replicated over cp, so gradients are reduced over
dp×cp (compose.reductions). docs/context_parallel.md and plan/cost/volume.py have the byte formulas.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd import Function

from ...distributed.comm import Comm
from ...distributed.functional import all_to_all
from ...model.ops import eager_under_compile

# ---------------------------------------------------------------------------------- the split


@dataclass(frozen=True)
class CPSplit:
    """Which tokens of a sequence this CP rank holds: zig-zag chunks (ring) or one contiguous chunk."""
    size: int
    rank: int
    zigzag: bool

    def chunks(self) -> tuple[int, ...]:
        """Chunk ids this rank holds, in order, out of `n_chunks`."""
        return (self.rank, 2 * self.size - 1 - self.rank) if self.zigzag else (self.rank,)

    @property
    def n_chunks(self) -> int:
        return 2 * self.size if self.zigzag else self.size

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of full sequences `x` (split along `dim`)."""
        if self.size == 1:
            return x
        parts = x.chunk(self.n_chunks, dim)
        return torch.cat([parts[i] for i in self.chunks()], dim).contiguous()

    def positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """True positions of this rank's `local_len` tokens (the full sequence is local_len × size)."""
        n = local_len // len(self.chunks())
        return torch.cat([torch.arange(i * n, (i + 1) * n, device=device) for i in self.chunks()])


# ---------------------------------------------------------------------------------- block kernels

def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // k.shape[1]
    return k if rep == 1 else k.repeat_interleave(rep, 1)


def _fold(dk: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of expanded kv heads back onto the kv heads they repeat."""
    b, h, s, d = dk.shape
    return dk if h == kv_heads else dk.view(b, kv_heads, h // kv_heads, s, d).sum(2)


class PlainKernel:
    """softmax(QKᵀ)V of one block in fp32 with its log-sum-exp; backward from the *merged* output and
    log-sum-exp (the flash-attention backward), so a block's gradient needs no other block."""
    name = "plain"

    def forward(self, q, k, v, causal: bool, scale: float):
        kk, vv = _expand(k, q.shape[1]).float(), _expand(v, q.shape[1]).float()
        s = self._scores(q.float(), kk, causal, scale)
        lse = s.logsumexp(-1)
        return (s - lse.unsqueeze(-1)).exp() @ vv, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        kk, vv = _expand(k, q.shape[1]).float(), _expand(v, q.shape[1]).float()
        qf, do = q.float(), dout.float()
        p = (self._scores(qf, kk, causal, scale) - lse.unsqueeze(-1)).exp()
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ vv.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
        dq = (ds @ kk) * scale
        dk = (ds.transpose(-1, -2) @ qf) * scale
        return dq, _fold(dk, k.shape[1]), _fold(dv, k.shape[1])

    @staticmethod
    def _scores(q, k, causal, scale):
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s


class CudaKernel:
    """torch's fused CUDA attention ops, which return the log-sum-exp: flash for bf16/fp16, the
    memory-efficient kernel for fp32. kv heads are expanded for them and folded back in backward."""
    name = "cuda"

    def forward(self, q, k, v, causal: bool, scale: float):
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
        if q.dtype in (torch.bfloat16, torch.float16):
            r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return r[0].float(), r[1]
        r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return r[0].float(), r[1][..., :q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        hk = k.shape[1]
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        lse = lse.contiguous()
        n, m = q.shape[2], k.shape[2]
        if q.dtype in (torch.bfloat16, torch.float16):
            seed = torch.zeros((), dtype=torch.int64)
            g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, n, m, 0.0, causal, seed, seed, scale=scale)
        else:
            pad = -(-n // 32) * 32  # the kernel's log-sum-exp is padded to 32 rows
            lse = torch.nn.functional.pad(lse, (0, pad - n)) if pad != n else lse
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            g = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return g[0].float(), _fold(g[1].float(), hk), _fold(g[2].float(), hk)


def kernel_for(device: torch.device):
    return CudaKernel() if device.type == "cuda" else PlainKernel()


# ---------------------------------------------------------------------------------- ring attention

@dataclass
class RingCounter:
    """Attention work per rank, for the load-balance test: block calls and q·k pairs computed
    (a causal block counts its visible half)."""
    calls: int = 0
    pairs: int = 0

    def add(self, nq: int, nk: int, causal: bool) -> None:
        self.calls += 1
        self.pairs += nq * (nk + 1) // 2 if causal else nq * nk


def _ring_step_blocks(rank: int, step: int, c: int, n: int):
    """(query rows, key rows, causal) of step `step` on `rank`: the zig-zag block schedule. The block
    held at `step` came from rank (rank - step) mod c; earlier ranks' second chunks and later ranks'
    first chunks are wholly masked and skipped."""
    src = (rank - step) % c
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, n), False
    return slice(n, None), slice(None), False


def _rotate(comm: Comm, tensors: torch.Tensor):
    """Send `tensors` to the next rank, receive the previous rank's into a new buffer (async)."""
    buf = torch.empty_like(tensors)
    c = comm.size
    works = comm.batch_p2p([("send", tensors, (comm.rank + 1) % c), ("recv", buf, (comm.rank - 1) % c)],
                           symmetric=True)  # every member rotates at the same point
    return buf, works


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Online softmax: fold a block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, l)
    out.mul_((lse - new).exp().unsqueeze(-1)).add_(o * (l - new).exp().unsqueeze(-1))
    lse.copy_(new)


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, kernel, scale: float, counter):
        c, r, n = comm.size, comm.rank, q.shape[2] // 2
        kv = torch.stack((k, v)).contiguous()
        out = lse = None
        for step in range(c):
            nxt, works = _rotate(comm, kv) if step < c - 1 else (None, [])
            rows, cols, causal = _ring_step_blocks(r, step, c, n)
            o, l = kernel.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale)
            if counter is not None:
                counter.add(o.shape[2], kv.shape[3] if cols == slice(None) else n, causal)
            if out is None:
                out, lse = o, l
            else:
                _merge(out[:, :, rows], lse[:, :, rows], o, l)
            comm.wait_p2p(works)
            kv = nxt
        # The output in the compute dtype, laid out [B, S, H, D] so the model's transpose + reshape for
        # wo is a view: q, k, v, this and the log-sum-exp are all that is saved (as flash attention).
        b, h, s, d = out.shape
        res = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        res.copy_(out)
        ctx.comm, ctx.kernel, ctx.scale = comm, kernel, scale
        ctx.save_for_backward(q, k, v, res, lse)
        return res

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, kernel, scale = ctx.comm, ctx.kernel, ctx.scale
        c, r, n = comm.size, comm.rank, q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        dkv = dkv_works = None
        for step in range(c):
            nxt, works = _rotate(comm, kv) if step < c - 1 else (None, [])
            rows, cols, causal = _ring_step_blocks(r, step, c, n)
            gq, gk, gv = kernel.backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                         out[:, :, rows], lse[:, :, rows], causal, scale)
            dq[:, :, rows] += gq
            if dkv is None:  # step 0: this rank's own block, its accumulator starts here
                acc = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)
            else:  # the block's accumulator, arriving from the previous holder
                comm.wait_p2p(dkv_works)
                acc = dkv
            acc[0][:, :, cols] += gk
            acc[1][:, :, cols] += gv
            comm.wait_p2p(works)
            kv = nxt
            dkv, dkv_works = _rotate(comm, acc)  # on to the block's next holder (finally its owner)
        comm.wait_p2p(dkv_works)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


class RingAttentionCore(nn.Module):
    """Causal attention over the zig-zag split sequence of the CP group (q, k, v: [B, H, S/c, D])."""

    def __init__(self, comm: Comm, kernel=None, counter: RingCounter | None = None):
        super().__init__()
        self.comm, self.kernel, self.counter = comm, kernel, counter

    @eager_under_compile  # collectives inside: compiled blocks call it eagerly
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel or kernel_for(q.device)
        return _RingAttention.apply(q, k, v, self.comm, kernel, q.shape[-1] ** -0.5, self.counter)


# ---------------------------------------------------------------------------------- ulysses

def _seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, H, S/c, D] sequence-split → [B, H/c, S, D] head-split (rank j gets heads j·H/c…). With
    autograd: its backward is `_heads_to_seq` (all_to_all's transpose and the reshapes' inverses)."""
    b, h, s, d = x.shape
    c = comm.size
    out = all_to_all(x.reshape(b, c, h // c, s, d).transpose(0, 1), comm)
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _heads_to_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, H/c, S, D] head-split → [B, H, S/c, D] sequence-split: the inverse of `_seq_to_heads`."""
    b, h, s, d = x.shape
    c = comm.size
    out = all_to_all(x.reshape(b, h, c, s // c, d).permute(2, 0, 1, 3, 4), comm)
    # laid out [B, S/c, H, D]: the model's transpose + reshape for wo is then a view, not a copy
    return out.permute(1, 3, 0, 2, 4).reshape(b, s // c, c * h, d).transpose(1, 2)


class UlyssesAttentionCore(nn.Module):
    """All-to-all to a head split, the model's own attention core over the full sequence, and back.
    kv heads fewer than c are repeated to c first (each rank then receives the one its q heads use).
    `mask`: the model's document mask over the whole sequence (ModelArgs.mask_rows = "all"), which the
    inner core applies as it would without CP."""

    def __init__(self, comm: Comm, inner: nn.Module):
        super().__init__()
        self.comm, self.inner = comm, inner

    @eager_under_compile
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        c = self.comm.size
        if k.shape[1] < c:
            k, v = k.repeat_interleave(c // k.shape[1], 1), v.repeat_interleave(c // v.shape[1], 1)
        q, k, v = (_seq_to_heads(t, self.comm) for t in (q, k, v))
        out = self.inner(q, k, v) if mask is None else self.inner(q, k, v, mask)
        return _heads_to_seq(out, self.comm)


# ---------------------------------------------------------------------------------- apply

class PaddedValues(nn.Module):
    """Ring and all-gather move k and v stacked, so their heads must have one size: MLA's value heads
    (v_head_dim, narrower than its q/k heads) are padded with zeros to the key's size and the output
    cut back (its padded columns are zero: softmax(QKᵀ)·0). (qk − v)/(qk + v) more bytes on the wire."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask) -> torch.Tensor:
        d = v.shape[-1]
        return self.inner(q, k, torch.nn.functional.pad(v, (0, k.shape[-1] - d)), *mask)[..., :d]


@dataclass
class ContextParallel:
    """What the trainer and the pipeline need from CP: the split of each sequence."""
    comm: Comm
    split: CPSplit
    impl: str

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return self.split.take(x, 1)


def cp_split(comm: Comm, impl: str) -> CPSplit:
    return CPSplit(comm.size, comm.rank, impl != "ulysses")


def apply_context_parallel(model: nn.Module, comm: Comm, impl: str, plan, sp: bool,
                           flex: bool = False) -> ContextParallel:
    """Swap every attention core for the CP one (after activation checkpointing: a CP core saves only
    q, k, v, the output and its log-sum-exp, so selective AC leaves it alone) and, unless SP's hook
    does it (composed with this split), pass each rank's true positions to the model. `flex`: the
    model attends with FlexAttention (all-gather only: its causal rows are then a BlockMask)."""
    from .cp_allgather import AllGatherAttentionCore, CausalRows, gather_docs_hook
    from .tensor_parallel import positions_hook

    cp = ContextParallel(comm, cp_split(comm, impl), impl)
    causal = CausalRows(cp.split, flex)
    args = model.args
    pad = impl != "ulysses" and args.mla and args.v_head_dim != args.qk_head_dim  # layout.check_cp: v < qk
    for parent, attr in plan.attention_cores(model):
        inner = getattr(parent, attr)
        inner = getattr(inner, "_wrapped", inner)  # a selective-AC wrapper: the plain core inside
        core = (RingAttentionCore(comm) if impl == "ring" else UlyssesAttentionCore(comm, inner) if impl == "ulysses"
                else AllGatherAttentionCore(comm, inner, causal))
        setattr(parent, attr, PaddedValues(core) if pad else core)
    if impl != "ring":  # the cores that take a mask get the whole sequence's document ids
        model.register_forward_pre_hook(gather_docs_hook(comm, zigzag=impl == "allgather"), with_kwargs=True)
    if not sp:
        model.register_forward_pre_hook(positions_hook(1, plan, cp.split), with_kwargs=True)
    return cp
