"""Layout-independent initialisation (docs/architecture.md, invariant 2).

Each parameter's values come from a generator seeded by (seed, parameter name) alone, so any layout
that holds a slice of a parameter gets exactly the slice a single process would have had. Big models
are built on the meta device; `materialize` then allocates and fills only what this rank holds, one
parameter at a time (the full tensor of one parameter at most is ever on the host).
"""
from __future__ import annotations

import hashlib
import math
import re
from typing import Callable

import torch
from torch import nn

STD = 0.02
# Residual projections (scaled by 1/sqrt(2L), GPT-2 / Megatron): attention out, dense / shared / routed
# expert down-projections.
_RESIDUAL = re.compile(r"(attention\.wo\.weight|feed_forward\.w2\.weight|feed_forward\.shared\.w2\.weight"
                       r"|feed_forward\.experts\.\d+\.w2)$")
_STACKED = re.compile(r"(.*\.experts)\.(w[123])$")  # [E, ...] expert weights: one seed per expert


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, n_layers: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (its unsharded, single-process name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith((".bias", ".expert_bias")):  # q/k/v biases (model.qkv_bias) and the MoE selection bias
        return torch.zeros(shape)                     # start at zero, as in Megatron and transformers
    stacked = _STACKED.match(name)
    if stacked:  # expert e's slice is seeded by its own name, so an EP rank's slice equals one process's
        return torch.stack([init_tensor(f"{stacked[1]}.{e}.{stacked[2]}", tuple(shape[1:]), seed, n_layers)
                            for e in range(shape[0])])
    g = torch.Generator().manual_seed(name_seed(seed, name))
    std = STD
    if _RESIDUAL.search(name):
        std = STD / math.sqrt(2 * n_layers)
    return torch.empty(shape).normal_(0.0, std, generator=g)


# A slicer turns the full value of a parameter into this rank's local piece.
Slicer = Callable[[torch.Tensor], torch.Tensor]


def materialize(model: nn.Module, seed: int, device: torch.device | str, dtype: torch.dtype = torch.float32,
                full_shapes: dict[str, tuple[int, ...]] | None = None,
                slicers: dict[str, Slicer] | None = None,
                source: Callable[[str, tuple[int, ...]], torch.Tensor] | None = None) -> None:
    """Allocate every parameter of `model` on `device` and fill it from its name.

    `full_shapes` / `slicers` come from the parallelizer: the shape of the unsharded parameter and how
    to cut this rank's part out of it. Without them the parameter is taken as whole. `source`
    (single-process name, full shape) -> full value replaces the random init (model.init_from).
    """
    full_shapes = full_shapes or {}
    slicers = slicers or {}
    n_layers = model.args.n_layers
    seen: dict[int, nn.Parameter] = {}
    for mod_name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in seen:  # tied weights: keep the tie
                setattr(mod, pname, seen[id(p)])
                continue
            shape = tuple(full_shapes.get(fqn, p.shape))
            value = (source(canonical_name(fqn), shape) if source is not None
                     else init_tensor(canonical_name(fqn), shape, seed, n_layers))
            if fqn in slicers:
                # clone: a slice is a view, and keeping it would keep the whole tensor's storage alive
                value = slicers[fqn](value).clone()
            new = nn.Parameter(value.to(device=device, dtype=dtype).contiguous(), requires_grad=p.requires_grad)
            setattr(mod, pname, new)
            seen[id(p)] = new
    _materialize_buffers(model, seed, device, n_layers, source)
    for buf_name, buf in list(model.named_buffers()):
        if buf.is_meta:
            raise RuntimeError(f"buffer {buf_name} is still on the meta device")


def _materialize_buffers(model: nn.Module, seed: int, device, n_layers: int, source) -> None:
    """Model state that is not a parameter (the MoE selection bias): whole on every rank, fp32, from
    `source` or `init_tensor` like a parameter."""
    for mod_name, mod in list(model.named_modules()):
        for bname, buf in list(mod.named_buffers(recurse=False)):
            if buf is None or not buf.is_meta:
                continue
            name = canonical_name(f"{mod_name}.{bname}" if mod_name else bname)
            shape = tuple(buf.shape)
            value = source(name, shape) if source is not None else init_tensor(name, shape, seed, n_layers)
            mod.register_buffer(bname, value.to(device=device, dtype=torch.float32),
                                persistent=bname not in mod._non_persistent_buffers_set)


def canonical_name(fqn: str) -> str:
    """The single-process name of a parameter, with wrapper prefixes (checkpointing, compile) removed."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_wrapped."):
        fqn = fqn.replace(junk, "")
    return fqn


def init_source(init_from: str, args) -> Callable[[str, tuple[int, ...]], torch.Tensor] | None:
    """The value source for `materialize` named by `model.init_from` ("" = random init)."""
    if not init_from:
        return None
    from .hf import hf_source
    return hf_source(init_from[len("hf:"):], args)
