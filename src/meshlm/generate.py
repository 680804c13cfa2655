"""`meshlm generate`: continue a prompt from a checkpoint with a KV cache, on CPU or one GPU.

The prompt runs through the model once (prefill); then each new token is one position through every
block, attending over the cached keys and values. `temperature 0` is greedy; otherwise tokens are
sampled from softmax(logits / T) cut to the smallest set of probability ≥ top_p (nucleus sampling).

Mixture-of-experts blocks route dropless while generating: a capacity limit is a training device
whose drops depend on how many tokens share a call, so with it the cached one-token steps and a
full recompute would route the same token differently.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager

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


@contextmanager
def dropless(model):
    """Every MoE block of `model` without its capacity limit for the duration (restored after)."""
    from .model.moe import MoE
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    saved = [m.capacity_factor for m in moes]
    for m in moes:
        m.capacity_factor = 0.0
    try:
        yield
    finally:
        for m, cf in zip(moes, saved):
            m.capacity_factor = cf


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, stop: int | None = None, use_cache: bool = True) -> list[int]:
    """New token ids after `prompt` (at most `max_new_tokens`; ends early at `stop`). `use_cache=False`
    runs the whole sequence again for every token: the reference the cache is checked against."""
    if not prompt:
        raise ValueError("--prompt: empty after tokenisation")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.args, 1, len(prompt) + max_new_tokens, device, dtype) if use_cache else None
    gen = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    out: list[int] = []
    with dropless(model):
        logits = model(torch.tensor([seq], device=device), cache=cache)[0, -1]
        for _ in range(max_new_tokens):
            tok = sample(logits[: model.args.vocab_size], temperature, top_p, gen)
            out.append(tok)
            seq.append(tok)
            if tok == stop or len(out) == max_new_tokens:
                break
            step = [[tok]] if use_cache else [seq]
            logits = model(torch.tensor(step, device=device), cache=cache)[0, -1]
    return out


def _stop_token(tok, ckpt_dir: str) -> int | None:
    """The end-of-sequence id named by a tokenizer_config.json beside the weights, if any."""
    path = os.path.join(ckpt_dir, "tokenizer_config.json")
    if not os.path.isfile(path) or tok.name == "bytes":
        return None
    with open(path) as f:
        eos = json.load(f).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    ids = tok._tok.token_to_id(eos) if isinstance(eos, str) else None
    return ids


def continuation(checkpoint: str, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, device: str = "auto") -> str:
    """The text a checkpoint (or a run directory's newest) writes after `prompt`: on the GPU in bf16
    when there is one, else on the CPU in fp32."""
    from .data.tokenizer import load_tokenizer
    from .train.convert import load_model, tokenizer_of
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model, cfg, meta, path = load_model(checkpoint)
    tok = load_tokenizer(tokenizer_of(path, cfg, meta, model.args.vocab_size))
    model = model.to(dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    ids = generate(model, tok.encode(prompt), max_new_tokens, temperature, top_p, seed, stop=_stop_token(tok, path))
    return tok.decode(ids)
