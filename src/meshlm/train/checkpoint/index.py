"""Reading a checkpoint without running arbitrary code: DCP's index through an unpickler that admits
DCP's own metadata classes only, checks that name the file or tensor at fault, and one full tensor
read straight from its stored chunks (conversion and export, no process group)."""
from __future__ import annotations

import io
import os
import pickle
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # DCP's classes are imported where a checkpoint is read (pieces.py says why)
    from torch.distributed.checkpoint.metadata import Metadata


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the file or tensor."""


# -- reading the index without unpickling arbitrary objects ----------------------------------------
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension",
                 "torch.distributed.checkpoint.storage", "torch.distributed.checkpoint._hf_utils")
_SAFE_NAMES = {("torch", "Size"), ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
               ("torch", "float64"), ("torch", "uint8"), ("torch", "int64"), ("torch", "int32"),
               ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "preserve_format"),
               ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
               ("torch", "layout"), ("torch", "memory_format"), ("torch", "dtype"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
               ("pathlib", "Path")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _SAFE_MODULES or (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def read_metadata(path: str) -> Metadata:
    """The checkpoint's DCP index, or a CheckpointError naming the file."""
    from torch.distributed.checkpoint.metadata import Metadata
    f = os.path.join(path, ".metadata")
    try:
        with open(f, "rb") as fh:
            md = _Unpickler(io.BytesIO(fh.read())).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {f} is missing (not a complete checkpoint)") from None
    except Exception as e:  # noqa: BLE001 - truncated or foreign: one line
        raise CheckpointError(f"checkpoint {path}: cannot read {f} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'corrupt'})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint {path}: {f} is not a DCP index")
    return md


def check_files(path: str, md: Metadata) -> None:
    """Every data file the index names exists and is long enough (a truncated file is named here,
    not by a traceback from inside torch)."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = os.path.join(path, rel)
        have = os.path.getsize(f) if os.path.isfile(f) else -1
        if have < size:
            raise CheckpointError(f"checkpoint {path}: {f} is {'missing' if have < 0 else 'truncated'} "
                                  f"({max(have, 0)} of {size} bytes)")


def check_shapes(path: str, md: Metadata, shapes: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds every tensor of `shapes` (in that order) with that shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    for key, shape in shapes.items():
        got = md.state_dict_metadata.get(key)
        if got is None:
            raise CheckpointError(f"checkpoint {path}: has no tensor {key} (another model?)")
        if not isinstance(got, TensorStorageMetadata) or tuple(got.size) != tuple(shape):
            have = tuple(got.size) if isinstance(got, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(f"checkpoint {path}: {key} has shape {have}, this model's is {tuple(shape)}")


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a seekable stream of their own (one stored
    chunk, for torch.load), read without copying them first."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.length, pos + (0, self.pos, self.length)[whence]))
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.length - self.pos)
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) if n > 0 else 0
        self.pos += got
        return got


def read_full(path: str, md: Metadata, key: str) -> torch.Tensor:
    """The whole tensor `key` of checkpoint `path` (index `md`, checked by the caller) in one process,
    chunk by chunk: a chunk that is the whole tensor is returned as loaded (no second copy), else the
    chunks are copied into one tensor, one chunk in memory at a time."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    tmd = md.state_dict_metadata[key]
    out = None
    for chunk in tmd.chunks:
        info = md.storage_data[MetadataIndex(key, chunk.offsets)]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {path}: {key} is stored transformed ({info.transform_descriptors})")
        with open(os.path.join(path, info.relative_path), "rb") as f:
            try:
                t = torch.load(_Window(f, info.offset, info.length), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - a corrupt chunk: one line naming it
                raise CheckpointError(f"checkpoint {path}: cannot read {key} from {info.relative_path} "
                                      f"({type(e).__name__})") from None
        if tuple(t.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"checkpoint {path}: {key} chunk at {tuple(chunk.offsets)} has shape "
                                  f"{tuple(t.shape)}, the index says {tuple(chunk.sizes)}")
        if len(tmd.chunks) == 1 and tuple(t.shape) == tuple(tmd.size):
            return t
        if out is None:
            out = torch.empty(tuple(tmd.size), dtype=t.dtype)
        region = out
        for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region = region.narrow(d, o, n)
        region.copy_(t)
        del t
    return out
