"""Pieces written and read through DCP's planners: every rank hands DCP only the rectangles it owns and
asks for the rectangles its own layout holds, whatever layout wrote them (resharding). Also a one-process
streaming save, one tensor in memory at a time. Imported on the first save or load only (pieces.py)."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .index import CheckpointError, check_files, check_shapes, read_metadata
from .pieces import Pieces

class CheckpointReader(dcp.FileSystemReader):
    """DCP's reader, with the index read by index.py's unpickler (DCP's own metadata classes only)."""

    def read_metadata(self, *args, **kwargs):
        return read_metadata(str(self.path))


def _find(state: dict[str, Pieces], index: MetadataIndex) -> torch.Tensor:
    for offsets, t in state[index.fqn].parts:
        if tuple(offsets) == tuple(index.offset):
            return t
    raise KeyError(f"{index.fqn}: no piece at {tuple(index.offset)}")


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default planner (dedup, global metadata, coverage checks) over our pieces."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if not obj.write:
                continue
            for offsets, t in obj.parts:
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape),
                        properties=TensorProperties(dtype=obj.dtype), size=torch.Size(obj.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        t = _find(self.state_dict, index)
        return self.state_dict[index.fqn].backing.read(t) if t.is_meta else t


class _LoadPlanner(DefaultLoadPlanner):
    """Reads, for each of our pieces, the overlapping parts of whatever chunks were stored."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator
        self.original_state_dict = state_dict

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in obj.parts]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _find(self.state_dict, index)

    def transform_tensor(self, read_item, tensor: torch.Tensor) -> torch.Tensor:
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(d, o, n)
        return tensor

    def resolve_tensor(self, read_item) -> torch.Tensor:
        """A piece kept in a file (meta): DCP reads into a fresh tensor, `commit_tensor` writes it."""
        t = super().resolve_tensor(read_item)
        return torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        dest = self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))
        if dest.is_meta:
            self.state_dict[read_item.dest_index.fqn].backing.write(dest, tensor)


class _LazySavePlanner(PiecesSavePlanner):
    """Asks `make(key)` for each tensor only when DCP writes it, so one tensor is in memory at a time.
    DCP's writer (one file per tensor, written before the next is asked for) keeps a reference to the
    tensor it wrote last until it has the next one: that tensor's storage is released here first."""

    def __init__(self, make):
        super().__init__()
        self.make, self.last = make, None

    def lookup_object(self, index: MetadataIndex):
        if self.last is not None:
            self.last.untyped_storage().resize_(0)
        self.last = None  # cleared first: a failing `make` must not leave a released tensor behind
        self.last = self.make(index.fqn)
        return self.last


def save_streaming(path: str, shapes: dict[str, tuple[int, ...]], make) -> None:
    """A one-process fp32 checkpoint of the tensors `shapes` (key -> full shape) whose values come from
    `make(key)` one at a time: one file per tensor (one file per rank would keep every tensor it has
    written alive until the file closes), in the format `load` and `read_full` read. `make` returns a
    new tensor each time: its storage is released once written."""
    state = {k: Pieces(tuple(s), torch.float32, [((0,) * len(s), torch.empty(s, device="meta"))], True)
             for k, s in shapes.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=False),
             planner=_LazySavePlanner(make))


# -- loading ---------------------------------------------------------------------------------------
def load(path: str, state: dict[str, Pieces], shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """Fill every piece of `state` in place from the checkpoint at `path` (any layout wrote it);
    returns its JSON metadata. Bad checkpoints raise CheckpointError before anything is read."""
    md = read_metadata(path)
    check_shapes(path, md, shapes if shapes is not None else {k: v.shape for k, v in state.items()})
    check_files(path, md)
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json ({e})") from None
    try:
        dcp.load(state, storage_reader=CheckpointReader(path), planner=_LoadPlanner())
    except Exception as e:  # noqa: BLE001 - a corrupt data file: one line naming the checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: cannot read its data ({first})") from None
    return meta
