"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format, keyed by single-process names.

Every rank hands DCP only the pieces it owns (`Pieces`: rectangles of the full tensor with their
offsets, from the placement records, parallel/placement.py); DCP writes each element once, and at load
time every rank asks for the rectangles its own layout holds, whatever layout wrote them: DCP reads the
overlapping parts of the stored chunks (resharding). No rank gathers a full tensor: a rank holds its
own share plus one stored chunk at a time (at most one parameter) while loading.

Keys are `master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` (fp32) and `rng/cpu`; everything else
(step, sampler position, loss scale, config) is `meta.json`. A checkpoint is written into `step_N.tmp`
and renamed to `step_N` only when every rank has finished. DCP stores its index (`.metadata`) as a
pickle: it is read here with an unpickler that admits DCP's own metadata classes only, and tensors
with `weights_only=True` (DCP's reader), so loading never runs arbitrary code.
"""
from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from ..distributed.comm import Comm

STEP_DIR = re.compile(r"^step_(\d{8})$")
# One-process runs use DCP without a process group on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the file or tensor."""


@dataclass
class Pieces:
    """This rank's rectangles of one full tensor: (offsets, tensor) each, and whether it writes them
    (one copy of each element writes; every copy reads)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list[tuple[tuple[int, ...], torch.Tensor]]
    write: bool
    # Where the parts are meta tensors (offload = "nvme"): what reads and writes their values, one part
    # at a time (parallel/dims/zero/nvme.FileRange: `read(view) -> tensor`, `write(view, tensor)`)
    backing: object | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.parts) if self.write else 0

    def to_host(self) -> "Pieces":
        """A snapshot in host memory (pinned on CUDA) for a background write."""
        if self.backing is not None:
            raise ValueError("pieces kept in files are written synchronously (Checkpointer.save)")
        pin = torch.cuda.is_available()
        return Pieces(self.shape, self.dtype, [(o, t.detach().to("cpu", copy=True).pin_memory() if pin else
                                               t.detach().to("cpu", copy=True)) for o, t in self.parts], self.write)


def _find(state: dict[str, Pieces], index: MetadataIndex) -> torch.Tensor:
    for offsets, t in state[index.fqn].parts:
        if tuple(offsets) == tuple(index.offset):
            return t
    raise KeyError(f"{index.fqn}: no piece at {tuple(index.offset)}")


class _SavePlanner(DefaultSavePlanner):
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


class _LazySavePlanner(_SavePlanner):
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


class _Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        return read_metadata(str(self.path))


def read_metadata(path: str) -> Metadata:
    """The checkpoint's DCP index, or a CheckpointError naming the file."""
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


# -- finding checkpoints ---------------------------------------------------------------------------
def list_checkpoints(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "meta.json")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def find_resume(root: str, resume: str, restarts: int = 0) -> str | None:
    """The checkpoint to start from: newest complete one for `auto`, none for `never`, else the given
    path (a complete checkpoint: never a `.tmp` being written or left by a crash). After a restart
    (`restarts`: the job's agreed count, docs/fault_tolerance.md) the run's newest checkpoint, if it
    has one, beats `checkpoint.resume`."""
    if restarts > 0 and list_checkpoints(root):
        resume = "auto"
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1][1] if found else None
    if resume.rstrip("/").endswith(".tmp"):
        raise CheckpointError(f"checkpoint.resume: {resume} is an incomplete checkpoint (.tmp); "
                              f"point at a step_NNNNNNNN directory")
    if not os.path.isfile(os.path.join(resume, "meta.json")):
        raise CheckpointError(f"checkpoint.resume: no checkpoint at {resume}")
    return resume


def preflight(cfg, run_dir: str, restarts: int = 0) -> None:
    """Refuse the checkpoint a run would resume from before any worker starts: a `.tmp`, a missing or
    unreadable index, a truncated data file, or tensors whose shapes differ from the configured model
    (the first mismatching one, in model order, is named). After a restart (`restarts`) that is the
    newest checkpoint of the run, whatever `checkpoint.resume` says (`find_resume`)."""
    path = find_resume(os.path.join(run_dir, "checkpoints"), cfg.checkpoint.resume, restarts)
    if path is None:
        return
    try:
        with open(os.path.join(path, "meta.json")) as f:
            weights_only = bool(json.load(f).get("weights_only"))
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json ({e})") from None
    if weights_only:  # `meshlm convert --from-hf` output: no optimizer state to resume
        raise CheckpointError(f"checkpoint.resume: {path} holds weights only (meshlm convert --from-hf); "
                              f"train from Hugging Face weights with --model.init_from hf:DIR")
    from ..model import build_model
    from ..model.from_config import model_args
    from ..model.init import canonical_name

    with torch.device("meta"):
        model = build_model(model_args(cfg))
    named = [(canonical_name(n), tuple(p.shape)) for n, p in model.named_parameters()]
    shapes = {f"{kind}/{n}": s for kind in ("master", "exp_avg", "exp_avg_sq") for n, s in named}
    md = read_metadata(path)
    check_shapes(path, md, shapes)
    check_files(path, md)


