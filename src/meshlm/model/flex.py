"""FlexAttention (model.attn_impl = "flex"): causal and document-masked attention on its fused kernels.

A dense [B,1,S,S] mask takes SDPA off its flash kernels; a BlockMask built once per forward from the
document ids (shared by every block) lets flex_attention skip whole blocks of keys and stay fused.
On CUDA flex_attention runs compiled (its Triton kernels, forward and backward). torch has no flex
backward on a CPU (NotImplementedError, in eager and compiled mode alike): there the forward is
flex_attention's and the gradients come from SDPA over the same mask rebuilt densely from the
BlockMask's mask function, so CPU runs and tests train through the same masks and forward kernel.
torch.nn.attention.flex_attention is imported on first use: it imports torch._dynamo.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd import Function

_COMPILED: dict = {}


BLOCK = 128  # FlexAttention's default BlockMask block (the planner's ops.FLEX_BLOCK)


def _span(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of `block` along the last dim: the least and the greatest value ([..., n_blocks])."""
    n = -(-x.shape[-1] // block)
    pad = n * block - x.shape[-1]  # a short last block, padded with its own last element
    blocks = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1).unflatten(-1, (n, block))
    return blocks.amin(-1), blocks.amax(-1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, H, nq, nkv] block map as FlexAttention's (count, indices): the kept kv blocks of each
    query block first, in order."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def flex_block_mask(docs: torch.Tensor | None, seq: int, device: torch.device,
                    rows: torch.Tensor | None = None, keys: int | None = None, block: int = BLOCK):
    """A BlockMask over [seq, seq]: causal, and with `docs` ([B, S] document id per token) never across
    documents. Positions are not restarted per document (RoPE is relative; docs/data.md). `rows`: the
    true positions of the `seq` queries among `keys` keys (all-gather context parallelism: this rank's
    zig-zag tokens against the whole sequence, parallel/dims/cp_allgather.py).

    Built from block bounds, never from the [B, seq, keys] mask (create_block_mask evaluates the mask
    function at every pair: at 131K keys and 8K rows that is 10⁹ elements and int64 temporaries of
    8 GB): a key block is kept where some query of the block may see some key of it (positions reach
    it, document ranges meet) and is full where every pair is visible (all past it, one document);
    the mask function decides the pairs of the partial blocks. Memory: B·(seq/128)·(keys/128)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_keys = seq if rows is None else (docs.shape[1] if docs is not None else keys)
    pos = torch.arange(seq, device=device) if rows is None else rows
    kv = torch.arange(n_keys, device=device)
    (q_lo, q_hi), (k_lo, k_hi) = _span(pos, block), _span(kv, block)
    reach = q_hi[:, None] >= k_lo[None, :]  # some query at or past some key
    # every query past every key; a short last block is never full (torch's map does the same)
    whole_q = torch.arange(len(q_lo), device=device) < seq // block
    whole_k = torch.arange(len(k_lo), device=device) < n_keys // block
    past = (q_lo[:, None] >= k_hi[None, :]) & whole_q[:, None] & whole_k[None, :]

    def at(q):  # a query's true position (contiguous rows: its index, no gather in the kernel)
        return q if rows is None else rows[q]

    if docs is None:
        def mask_mod(b, h, q, k):
            return at(q) >= k
        keep, full = reach[None, None], past[None, None]
    else:
        (dq_lo, dq_hi), (dk_lo, dk_hi) = _span(docs[:, pos], block), _span(docs, block)
        meet = (dq_hi[:, :, None] >= dk_lo[:, None, :]) & (dq_lo[:, :, None] <= dk_hi[:, None, :])
        one = (dq_lo == dq_hi)[:, :, None] & (dk_lo == dk_hi)[:, None, :] & (dq_lo[:, :, None] == dk_lo[:, None, :])

        def mask_mod(b, h, q, k):
            p = at(q)
            return (p >= k) & (docs[b, p] == docs[b, k])
        keep, full = (reach[None] & meet)[:, None], (past[None] & one)[:, None]
    partial = keep & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(seq, n_keys))


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu":  # the reference implementation is what runs here (module doc)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():  # eager flex is a reference
        # implementation, the compiled one the kernel (inside a compiled block it is compiled with it)
        fn = _COMPILED.get("flex")
        if fn is None:
            fn = _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


class _FlexSDPAGrad(Function):
    """flex_attention's forward, SDPA's gradients over the same mask (CPU only: see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask):
        ctx.save_for_backward(q, k, v)
        ctx.block_mask = block_mask
        return _flex(q.detach(), k.detach(), v.detach(), block_mask)

    @staticmethod
    def backward(ctx, g):
        from torch.nn.attention.flex_attention import create_mask

        q, k, v = ctx.saved_tensors
        bm = ctx.block_mask
        b = bm.kv_num_blocks.shape[0]  # 1 for a mask shared by the whole batch
        mask = create_mask(bm.mask_mod, b, None, q.shape[2], k.shape[2], device=q.device)
        with torch.enable_grad():
            qkv = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*qkv, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
            grads = torch.autograd.grad(out, qkv, g)
        return (*grads, None)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """softmax(QKᵀ)V over [B, H, S, D] with grouped-query heads, masked by `block_mask`."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlexSDPAGrad.apply(q, k, v, block_mask)
    return _flex(q, k, v, block_mask)
