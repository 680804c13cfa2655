"""Vocabulary padding (`model.vocab_multiple`): the embedding and head hold padded_vocab rows, the padded
rows stay zero, the loss and the checkpoints are those of the unpadded model, in every layout."""
import functools
import os
import tempfile

import pytest
import torch

from harness import assert_same_losses, make_config, read_metrics, run_layout, train_case
from meshlm.core import config as C
from meshlm.core.config import ConfigError
from harness import build_layout
from meshlm.core.model_args import padded_vocab
from meshlm.parallel.placement import DimSplit

V, DIM = 300, 64  # the byte data needs >= 256 ids; 300 is no multiple of 128
EXACT = 1e-6
BASE = {"model__vocab_size": V, "training__steps": 4}


@pytest.mark.parametrize("vocab,multiple,tp,want", [
    (300, 128, 1, 384), (300, 128, 2, 512), (256, 128, 1, 256), (256, 128, 4, 512), (128256, 128, 8, 129024),
    (300, 1, 1, 300), (257, 1, 2, 258), (5, 1, 4, 8), (1, 64, 1, 64),
])
def test_padded_vocab(vocab, multiple, tp, want):
    assert padded_vocab(vocab, multiple, tp) == want


def _rows(vocab: int, tp: int, rank: int, multiple: int = 1) -> tuple[int, int, int]:
    s = DimSplit(0, vocab, padded_vocab(vocab, multiple, tp), tp, rank, "tp")
    return s.start, s.chunk, s.real


def test_vocab_split_uses_the_padded_size():
    # 512 rows over 2 ranks: rank 0 holds ids 0..255, rank 1 ids 256..299 and 212 padded rows
    assert _rows(V, 2, 0, 128) == (0, 256, 256)
    assert _rows(V, 2, 1, 128) == (256, 256, 44)
    assert _rows(257, 2, 1) == (129, 129, 128)  # multiple 1: the old ceil(V/tp) split
    assert _rows(5, 4, 3) == (6, 2, 0)  # a rank holding only padding


@pytest.mark.parametrize("value", [0, -128])
def test_vocab_multiple_below_one_is_refused(value):
    with pytest.raises(ConfigError, match=r"^model\.vocab_multiple: must be positive"):
        build_layout(make_config(model__vocab_multiple=value), 1)


def _train_here(cfg: C.Config, run_dir: str):
    """Train in this process and keep the trainer (run_local returns only the metrics)."""
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.train.trainer import Trainer
    layout = build_layout(cfg, 1)
    trainer = Trainer(cfg, run_dir, init_context(layout.shape(), pick_device("cpu")), layout)
    trainer.fit()
    return trainer, read_metrics(run_dir)


def _checkpoint_shapes(run_dir: str, step: int) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(os.path.join(run_dir, "checkpoints", f"step_{step:08d}")).read_metadata()
    return {k: tuple(m.size) for k, m in meta.state_dict_metadata.items() if hasattr(m, "size")}


@functools.lru_cache(maxsize=None)
def unpadded(tied: bool) -> list:
    cfg = make_config(model__vocab_multiple=1, model__tie_embeddings=tied, checkpoint__every=4, **BASE)
    run_dir = tempfile.mkdtemp(prefix="meshlm-vocab1-")
    trainer, recs = _train_here(cfg, run_dir)
    assert trainer.model.output.weight.shape == (V, DIM)
    return recs, _checkpoint_shapes(run_dir, 4)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padding_at_tp1_never_changes_the_loss(tied):
    ref, ref_shapes = unpadded(tied)
    cfg = make_config(model__vocab_multiple=128, model__tie_embeddings=tied, checkpoint__every=4, **BASE)
    run_dir = tempfile.mkdtemp(prefix="meshlm-vocab128-")
    trainer, got = _train_here(cfg, run_dir)
    assert_same_losses(ref, got, EXACT)
    emb, out = trainer.model.tok_embeddings.weight, trainer.model.output.weight
    assert emb.shape == out.shape == (384, DIM)
    assert (emb is out) == tied
    for w in (emb, out):
        assert torch.count_nonzero(w[:V]) == V * DIM  # trained real rows
        assert torch.count_nonzero(w[V:]) == 0  # padded rows: no gradient, no weight-decay drift
    shapes = _checkpoint_shapes(run_dir, 4)
    assert shapes == ref_shapes  # the checkpoint is the unpadded model's
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert shapes[f"{kind}/tok_embeddings.weight"] == (V, DIM)
        assert (f"{kind}/output.weight" in shapes) == (not tied)


def shapes_task(cfg_dict: dict):
    """This rank's embedding and head shapes after parallelize."""
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.config.model import model_args
    from meshlm.model import Llama
    from meshlm.parallel import parallelize, slices
    from meshlm.parallel.optim.master import MasterOptimizer
    cfg = C.from_dict(cfg_dict)
    layout = build_layout(cfg, int(os.environ["WORLD_SIZE"]))
    ctx = init_context(layout.shape(), pick_device("cpu"), timeout_s=120)
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    m = parallelize(model, ctx, layout, MasterOptimizer, **slices(cfg)).model
    return [tuple(mod.weight.shape) if mod is not None else None for mod in (m.tok_embeddings, m.output)]


CASES = [
    # 512 rows over tp=2: 256 per rank, rank 1 holds 44 real ids
    ("tp2", 2, {"parallel__tp": 2}, [(256, DIM), (256, DIM)]),
    ("tp2-sp-tied", 2, {"parallel__tp": 2, "parallel__sp": True, "model__tie_embeddings": True},
     [(256, DIM), (256, DIM)]),
    # ZeRO shards the padded rows with the rest; checkpoints strip them
    ("dp2-zero3", 2, {"parallel__dp": 2, "parallel__zero": 3}, None),
    # pipeline: the embedding on the first stage, the head (sliced loss) on the last; tied: both hold a copy
    ("pp2-tied", 2, {"parallel__pp": 2, "model__tie_embeddings": True}, [(384, DIM), None]),
    ("pp2", 2, {"parallel__pp": 2}, [(384, DIM), None]),
]


@pytest.mark.parametrize("name,world,overrides,rank0_shapes", CASES, ids=[c[0] for c in CASES])
def test_padded_layouts_match_one_unpadded_process(pools, name, world, overrides, rank0_shapes):
    tied = overrides.get("model__tie_embeddings", False)
    ref, _ = unpadded(tied)
    cfg = make_config(model__vocab_multiple=128, **BASE, **overrides)
    if rank0_shapes is not None:
        assert pools(world).run(shapes_task, C.to_dict(cfg))[0] == rank0_shapes
    got = run_layout(pools, cfg, world)
    assert_same_losses(ref, got, 1e-5)


def test_checkpoint_from_padded_tp2_resumes_unpadded_in_one_process(pools):
    common = {**BASE, "training__steps": 4, "checkpoint__every": 2}
    two = tempfile.mkdtemp(prefix="meshlm-vocab-tp2-")
    pools(2).run(train_case, C.to_dict(make_config(parallel__tp=2, **common)), two)
    full = read_metrics(two)
    assert _checkpoint_shapes(two, 2)["master/output.weight"] == (V, DIM)
    ck = os.path.join(two, "checkpoints", "step_00000002")
    _, resumed = _train_here(make_config(model__vocab_multiple=1, checkpoint__resume=ck, **common),
                             tempfile.mkdtemp(prefix="meshlm-vocab-resume-"))
    assert [r["step"] for r in resumed] == [3, 4]
    assert_same_losses(full[2:], resumed, 1e-5)
