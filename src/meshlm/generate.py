"""`meshlm generate`: continue a prompt from a checkpoint with a KV cache, on CPU or one GPU.

The prompt runs through the model once (prefill); then each new token is one position through every
block, attending over the cached keys and values. `temperature 0` is greedy; otherwise tokens are
sampled from softmax(logits / T) cut to the smallest set of probability ≥ top_p (nucleus sampling).
"""
from __future__ import annotations

import torch

from .model.kv_cache import KVCache


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """One token id from the last position's logits [V]."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, stop: int | None = None) -> list[int]:
    """New token ids after `prompt` (at most `max_new_tokens`; ends early at `stop`)."""
    if not prompt:
        raise ValueError("--prompt: empty after tokenisation")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.args, 1, len(prompt) + max_new_tokens, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    logits = model(torch.tensor([prompt], device=device), cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = sample(logits[: model.args.vocab_size], temperature, top_p, gen)
        out.append(tok)
        if tok == stop or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[tok]], device=device), cache=cache)[0, -1]
    return out
