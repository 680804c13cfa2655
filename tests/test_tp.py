"""Tensor and sequence parallelism (issue #4): the loss, the slicing, the bytes, the memory, the
checkpoints. The plain equivalence rows (tp2, tp4, sp, GQA, dp×tp, AC) are in test_equivalence.py."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from harness import (assert_half_losses, assert_same_losses, make_config, read_metrics, reference, rows, run_layout,
                     run_local, train_case)

from meshlm.core import config as C
from meshlm.core.config import ConfigError
from harness import build_layout
from meshlm.core.config.model import model_args

FP32 = 1e-5


def _context(cfg):
    from meshlm.distributed.mesh import init_context, pick_device
    layout = build_layout(cfg, int(os.environ["WORLD_SIZE"]))
    return layout, init_context(layout.shape(), pick_device("cpu"), timeout_s=120)


# -- pool tasks (module level so workers can unpickle them) ------------------------------------

def loss_task(vocab: int, n: int, seed: int):
    """Vocab-parallel CE on this rank's slice vs F.cross_entropy on the full logits."""
    from meshlm.core.model_args import padded_vocab
    from meshlm.parallel.dims.vocab_parallel import VocabParallelLoss
    from meshlm.parallel.placement import DimSplit
    _, ctx = _context(make_config(parallel__tp=int(os.environ["WORLD_SIZE"])))
    comm = ctx.comm("tp")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, n, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (2, n), generator=g)
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    loss_fn = VocabParallelLoss(comm, DimSplit(0, vocab, padded_vocab(vocab, 1, comm.size), comm.size, comm.rank, "tp"))
    padded = torch.cat([logits, torch.full((2, n, loss_fn.rows * comm.size - vocab), 1e4)], -1)
    mine = padded[..., comm.rank * loss_fn.rows:(comm.rank + 1) * loss_fn.rows].clone().requires_grad_()
    loss = loss_fn(mine, targets)
    loss.backward()
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    grad_want = torch.cat([ref.grad, torch.zeros(2, n, loss_fn.rows * comm.size - vocab)], -1)
    grad_want = grad_want[..., comm.rank * loss_fn.rows:(comm.rank + 1) * loss_fn.rows]
    return float(loss), float(want), float((mine.grad - grad_want).abs().max())


def comm_task(cfg_dict: dict, steps: int, group: str = "tp"):
    """Train `steps` steps and return what `group` moved: {kind: (calls, bytes)}."""
    from meshlm.distributed.comm import reset_stats
    from meshlm.train.trainer import Trainer
    cfg = C.from_dict(cfg_dict)
    layout, ctx = _context(cfg)
    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-tpcomm-"), ctx, layout)
    reset_stats(ctx.all_comms())
    for _ in range(steps):
        trainer.train_step()
    return {k: (s.calls, s.bytes) for k, s in ctx.comm(group).stats.items() if k != "recv_wait"}


def activation_task(cfg_dict: dict, report_compiled: bool = False):
    """Saved-activation bytes of block 0 by part, forward only (and whether block 0 is compiled)."""
    from meshlm.model import Llama
    from meshlm.parallel import parallelize, slices
    from meshlm.parallel.model_plans.moe import model_plan_for
    from meshlm.train.observe.saved import block_saved_bytes
    from meshlm.parallel.optim.master import MasterOptimizer
    cfg = C.from_dict(cfg_dict)
    layout, ctx = _context(cfg)
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    par = parallelize(model, ctx, layout, MasterOptimizer, **slices(cfg))
    tokens = torch.randint(0, 256, (cfg.training.micro_batch, cfg.data.seq_len))
    block = par.model.layers["0"]
    parts = block_saved_bytes(block, lambda: par.model(tokens), model_plan_for(par.model))
    return (parts, isinstance(block, torch._dynamo.eval_frame.OptimizedModule)) if report_compiled else parts


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,vocab", [(2, 256), (2, 257), (4, 257), (4, 5)])
def test_vocab_parallel_cross_entropy_matches_full_logits(pools, world, vocab):
    # vocab 5 at tp=4: rows 2 per rank, the last rank holds only padding
    for loss, want, grad_err in pools(world).run(loss_task, vocab, 16, world * 1000 + vocab):
        assert abs(loss - want) <= 1e-6 * abs(want), (loss, want)
        assert grad_err < 1e-7, grad_err


