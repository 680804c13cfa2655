"""Hugging Face Llama weights as meshlm tensors: the RoPE row permutation and safetensors reads of one
parameter at a time (no distributed import: a rank asks for what it holds, nothing more).

RoPE: meshlm rotates interleaved pairs (d0, d1), (d2, d3), ... of each head; transformers rotates
the halves (d_i, d_{i+hd/2}). Both use frequency i for pair i, so converting is a fixed permutation of
the rows of wq and wk inside each head: meshlm row 2i+a is transformers row a·hd/2 + i.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Callable

import torch

from . import safetensors_io as st
from .args import ModelArgs
from .hf_config import hf_name, param_shapes

ROPE_ROWS = ("attention.wq.weight", "attention.wk.weight")


def rope_rows_from_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows [heads·hd, ...] in transformers' half layout -> meshlm's interleaved pairs (whole heads)."""
    h = w.shape[0] // head_dim
    return w.reshape(h, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_rows_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    h = w.shape[0] // head_dim
    return w.reshape(h, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_meshlm(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    return rope_rows_from_hf(t, args.head_dim) if name.endswith(ROPE_ROWS) else t


def to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    return rope_rows_to_hf(t, args.head_dim) if name.endswith(ROPE_ROWS) else t


def hf_tensors(name: str, t: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The transformers tensors (name -> value) that meshlm parameter `name` (full, unpadded value `t`)
    becomes on export: the one seam every exporter goes through (one meshlm tensor may be several)."""
    return {hf_name(name): to_hf(name, t, args)}


class HFWeights:
    """The safetensors files of a transformers model directory (one file or an index of shards), read
    one tensor at a time without mapping the files (model/safetensors_io.py: bounded memory)."""

    def __init__(self, hf_dir: str):
        self.dir, self._headers = hf_dir, {}
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    wmap = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
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
            hn = hf_name(name)
            if hn not in self.files:
                raise ValueError(f"{self.dir}: tensor {hn} is missing (config.json implies it)")
            got = self.shape(hn)
            if got != shape:
                raise ValueError(f"{self.files[hn]}: {hn} has shape {list(got)}, config.json implies {list(shape)}")

    def tensor(self, name: str, args: ModelArgs) -> torch.Tensor:
        """meshlm parameter `name` (single-process, unpadded) in fp32."""
        if name == "output.weight" and args.tie_embeddings:
            name = "tok_embeddings.weight"
        return to_meshlm(name, self.get(hf_name(name), torch.float32), args)


def hf_source(hf_dir: str, args: ModelArgs) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """A value source for `init.materialize`: the full value of one parameter from the HF files, its
    rows zero-padded when the layout pads the vocabulary (model.vocab_multiple)."""
    weights = HFWeights(hf_dir)

    def value(name: str, full_shape: tuple[int, ...]) -> torch.Tensor:
        t = weights.tensor(name, args)
        if tuple(full_shape) != tuple(t.shape):
            if len(full_shape) != t.dim() or full_shape[1:] != t.shape[1:] or full_shape[0] < t.shape[0]:
                raise ValueError(f"{hf_dir}: {hf_name(name)} has shape {list(t.shape)}, the model needs "
                                 f"{list(full_shape)}")
            t = torch.cat([t, t.new_zeros(full_shape[0] - t.shape[0], *t.shape[1:])])
        return t
    return value
