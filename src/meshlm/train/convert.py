"""`meshlm convert`: Hugging Face directories (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE) <-> meshlm
checkpoints, and reading a checkpoint's weights into one process (for export and `meshlm generate`).

A checkpoint holds single-process tensors by name (`master/<name>`) through DCP, sharded however the
writing layout held them; one process asks for each tensor whole (train/checkpoint/ reads the
overlapping stored chunks), exactly the tensors it needs, one group at a time. Everything is
checked before anything is written; output goes to `OUT.tmp` and is renamed when complete.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import warnings

import torch

from ..core import config as C
from ..core.model_args import ModelArgs
from ..core.hf_config import args_from_hf, config_for, param_shapes
from .checkpoint import CheckpointError, write_failure

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class ExportError(CheckpointError):
    """A Hugging Face export that could not be written (a full disk): one line naming the directory,
    the bytes it needed and those free; its `.tmp` is removed."""


def find_checkpoint(path: str) -> str:
    """A checkpoint directory, or a run directory meaning its newest complete checkpoint."""
    from .checkpoint import list_checkpoints
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = list_checkpoints(os.path.join(path, "checkpoints"))
    if found:
        return found[-1][1]
    raise ValueError(f"{path}: not a meshlm checkpoint (no meta.json) nor a run directory with checkpoints/")


def checkpoint_model(path: str) -> tuple[C.Config, ModelArgs, dict]:
    """(config, model shape, meta) of checkpoint `path`."""
    from ..core.config.model import model_args
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        cfg = C.from_dict(meta["config"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}/meta.json: unreadable ({e})") from None
    cfg.model.init_from = ""  # the weights are in the checkpoint; its config carries the shape
    return cfg, model_args(cfg), meta


def load_masters(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The fp32 weights named in `shapes` from checkpoint `path` (only those are read), through the
    training loader: its index is read without unpickling arbitrary objects, shapes and data files are
    checked first (CheckpointError, one line), and each tensor is one whole piece in this process."""
    from .checkpoint import Pieces, load
    state = {f"master/{n}": Pieces(tuple(s), torch.float32, [((0,) * len(s), torch.empty(s))], True)
             for n, s in shapes.items()}
    load(path, state)
    return {k.split("/", 1)[1]: v.parts[0][1] for k, v in state.items()}