SHORT = {"training__steps": 4}
CASES = [
    # padded vocabulary with tied embeddings; clipping active every step (norm counting matters); eval
    ("tp2-vocab257-tied-clip", 2, {"parallel__tp": 2, "model__vocab_size": 257, "model__tie_embeddings": True,
                                   "training__clip": 0.05, "training__eval_every": 3}),
    ("tp4-kv1-sp-clip", 4, {"parallel__tp": 4, "parallel__sp": True, "model__n_kv_heads": 1,
                            "training__clip": 0.05}),
    ("tp2-sp-selective-ac", 2, {"parallel__tp": 2, "parallel__sp": True, "training__ac": "selective"}),
    ("tp2-bf16", 2, {"parallel__tp": 2, "training__precision": "bf16"}),
    ("tp2-sp-fp16-accum", 2, {"parallel__tp": 2, "parallel__sp": True, "training__precision": "fp16",
                              "training__micro_batch": 1}),
    ("dp2-tp2-sp-zero1", 4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__sp": True, "parallel__zero": 1}),
    ("dp2-tp2-zero2-kv1-clip", 4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__zero": 2,
                                   "model__n_kv_heads": 1, "training__clip": 0.05}),
    # Qwen-style attention: q/k/v biases split with their rows (kv ones replicated over 2 ranks each),
    # q/k norm gains replicated with summed gradients, head_dim 32 ≠ dim/heads
    ("tp4-kv2-sp-qkv-bias-qk-norm", 4, {"parallel__tp": 4, "parallel__sp": True, "model__n_kv_heads": 2,
                                        "model__qkv_bias": True, "model__qk_norm": True, "model__head_dim": 32,
                                        "training__clip": 0.05}),
]


@pytest.mark.parametrize("name,world,overrides", rows(CASES))
def test_tp_matches_one_process(pools, name, world, overrides):
    overrides = {**SHORT, **overrides}
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel__")}
    ref = reference(**single)
    got = run_layout(pools, make_config(**overrides), world)
    if overrides.get("training__precision", "fp32") != "fp32":
        assert_half_losses(single, got)  # harness.HALF, or the CPU's own noise where larger (issue #45)
    else:
        assert_same_losses(ref, got, FP32)
        # the global grad norm counts each element once (bf16 noise is amplified by spikes)
        for a, b in zip(ref, got):
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])


@pytest.mark.parametrize("world,overrides", [
    (2, {"parallel__tp": 2}),
    (2, {"parallel__tp": 2, "parallel__sp": True, "training__ac": "full"}),
    (4, {"parallel__tp": 4, "parallel__sp": True, "model__n_kv_heads": 2, "training__micro_batch": 1}),
    (2, {"parallel__tp": 2, "model__n_kv_heads": 1, "training__precision": "bf16"}),
    (2, {"parallel__tp": 2, "parallel__sp": True, "training__ac": "op"}),
    (4, {"parallel__tp": 4, "model__n_kv_heads": 2, "model__qkv_bias": True, "model__qk_norm": True}),
], ids=["tp2", "tp2-sp-ac-full", "tp4-sp-accum", "tp2-kv1-bf16", "tp2-sp-ac-op", "tp4-kv2-bias-qk-norm"])
def test_tp_bytes_match_theory(pools, world, overrides):
    """One reduction per block half forward and backward, nothing else on the activations."""
    from meshlm.plan.cost.volume import tp_step_bytes as expected_bytes
    cfg = make_config(**overrides)
    layout = build_layout(cfg, world)
    e = 4 if cfg.training.precision == "fp32" else 2
    want = expected_bytes(model_args(cfg), layout.micro_batch, cfg.data.seq_len, layout.accum, layout.tp,
                          cfg.parallel.sp, cfg.training.ac, act_bytes=e, param_bytes=e)
    got = pools(world).run(comm_task, C.to_dict(cfg), 2)[0]
    assert got == {k: (2 * c, 2 * b) for k, (c, b) in want.items()}


