"""Tokenizers: a dependency-free byte tokenizer and a thin wrapper over HF `tokenizers`.

Both expose the same tiny interface (vocab_size, encode, decode, name) so the
rest of meshlm never needs to know which one is in use.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no file, so the default corpus works offline."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for data preparation (avoids a Python list per byte)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """Wraps a `tokenizer.json` so any HF-trained vocabulary can be used."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.name = os.path.abspath(path)
        self._tok = Tokenizer.from_file(self.name)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(spec: str):
    """'bytes' -> ByteTokenizer; anything else is a path to a tokenizer.json.

    Errors are a single-line ValueError so the CLI can print them as-is.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = os.path.abspath(os.path.expanduser(str(spec)))
    if not os.path.exists(path):
        reason = "file not found"
    elif os.path.isdir(path):
        reason = "is a directory, expected a tokenizer.json file"
    else:
        try:
            return HFTokenizer(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            lines = str(e).strip().splitlines()
            reason = lines[0] if lines else type(e).__name__
    raise ValueError(f"data.tokenizer: cannot read tokenizer '{spec}': {reason}")