def model_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every parameter of a (meta) Llama by single-process name, a tied head once (as the embedding),
    and its model-state buffers (the MoE selection bias): the checkpoint's `master/` keys for any model
    family, dense or mixture-of-experts."""
    return {n: tuple(p.shape) for n, p in [*model.named_parameters(), *model.named_buffers()]}


def load_model(path: str, device: str | torch.device = "cpu"):
    """(Llama with the checkpoint's weights in fp32, config, meta, checkpoint dir)."""
    from ..model import Llama
    path = find_checkpoint(path)
    cfg, args, meta = checkpoint_model(path)
    with torch.device("meta"):
        model = Llama(args)
    weights = load_masters(path, model_shapes(model))
    model.load_state_dict({**weights, **({"output.weight": weights["tok_embeddings.weight"]}
                                         if args.tie_embeddings else {})}, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.to(device).eval(), cfg, meta, path


def tokenizer_of(path: str, cfg: C.Config, meta: dict, vocab_size: int) -> str:
    """The tokenizer a checkpoint's text goes through: a tokenizer.json beside its weights, else the
    run's data.tokenizer; bytes for a meshlm run on bytes, or an imported model of vocabulary 256."""
    beside = os.path.join(path, "tokenizer.json")
    if os.path.isfile(beside):
        return beside
    if cfg.data.tokenizer != "bytes":
        if os.path.isfile(cfg.data.tokenizer):
            return cfg.data.tokenizer
        raise ValueError(f"{path}: the run's tokenizer {cfg.data.tokenizer} is gone (data.tokenizer)")
    if "source" in meta and vocab_size != 256:
        raise ValueError(f"{path}: no tokenizer.json beside the weights and the vocabulary ({vocab_size}) "
                         f"is not bytes (256)")
    return "bytes"


def return_freed_memory() -> None:
    """Make every allocation of 1 MiB or more its own mapping, given back to the OS when freed (glibc;
    elsewhere nothing). glibc otherwise raises that threshold to the largest block freed so far (up
    to 32 MiB) and keeps freed heap blocks: a streaming conversion's resident set would then grow by
    blocks it no longer uses. Called by `meshlm convert` (its own process) only."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _fresh_out(out: str) -> str:
    if os.path.exists(out):
        raise ValueError(f"--out: {out} already exists (not overwriting it)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"--out: parent directory {parent} does not exist")
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _copy_tokenizer(src_dir: str | None, src_file: str | None, dst: str) -> None:
    if src_dir:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src_dir, name)):
                shutil.copy(os.path.join(src_dir, name), os.path.join(dst, name))
    elif src_file:
        shutil.copy(src_file, os.path.join(dst, "tokenizer.json"))
        with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


def from_hf(hf_dir: str, out: str) -> str:
    """A weights-only meshlm checkpoint (`master/<name>` fp32 + meta.json) from a transformers model.
    Its config pins the shape; train from HF weights with model.init_from instead (any layout).
    One tensor in memory at a time: each is read when DCP writes it (train/checkpoint.save_streaming)."""
    from ..core.config.model import set_model_shape
    from ..model.hf import HFWeights
    from .checkpoint import save_streaming
    args = args_from_hf(hf_dir)
    weights = HFWeights(hf_dir)
    weights.check(args)
    tmp = _fresh_out(out)
    try:
        save_streaming(tmp, {f"master/{n}": s for n, s in param_shapes(args).items()},
                       lambda key: weights.tensor(key.split("/", 1)[1], args).contiguous())
        cfg = C.Config()
        set_model_shape(cfg, args)
        meta = {"step": 0, "weights_only": True, "source": f"hf:{os.path.abspath(hf_dir)}",
                "config": C.to_dict(cfg)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        _copy_tokenizer(hf_dir, None, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def to_hf(ckpt: str, out: str, dtype: str = "bf16", max_shard_bytes: int = 5 * 10 ** 9) -> list[str]:
    """A transformers directory (the architecture core/hf_config.family_for picks): config.json,
    safetensors (sharded with an index above `max_shard_bytes`), and the run's tokenizer. Streams: one
    checkpoint tensor in memory at a time (read whole from its stored chunks, written into the
    safetensors file whose header is known up front; model/safetensors_io.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    path = find_checkpoint(ckpt)
    cfg, args, meta = checkpoint_model(path)
    try:
        config_for(args, DTYPES[dtype][1])  # refuses a model no transformers architecture expresses
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    tok = tokenizer_of(path, cfg, meta, args.vocab_size)
    tmp = _fresh_out(out)
    try:
        files = write_hf(path, args, tmp, dtype, max_shard_bytes)
        beside = os.path.isfile(os.path.join(path, "tokenizer.json"))
        _copy_tokenizer(path if beside else None, None if beside or tok == "bytes" else tok, tmp)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, CheckpointError):  # a full disk among them
            need = sum(math.prod(s) for s in param_shapes(args).values()) * DTYPES[dtype][0].itemsize
            raise ExportError(write_failure(f"export to {out} failed", out, need, e, ".tmp removed")) from e
        raise
    return files


def _write_one(writer, name: str, t: torch.Tensor, args: ModelArgs) -> None:
    """Parameter `name`'s transformers tensors into `writer`; `t` and its conversions are dropped on
    return, before the next parameter is read."""
    from ..model.hf import hf_tensors
    for k, v in hf_tensors(name, t, args).items():
        writer.write(k, v)


def write_hf(path: str, args: ModelArgs, out_dir: str, dtype: str = "fp32",
             max_shard_bytes: int = 5 * 10 ** 9) -> list[str]:
    """config.json and the safetensors files (with an index when there are several) of checkpoint
    `path` into the existing directory `out_dir`; returns the safetensors file names. The file
    layout comes from `hf_tensors` on meta tensors, so every byte offset is known before any
    weight is read; then each checkpoint tensor is read whole, converted and written, and dropped."""
    from ..model import safetensors_io as st
    from ..model.hf import hf_tensors
    from .checkpoint import check_files, check_shapes, read_full, read_metadata
    torch_dtype, dtype_name = DTYPES[dtype]
    shapes = param_shapes(args)
    md = read_metadata(path)
    check_shapes(path, md, {f"master/{n}": s for n, s in shapes.items()})
    check_files(path, md)
    entries = {n: [(k, torch_dtype, tuple(v.shape)) for k, v in
                   hf_tensors(n, torch.empty(s, device="meta"), args).items()] for n, s in shapes.items()}
    shards: list[list[str]] = [[]]
    used = 0
    for name, ents in entries.items():
        n = sum(torch_dtype.itemsize * int(torch.Size(e[2]).numel()) for e in ents)
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        with st.Writer(os.path.join(out_dir, fname), [e for n in names for e in entries[n]],
                       {"format": "pt"}) as writer:
            for n in names:
                _write_one(writer, n, read_full(path, md, f"master/{n}"), args)
        weight_map.update({e[0]: fname for n in names for e in entries[n]})
        total += writer.nbytes
        files.append(fname)
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_for(args, dtype_name), f, indent=1)
    return files