def test_sequence_parallel_divides_norm_activations(pools):
    base = {"data__seq_len": 64, "training__micro_batch": 2}
    tp = pools(2).run(activation_task, C.to_dict(make_config(parallel__tp=2, **base)))[0]
    sp = pools(2).run(activation_task, C.to_dict(make_config(parallel__tp=2, parallel__sp=True, **base)))[0]
    ratio = tp["norm"] / sp["norm"]
    print(f"saved bytes per block, tp2: {tp}; tp2+sp: {sp}; norm/residual ratio {ratio:.2f}")
    assert 1.9 <= ratio <= 2.1
    # inside the TP region SP saves the linears' input shard instead of the gathered input: e·d/2 less
    # per token for each half (the RoPE tables, shared by all blocks, are counted with attention)
    tokens, d = 2 * 64, 64
    assert sp["feed_forward"] == tp["feed_forward"] - 4 * d // 2 * tokens
    assert abs(sp["attention"] - (tp["attention"] - 4 * d // 2 * tokens)) <= 0.05 * tp["attention"]


def _train(pools, world: int, run_dir: str, **overrides) -> list[dict]:
    cfg = make_config(**overrides)
    if world == 1:
        return run_local(cfg, run_dir)
    pools(world).run(train_case, C.to_dict(cfg), run_dir)
    return read_metrics(run_dir)


def test_checkpoint_moves_between_tp_and_one_process(pools):
    """Written at tp=2 (padded vocabulary, tied) and resumed in one process, and the reverse: the
    resumed steps give the uninterrupted run's losses."""
    common = {"model__vocab_size": 257, "model__tie_embeddings": True, "training__steps": 6,
              "checkpoint__every": 3}
    one, two = tempfile.mkdtemp(prefix="meshlm-ck1-"), tempfile.mkdtemp(prefix="meshlm-ck2-")
    ref = _train(pools, 1, one, **common)
    full_tp = _train(pools, 2, two, parallel__tp=2, **common)
    assert_same_losses(ref, full_tp, FP32)
    ck = "checkpoints/step_00000003"
    from_tp = _train(pools, 1, tempfile.mkdtemp(), checkpoint__resume=os.path.join(two, ck), **common)
    from_one = _train(pools, 2, tempfile.mkdtemp(), parallel__tp=2, parallel__sp=True,
                      checkpoint__resume=os.path.join(one, ck), **common)
    assert [r["step"] for r in from_tp] == [4, 5, 6]
    assert_same_losses(ref[3:], from_tp, FP32)
    assert_same_losses(ref[3:], from_one, FP32)


@pytest.mark.parametrize("overrides,message", [
    ({"parallel__tp": 3}, "does not divide model.n_heads"),
    ({"parallel__tp": 2, "model__dim": 96, "model__n_heads": 6, "model__n_kv_heads": 3},
     "do not divide one another"),
    ({"parallel__tp": 4, "model__ffn_dim": 130}, "does not divide model.ffn_dim"),
    ({"parallel__tp": 4, "parallel__sp": True, "data__seq_len": 30}, "not divisible by tp"),
])
def test_impossible_tp_layouts_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_layout(make_config(**overrides), overrides["parallel__tp"])


def test_sp_is_a_no_op_without_tp():
    assert build_layout(make_config(parallel__sp=True, data__seq_len=31), 1).tp == 1
