"""Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention (SDPA), SwiGLU; with multi-head latent
attention (model/mla.py) and multi-token-prediction modules (MTPModule, model/mtp.py) it is the
DeepSeek-V3 shape.

Head counts are read from the weight shapes at run time, so tensor parallelism only has to slice
weights; the module never needs to know how many ranks share it. Blocks live in a ModuleDict keyed by
their global index so parameter names stay the same when a pipeline stage keeps only some of them.
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.model_args import ModelArgs
from .feed_forward import FeedForward
from .flex import flex_block_mask
from .layers import (AttentionCore, HeadRMSNorm, RMSNorm, apply_rope, rope_attention_factor, rope_frequencies,
                     rope_tables)
from .mla import MLA
from .moe import MoE

# the shared pieces live in layers.py; importing them from here keeps working
__all__ = ["Attention", "Block", "Llama", "MTPModule", "FeedForward", "AttentionCore", "HeadRMSNorm", "RMSNorm",
           "apply_rope",
           "rope_frequencies", "rope_tables"]


def document_mask(docs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] document ids -> [B, 1, R, S] boolean mask: causal, and never across documents (data.
    document_mask), for the queries at positions `rows` [R] of the sequence (None: all of it; all-gather
    context parallelism: this rank's tokens). Positions are not restarted per document: RoPE scores
    depend only on the distance between two tokens of one document, so a restart would change nothing
    (docs/data.md)."""
    keys = torch.arange(docs.shape[1], device=docs.device)
    rows = keys if rows is None else rows
    causal = rows[:, None] >= keys[None, :]
    return (docs[:, None, rows, None] == docs[:, None, None, :]) & causal


def attention_mask(kernel: str, docs: torch.Tensor | None, seq: int, device: torch.device,
                   positions: torch.Tensor | None = None, rows: str = "own"):
    """The mask every block of one forward shares: None (causal SDPA), the dense document mask (SDPA),
    or a FlexAttention BlockMask (causal, and inside one document when `docs` is given). `rows`
    (ModelArgs.mask_rows): "own", the `seq` tokens attended; under context parallelism `docs` are the
    whole sequence's and the queries are this rank's at `positions` ("local") or all of them ("all"),
    and without documents the CP core masks causal attention itself: no mask."""
    if rows == "own":
        return flex_block_mask(docs, seq, device) if kernel == "flex" else \
            None if docs is None else document_mask(docs)
    if docs is None:
        return None
    local = positions if rows == "local" else None
    if kernel == "flex":
        return flex_block_mask(docs, seq if local is not None else docs.shape[1], device, local)
    return document_mask(docs, local)


class Attention(nn.Module):
    """Grouped-query attention; `qkv_bias` adds biases to wq/wk/wv (Qwen2), `qk_norm` an RMSNorm over
    each head of q and k before RoPE (Qwen3: q_norm / k_norm, one [head_dim] gain shared by all heads)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = hd = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = HeadRMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.k_norm = HeadRMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[0], q.shape[1]  # not x's: under SP the region's entry gathers x inside wq/wk/wv
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:  # a mask only with document masking (context-parallel cores take none)
            qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            out = self.core(*qkv) if mask is None else self.core(*qkv, mask)
        else:  # generation: a kv_cache.LayerKV
            out = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = MLA(args) if args.mla else Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_block(layer):
            self.feed_forward: nn.Module = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MTPModule(nn.Module):
    """One DeepSeek-V3 multi-token-prediction depth (§2.2): [RMSNorm(embedding of the token ahead);
    RMSNorm(previous depth's representation)] → projection (2·dim → dim) → one block (block
    n_layers + depth: MoE as that block would be) → RMSNorm. The embedding and the output head are the
    model's. The representations passed between depths are normalised ones, the head's input, as
    DeepSeek's released MTP weights are run (transformers' MtpLayer, vLLM): depth 0 takes the main
    model's final norm output."""

    def __init__(self, args: ModelArgs, depth: int):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = Block(args, args.n_layers + depth)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask=None) -> torch.Tensor:
        x = self.proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
        return self.norm(self.block(x, cos, sin) if mask is None else self.block(x, cos, sin, None, mask))


class Llama(nn.Module):
    """forward(tokens [B, S]) -> logits [B, S, V] (the final norm's output [B, S, dim] when `head_in_loss`).

    A pipeline stage sets `tok_embeddings`, `norm` or `output` to None and drops blocks; it then takes
    or returns hidden states [B, S, dim] instead. `mtp` (model.mtp_depth > 0) holds the MTP modules;
    forward never runs them: mtp.mtp_loss does.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm: nn.Module | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp: nn.ModuleDict | None = nn.ModuleDict(
            {str(k): MTPModule(args, k) for k in range(args.mtp_depth)}) if args.mtp_depth else None
        self.rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # True: forward ends at the final norm and the loss calls `output` with the targets
        # (training.loss_chunks: the head's logits are made chunk by chunk inside the loss)
        self.head_in_loss = False

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Kept out of the state dict and the parameter list: it is derived, never trained or saved.
        if self.rope_cache is None or self.rope_cache[0].device != device or self.rope_cache[0].shape[0] < seq_len:
            n = max(self.args.max_seq_len, seq_len)
            cos, sin = rope_tables(rope_frequencies(self.args), n, rope_attention_factor(self.args))
            self.rope_cache = (cos.to(device), sin.to(device))
        return self.rope_cache

    def positional(self, seq: int, device: torch.device, positions: torch.Tensor | None = None, cache=None,
                   docs: torch.Tensor | None = None):
        """(cos, sin, mask) every block of one forward over `seq` tokens shares (see forward)."""
        cos, sin = self.rope(seq if cache is None else cache.max_len, device)
        if cache is not None and positions is None:
            positions = cache.positions(seq, device)
        if positions is None:
            cos, sin = cos[:seq], sin[:seq]
        else:
            cos, sin = cos[positions], sin[positions]
        # cos covers the positions attention sees (under SP more than this rank's shard of h)
        mask = None if cache is not None else attention_mask(self.args.attn_kernel, docs, cos.shape[0], device,
                                                                positions, self.args.mask_rows)
        return cos, sin, mask

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None, *,
                blocks: list[str] | None = None, embed: bool | None = None, head: bool | None = None,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """`blocks`, `embed`, `head`: run only these blocks (keys of `layers`) and the embedding / head
        or not (default: whatever the model holds). A pipeline stage runs its chunk this way.
        `cache`: a kv_cache.KVCache (generation only); the tokens continue at its position.
        `docs`: [B, S] document id per token: attention stays inside each document."""
        embed = self.tok_embeddings is not None if embed is None else embed
        head = self.output is not None if head is None else head
        h = self.tok_embeddings(x) if embed else x
        cos, sin, mask = self.positional(h.shape[1], h.device, positions, cache, docs)
        for key in self.layers if blocks is None else blocks:
            if cache is not None:
                h = self.layers[key](h, cos, sin, cache.layers[key])
            else:
                h = self.layers[key](h, cos, sin) if mask is None else self.layers[key](h, cos, sin, None, mask)
        if cache is not None:
            cache.advance(x.shape[1])
        if head:
            h = self.norm(h)
            if not self.head_in_loss:
                h = self.output(h)
        return h
