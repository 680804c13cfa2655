"""Tokenizers: a dependency-free byte tokenizer and a thin wrapper over HF `tokenizers`.

Both expose the same tiny interface (vocab_size, encode, decode, name) so the
rest of meshlm never needs to know which one is in use.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "DocumentFraming", "framing"]

# End-of-document tokens of the common vocabularies, in the order they are tried when no
# tokenizer_config.json names one: Llama 3, GPT-2/Qwen/most BPEs, Llama 2/Mistral, Gemma.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
# The byte tokenizer has no spare id: documents are separated by a blank line instead.
BYTE_DOC_SEPARATOR = (10, 10)


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no file, so the default corpus works offline."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for data preparation (avoids a Python list per byte)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

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

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Without the post-processor's special tokens: `DocumentFraming` adds them once per document."""
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

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


class DocumentFraming:
    """What surrounds each document's tokens in a prepared stream: the tokens the tokenizer's
    post-processor puts around a text (Llama 3: <|begin_of_text|> before), then one end-of-document
    token (unless the post-processor already ends with it). The byte tokenizer: a blank line after."""

    def __init__(self, prefix: tuple[int, ...], suffix: tuple[int, ...], eos: int | None, eos_token: str | None):
        self.prefix, self.suffix, self.eos, self.eos_token = prefix, suffix, eos, eos_token

    def to_dict(self) -> dict:
        return {"prefix": list(self.prefix), "suffix": list(self.suffix), "eos": self.eos,
                "eos_token": self.eos_token}


def _configured_eos(tokenizer_json: str) -> str | None:
    """`eos_token` of the tokenizer_config.json beside a tokenizer.json (the transformers layout)."""
    path = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return eos.get("content") if isinstance(eos, dict) else eos


def framing(tok, eos: str | None = None) -> DocumentFraming:
    """How documents are delimited for `tok`; `eos` (a token string) overrides the configured one.
    A vocabulary with no end-of-document token we can find is refused in one line."""
    if isinstance(tok, ByteTokenizer):
        if eos is not None:
            raise ValueError("--eos: the byte tokenizer has no special tokens (documents end with a blank line)")
        return DocumentFraming((), BYTE_DOC_SEPARATOR, None, None)
    hf = tok._tok
    where = "--eos"
    if eos is None:
        eos, where = _configured_eos(tok.name), "tokenizer_config.json eos_token"
    if eos is None:
        specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
        eos = next((c for c in EOS_CANDIDATES if c in specials), None)
        where = "the tokenizer's special tokens"
    if eos is None:
        raise ValueError(f"data.tokenizer: {tok.name} names no end-of-document token (no tokenizer_config.json "
                         f"eos_token beside it, none of {', '.join(EOS_CANDIDATES)}); pass --eos TOKEN")
    eos_id = hf.token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"{where}: {eos!r} is not a token of {tok.name}")
    plain = hf.encode("x", add_special_tokens=False).ids
    full = hf.encode("x").ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    prefix, suffix = tuple(full[:at]), tuple(full[at + len(plain):])
    if not suffix or suffix[-1] != eos_id:
        suffix = suffix + (eos_id,)
    return DocumentFraming(prefix, suffix, eos_id, eos)
