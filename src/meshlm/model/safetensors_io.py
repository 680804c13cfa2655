"""safetensors files read and written one tensor at a time, in bounded memory.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes
of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data
(offsets relative to its start, row-major, little-endian). `safetensors.safe_open` maps the whole
file, and every page it touches stays resident in the process until the handle closes, so a
conversion reading a model through it grows to the model's size; `save_file` needs all of a file's
tensors at once. Here a tensor is read with `readinto` straight into its own storage (a dtype change
goes through a fixed-size chunk), and a file is written from its header, known up front, then
tensor after tensor, converted chunk by chunk.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
CHUNK = 1 << 20  # bytes converted at a time when the dtype changes (the only memory beyond the tensor)
MAX_HEADER = 100 << 20


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A byte buffer over contiguous CPU tensor `t`'s data (no copy; used at once, while `t` lives).
    Through ctypes, not `.numpy()`, which would pin the storage (it could no longer be released)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("safetensors io: a contiguous CPU tensor is needed")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


class Entry:
    """One tensor's place in a file: dtype, shape and absolute byte range."""

    def __init__(self, path: str, name: str, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.path, self.name, self.dtype, self.shape, self.begin, self.end = path, name, dtype, shape, begin, end


def read_header(path: str) -> tuple[dict[str, Entry], dict]:
    """(name -> Entry, __metadata__) of safetensors file `path`; ValueError naming the file if malformed."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
        start, size = 8 + n, os.path.getsize(path)
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(s) for s in e["shape"])
            b, end = (int(x) + start for x in e["data_offsets"])
            if end - b != math.prod(shape) * dtype.itemsize or end > size:
                raise ValueError(f"{name}: data_offsets do not fit its shape or the file")
            out[name] = Entry(path, name, dtype, shape, b, end)
        return out, header.get("__metadata__") or {}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def read(entry: Entry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor of `entry`, in `dtype` (default: as stored); memory: the result plus at most CHUNK."""
    dtype = dtype or entry.dtype
    out = torch.empty(entry.shape, dtype=dtype)
    with open(entry.path, "rb", buffering=0) as f:
        f.seek(entry.begin)
        if dtype == entry.dtype:
            _read_exact(f, _bytes_view(out))
            return out
        flat, per = out.reshape(-1), max(1, CHUNK // entry.dtype.itemsize)
        buf = torch.empty(min(per, flat.numel()), dtype=entry.dtype)
        for i in range(0, flat.numel(), per):
            part = buf[: min(per, flat.numel() - i)]
            _read_exact(f, _bytes_view(part))
            flat[i:i + part.numel()].copy_(part)
    return out


def _read_exact(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"{f.name}: truncated")
        got += n


class Writer:
    """A safetensors file written tensor by tensor in the order of `entries` [(name, dtype, shape)]."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        off = 0
        for name, dtype, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.todo = [(name, dtype, tuple(shape)) for name, dtype, shape in entries]
        self.nbytes = off
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        """The next tensor (its name and shape as announced), converted to the announced dtype."""
        want, dtype, shape = self.todo.pop(0)
        if name != want or tuple(t.shape) != shape:
            raise ValueError(f"safetensors writer: got {name} {tuple(t.shape)}, expected {want} {shape}")
        flat = t.detach().reshape(-1)
        if flat.dtype == dtype and flat.is_contiguous() and flat.device.type == "cpu":
            self.f.write(_bytes_view(flat))
            return
        per = max(1, CHUNK // max(dtype.itemsize, flat.element_size()))
        for i in range(0, flat.numel(), per):
            part = flat[i:i + per].to("cpu", dtype).contiguous()  # kept alive while its bytes are written
            self.f.write(_bytes_view(part))

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.f.close()
        if exc_type is None and self.todo:
            raise ValueError(f"safetensors writer: {self.todo[0][0]} was never written")
