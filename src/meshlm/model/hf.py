"""Hugging Face weights as meshlm tensors: the RoPE permutation, expert stacking and safetensors reads
of one parameter at a time (no distributed import: a rank asks for what it holds, nothing more).

RoPE: meshlm rotates interleaved pairs (d0, d1), (d2, d3), ... of each head; transformers rotates
the halves (d_i, d_{i+hd/2}). Both use frequency i for pair i, so converting is a fixed permutation of
the rows of wq and wk inside each head: meshlm row 2i+a is transformers row a·hd/2 + i. The q/k biases
(Qwen2) are permuted with their rows, the q/k norm gains (Qwen3, [head_dim]) as one head.

Experts: meshlm stacks a block's experts ([E, hidden, dim] for w1/w3, [E, dim, hidden] for w2);
Mixtral stores expert j's `w1`/`w2`/`w3` as tensors of their own, same orientation.

DeepSeek-V2/V3 (model/mla.py) rotate interleaved pairs as meshlm does: no permutation. Their MoE
selection bias (`e_score_correction_bias`) is read and written like a weight, and an MTP module's
layer carries copies of the shared embedding and head on export (hf_config.hf_copies).
"""
from __future__ import annotations

import glob
import os
from typing import Callable

import torch

from ..core.files import json_field
from . import safetensors_io as st
from ..core.model_args import ModelArgs
from ..core.hf_config import hf_copies, hf_names, param_shapes, stacked

ROPE_ROWS = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
             "attention.q_norm.weight", "attention.k_norm.weight")


def rope_rows_from_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows [heads·hd, ...] in transformers' half layout -> meshlm's interleaved pairs (whole heads)."""
    h = w.shape[0] // head_dim
    return w.reshape(h, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_rows_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    h = w.shape[0] // head_dim
    return w.reshape(h, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_meshlm(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    return rope_rows_from_hf(t, args.head_dim) if name.endswith(ROPE_ROWS) and not args.mla else t


def to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    return rope_rows_to_hf(t, args.head_dim) if name.endswith(ROPE_ROWS) and not args.mla else t


def hf_tensors(name: str, t: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The transformers tensors (name -> value) that meshlm parameter `name` (full, unpadded value `t`)
    becomes on export: the one seam every exporter goes through (stacked experts: one per expert)."""
    names = hf_names(name, args)
    if stacked(name):
        return {n: e.clone() for n, e in zip(names, t.unbind(0))}  # own storage: safetensors refuses shared
    out = to_hf(name, t, args)
    return {names[0]: out, **{n: out.clone() for n in hf_copies(name, args)}}


class HFWeights:
    """The safetensors files of a transformers model directory (one file or an index of shards), read
    one tensor at a time without mapping the files (model/safetensors_io.py: bounded memory)."""

    def __init__(self, hf_dir: str):
        self.dir, self._headers = hf_dir, {}
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            wmap = json_field(index, "weight_map", "a safetensors index")
            self.files = {k: os.path.join(hf_dir, v) for k, v in wmap.items()}
            missing = sorted({p for p in self.files.values() if not os.path.isfile(p)})
            if missing:
                raise ValueError(f"{index}: lists {missing[0]}, which does not exist")
            return
        paths = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
        if not paths:
            raise ValueError(f"{hf_dir}: no *.safetensors weights (only safetensors are read, never pickles)")
        self.files = {}
        for p in paths:
            for k in self._header(p):
                self.files[k] = p

    def _header(self, path: str) -> dict[str, st.Entry]:
        if path not in self._headers:
            self._headers[path] = st.read_header(path)[0]
        return self._headers[path]

    def _entry(self, name: str) -> st.Entry:
        entry = self._header(self.files[name]).get(name)
        if entry is None:
            raise ValueError(f"{self.files[name]}: has no tensor {name} (the index lists it there)")
        return entry

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name` in `dtype` (default: as stored), read whole into its own storage."""
        return st.read(self._entry(name), dtype)

    def check(self, args: ModelArgs) -> None:
        """Every parameter the config implies is present with its shape (read from the headers only)."""
        for name, shape in param_shapes(args).items():
            try:
                names = hf_names(name, args)
            except KeyError:
                raise ValueError(f"{self.dir}: {name} has no Hugging Face tensor") from None
            want = tuple(shape[1:]) if stacked(name) else tuple(shape)
            for hn in names:
                if hn not in self.files:
                    raise ValueError(f"{self.dir}: tensor {hn} is missing (config.json implies it)")
                got = self.shape(hn)
                if got != want:
                    raise ValueError(f"{self.files[hn]}: {hn} has shape {list(got)}, config.json implies "
                                     f"{list(want)}")

    def tensor(self, name: str, args: ModelArgs) -> torch.Tensor:
        """meshlm parameter `name` (single-process, unpadded) in fp32; stacked experts are read one
        expert at a time into the [E, ...] tensor."""
        if name == "output.weight" and args.tie_embeddings:
            name = "tok_embeddings.weight"
        names = hf_names(name, args)
        if stacked(name):
            first = self.get(names[0], torch.float32)
            out = torch.empty((len(names), *first.shape), dtype=torch.float32)
            out[0] = first
            for j, hn in enumerate(names[1:], 1):
                out[j] = self.get(hn, torch.float32)
            return out
        return to_meshlm(name, self.get(names[0], torch.float32), args)


def hf_source(hf_dir: str, args: ModelArgs) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """A value source for `init.materialize`: the full value of one parameter from the HF files, its
    rows zero-padded when the layout pads the vocabulary (model.vocab_multiple)."""
    weights = HFWeights(hf_dir)

    def value(name: str, full_shape: tuple[int, ...]) -> torch.Tensor:
        t = weights.tensor(name, args)
        if tuple(full_shape) != tuple(t.shape):
            if len(full_shape) != t.dim() or full_shape[1:] != t.shape[1:] or full_shape[0] < t.shape[0]:
                raise ValueError(f"{hf_dir}: {name} has shape {list(t.shape)}, the model needs "
                                 f"{list(full_shape)}")
            t = torch.cat([t, t.new_zeros(full_shape[0] - t.shape[0], *t.shape[1:])])
        return t
    return value