def check_room(cfg, run_dir: str) -> None:
    """Refuse, in one line, a run whose checkpoint directory cannot hold `keep + 1` checkpoints (the
    newest kept ones and the one being written; with keep = 0, every save the run makes) plus its
    Hugging Face exports. A checkpoint's size is the planner's (fp32 masters and Adam moments,
    plan/goodput.py); checkpoints already in the directory count as room the run has."""
    c, t = cfg.checkpoint, cfg.training
    if not c.every and c.export_hf == "":
        return
    from ..choices import DTYPE_BYTES
    from ..model.from_config import model_args
    from ..plan.goodput import checkpoint_bytes
    params = model_args(cfg).num_params()
    size = checkpoint_bytes(params)
    every = c.every if isinstance(c.every, int) and c.every > 0 else 0
    count = c.keep + 1 if c.keep > 0 else max(1, t.steps // every if every else 1)
    exports = 0 if c.export_hf == "" else 1 if c.export_hf == "end" else -(-t.steps // int(c.export_hf))
    root = os.path.join(run_dir, "checkpoints")
    have = sum(dir_bytes(p) for _, p in list_checkpoints(root))
    need = max(count * size - have, size) + exports * params * DTYPE_BYTES[c.export_dtype]
    free = free_bytes(root)
    if free < need:
        what = f"{count} checkpoints of {size:,} bytes" + (f" and {exports} export(s)" if exports else "")
        raise CheckpointError(f"checkpoint: {existing_dir(root)} has {free:,} bytes free, the run needs {need:,} "
                              f"({what}; checkpoint.keep = {c.keep}): free space or lower checkpoint.keep")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# -- saving ----------------------------------------------------------------------------------------
class SaveError(CheckpointError):
    """A checkpoint that could not be written (checkpoint.on_error = "stop"): one line naming the
    directory, the bytes it needed and the bytes free; its `.tmp` is gone, the last checkpoint intact."""


def _root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (every rank gets one)."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if failures else e


def _out_of_space(e: BaseException | None) -> bool:
    """Whether an error says the file system is full (or over quota), wherever it was wrapped."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def existing_dir(path: str) -> str:
    """`path`, or its nearest ancestor that exists (where its files will go; for a free-space check)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    return shutil.disk_usage(existing_dir(path)).free


class Checkpointer:
    """Writes checkpoints under `root`: synchronously, or (async) from a host snapshot in a background
    thread on a gloo group of its own, made visible by the rename only when every rank has finished.
    A save that fails (a full disk; any OSError) removes its `.tmp` on every rank's say and leaves the
    last checkpoint as it was: `on_error` "stop" raises SaveError on every rank, "continue" prints the
    line and reports it (`done`), and the next due save tries again."""

    def __init__(self, root: str, world: Comm, keep: int, use_async: bool, on_error: str = "stop"):
        self.root, self.world, self.keep, self.use_async = root, world, keep, use_async
        self.on_error = on_error
        self.pending: tuple[Future, str, str, dict, int, int] | None = None
        # step -> None: called once a checkpoint's tensors are written and before it is committed
        # (renamed), sync or async; a plugin's hook (train/plugins.py), e.g. the tests' fault injection.
        self.on_written = None
        self.dcp_group = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if use_async else None
        if use_async and world.size > 1:
            self.dcp_group = dist.new_group(backend="gloo")
        self.done: list[dict] = []  # finished saves not yet reported: {step, write_s, bytes} or {step, error}

    def save(self, step: int, state: dict[str, Pieces], meta: dict) -> dict:
        """Write `state`; returns {save_s: wall time this call blocked} (with `error`: the line, when a
        synchronous save failed and on_error is "continue").
        Pieces kept in files (offload = "nvme") are written synchronously, one file per piece, so one
        piece is in memory at a time: a host snapshot would hold the whole state the offload keeps out
        of memory (docs/zero.md "NVMe offload")."""
        t0 = time.perf_counter()
        self.wait()
        final = os.path.join(self.root, f"step_{step:08d}")
        tmp = final + ".tmp"
        made, error = 0.0, None
        if self.world.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
            except OSError as e:
                made, error = 1.0, e
        # every rank's bytes to write (the whole checkpoint's, for the message), and whether tmp exists
        failed, need = self.world.all_reduce_scalars([made, float(sum(p.nbytes() for p in state.values()))])
        need = int(need)
        if failed:
            return self._failed(step, tmp, need, error, t0)
        lazy = any(p.backing is not None for p in state.values())
        if self.use_async and not lazy:
            snap = {k: v.to_host() for k, v in state.items()}
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
            fut = self.pool.submit(self._write, snap, tmp, self.dcp_group)
            self.pending = (fut, tmp, final, meta, step, need)
            return {"save_s": time.perf_counter() - t0}
        try:
            write_s = self._write(state, tmp, None, one_file_per_piece=lazy)
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - DCP raised it on every rank
            return self._failed(step, tmp, need, e, t0)
        self._written(step)
        out = self._commit(tmp, final, meta, step, write_s, need)
        return dict(out or {}, save_s=time.perf_counter() - t0)

    @staticmethod
    def _write(state: dict[str, Pieces], tmp: str, group, one_file_per_piece: bool = False) -> float:
        """DCP's writer keeps every tensor of a file alive until the file closes: pieces read from
        files one at a time therefore get a file each."""
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=not one_file_per_piece),
                 planner=_SavePlanner(), process_group=group)
        return time.perf_counter() - t0

    def _written(self, step: int) -> None:
        if self.on_written is not None:
            self.on_written(step)

    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending[0].done()

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, meta, step, need = self.pending
        self.pending = None
        try:
            write_s = fut.result()
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - every rank's write failed with it
            self._failed(step, tmp, need, e)
            return
        self._written(step)  # on this (the training) thread, like the sync path
        self._commit(tmp, final, meta, step, write_s, need)

    def _commit(self, tmp: str, final: str, meta: dict, step: int, write_s: float, need: int) -> dict | None:
        """Rank 0 writes meta.json and renames; every rank learns whether that worked (the collective
        that also ends the save: no rank goes on before the rename)."""
        self.world.barrier()
        failed, error = 0.0, None
        if self.world.rank == 0:
            try:
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump(meta, f, indent=1)
                size = dir_bytes(tmp)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            except OSError as e:
                failed, error = 1.0, e
            else:
                for _, old in list_checkpoints(self.root)[:-self.keep] if self.keep > 0 else []:
                    shutil.rmtree(old, ignore_errors=True)
                self.done.append({"step": step, "write_s": write_s, "bytes": size})
        if self.world.all_reduce_scalars([failed])[0]:
            return self._failed(step, tmp, need, error)
        return None

    def _failed(self, step: int, tmp: str, need: int, error: BaseException | None, t0: float | None = None) -> dict:
        """Every rank is here (each learned the failure from a collective): rank 0 removes the `.tmp`
        once no rank writes into it, then each rank judges from the free bytes whether it was space."""
        self.world.barrier()
        if self.world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self.world.barrier()
        line = save_error_line(self.root, step, need, error, list_checkpoints(self.root))
        if self.on_error == "stop":
            raise SaveError(line) from (_root_cause(error) if error is not None else None)
        if self.world.rank == 0:
            print(f"meshlm: {line}; training goes on (checkpoint.on_error = continue)", file=sys.stderr, flush=True)
        self.done.append({"step": step, "error": line})
        return {"error": line, "save_s": time.perf_counter() - t0} if t0 is not None else {"error": line}

    def close(self, finished: bool = True) -> None:
        """`finished`: commit a save still being written first; otherwise (the run failed) leave it:
        its peers may be gone, and the thread ends with the run's process groups."""
        if finished:
            self.wait()
        if self.pool is not None:
            self.pool.shutdown(wait=finished, cancel_futures=True)


