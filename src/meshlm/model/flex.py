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


def flex_block_mask(docs: torch.Tensor | None, seq: int, device: torch.device,
                    rows: torch.Tensor | None = None, keys: int | None = None):
    """A BlockMask over [seq, seq]: causal, and with `docs` ([B, S] document id per token) never across
    documents. Positions are not restarted per document (RoPE is relative; docs/data.md). `rows`: the
    true positions of the `seq` queries among `keys` keys (all-gather context parallelism: this rank's
    zig-zag tokens against the whole sequence, parallel/cp_allgather.py); flex then skips the key
    blocks above each query block's diagonal as it does for contiguous rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    n_keys = seq if rows is None else (docs.shape[1] if docs is not None else keys)
    if rows is None:
        def pos(q):
            return q
    else:
        def pos(q):
            return rows[q]

    if docs is None:
        def causal(b, h, q, kv):
            return pos(q) >= kv
        return create_block_mask(causal, None, None, seq, n_keys, device=device)

    def same_document(b, h, q, kv):
        p = pos(q)
        return (p >= kv) & (docs[b, p] == docs[b, kv])
    return create_block_mask(same_document, docs.shape[0], None, seq, n_keys, device=device)


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