def save_error_line(root: str, step: int, need: int, error: BaseException | None,
                    newest: list[tuple[int, str]]) -> str:
    left = f"newest checkpoint {os.path.basename(newest[-1][1])}" if newest else "no checkpoint yet"
    return write_failure(f"checkpoint step {step} not saved in {root}", root, need, error, f".tmp removed; {left}")


def write_failure(what: str, where: str, need: int, error: BaseException | None, after: str) -> str:
    """One line for a write that failed (its partial output already removed): `what`, whether it was
    space (the bytes needed against those free where it goes, or the error itself says so), and
    `after` (what is left)."""
    free = free_bytes(where)
    cause = _root_cause(error) if error is not None else None
    if free < need or _out_of_space(cause):
        return f"{what}: no space: needs {need:,} bytes, {free:,} free ({after})"
    text = (str(cause).strip().splitlines() or [""])[0][:200] if cause is not None else ""
    why = f"{type(cause).__name__}: {text}" if cause is not None else "failed on rank 0"
    return f"{what}: {why} (needs {need:,} bytes, {free:,} free; {after})"


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
        dcp.load(state, storage_reader=_Reader(path), planner=_LoadPlanner())
    except Exception as e:  # noqa: BLE001 - a corrupt data file: one line naming the checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: cannot read its data ({first})") from None
    return meta

