"""ZeRO-1/2/3 and HSDP (issue #3): bad input, measured memory against the textbook formulas, bytes
moved per step, layout-independent checkpoints, uneven shapes that need padding, fp16 overflow seen by
every shard, zero 3 freeing what autograd saved, the GPU reduction policy. Equivalence with one
process is in test_equivalence.py (the zero* and hsdp* rows)."""
import os
import tempfile

import pytest
from harness import (assert_refused_in_one_line, assert_same_losses, make_config, read_metrics, reference,
                     run_layout, train_in)

from meshlm.core import config as C
from harness import build_layout
from meshlm.core.config.model import model_args
from meshlm.plan.cost.memory import state_bytes_per_param, zero_state_bytes

FP32 = 1e-5


# ---------------------------------------------------------------- bad input, before launch

@pytest.mark.parametrize("overrides,world,message", [
    ({"parallel__zero": 4}, 2, "parallel.zero: '4' is not one of 0, 1, 2, 3"),
    ({"parallel__zero": -1}, 2, "parallel.zero: '-1' is not one of 0, 1, 2, 3"),
    ({"parallel__zero": 3, "parallel__zero_group": 3}, 4, "parallel.zero_group: 3 does not divide dp 4"),
    ({"parallel__zero_group": 2}, 4, "parallel.zero_group: HSDP groups need a ZeRO stage (zero >= 1)"),
    ({"parallel__offload": "optimizer"}, 2,
     "parallel.offload: optimizer offload needs a ZeRO stage that shards the optimizer (zero >= 1)"),
    ({"parallel__zero": 3, "parallel__offload": "params"}, 2,
     "parallel.offload: 'params' is not one of none, optimizer, nvme"),
])
def test_bad_zero_config_is_one_clear_line(overrides, world, message):
    assert_refused_in_one_line(lambda: build_layout(make_config(**overrides), world), message)


def test_zero_group_makes_hsdp_mesh():
    lay = build_layout(make_config(parallel__zero=2, parallel__zero_group=2), 4)
    assert (lay.dp_replicate, lay.dp_shard) == (2, 2)
    lay = build_layout(make_config(parallel__zero=1), 4)
    assert (lay.dp_replicate, lay.dp_shard) == (1, 4)


# ---------------------------------------------------------------- measured memory

def _psi(cfg) -> int:
    return model_args(cfg).num_params()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_matches_textbook_per_stage(pools, precision):
    """mem.params/grads/optim on rank 0 from live tensors vs (Ψ·p/N³, Ψ·g/N², Ψ·o/N¹) by stage,
    meshlm's convention: fp32 (4, 4, 8), bf16 (2, 4, 12). Slack: the padding of 6 units to N·16 bytes."""
    n = 2
    psi = _psi(make_config())
    pb, gb, ob = state_bytes_per_param(precision)
    slack = 6 * n * 32 * 3
    for stage in (0, 1, 2, 3):
        cfg = make_config(parallel__dp=n, parallel__zero=stage, training__precision=precision,
                          training__steps=1)
        mem = run_layout(pools, cfg, n)[-1]["mem"]
        want = zero_state_bytes(psi, n, stage, pb, gb, ob)
        print(f"{precision} zero={stage}: measured {mem} textbook {want}")
        for key in ("params", "grads", "optim"):
            assert abs(mem[key] - want[key]) <= slack, (stage, key, mem[key], want[key])


# ---------------------------------------------------------------- bytes moved per step

def _bytes_per_step(rec: dict) -> float:
    return sum(v["bytes"] for v in rec["comm"].values())


def test_comm_bytes_ddp_2psi_zero3_3psi(pools):
    """Logical bytes per rank per step (accum = 1, fp32): DDP all-reduce ≈ 2Ψ·4, ZeRO-3 ≈ 3Ψ·4
    (forward + backward all-gathers and one reduce-scatter). ZeRO-3 keeps the head gathered from its
    forward into its backward (as FSDP2 keeps its root), which saves Ψ_head of the 3Ψ."""
    psi = _psi(make_config())
    base = {"parallel__dp": 2, "training__micro_batch": 4, "training__steps": 3}
    ddp = _bytes_per_step(run_layout(pools, make_config(**base), 2)[-1])
    z3 = run_layout(pools, make_config(parallel__zero=3, **base), 2)[-1]
    zero3 = _bytes_per_step(z3)
    print(f"DDP {ddp / (psi * 4):.4f}·Ψ·4, ZeRO-3 {zero3 / (psi * 4):.4f}·Ψ·4 "
          f"({ {k: v['bytes'] / (psi * 4) for k, v in z3['comm'].items()} }), ratio {zero3 / ddp:.4f}")
    assert abs(ddp / (2 * psi * 4) - 1) < 0.05
    assert abs(zero3 / (3 * psi * 4) - 1) < 0.05
    assert abs(zero3 / ddp / 1.5 - 1) < 0.05
    assert set(z3["comm"]) >= {"all_gather", "reduce_scatter"}


# ---------------------------------------------------------------- checkpoints across layouts

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("first,second", [
    ((2, {"parallel__dp": 2, "parallel__zero": 3}), (1, {})),
    ((1, {}), (2, {"parallel__dp": 2, "parallel__zero": 3})),
    ((4, {"parallel__dp": 4, "parallel__zero": 2, "parallel__zero_group": 2}),
     (2, {"parallel__dp": 2, "parallel__zero": 1, "parallel__offload": "optimizer"})),
], ids=["zero3-to-one", "one-to-zero3", "hsdp2-to-zero1-offload"])
def test_checkpoint_moves_between_layouts(pools, first, second):
    """Save at step 3 (past the warm-up) in one layout, resume in another: steps 4-6 give the uninterrupted
    losses."""
    ref = reference()
    a = tempfile.mkdtemp(prefix="meshlm-zero-ckpt-")
    w1, o1 = first
    train_in(pools, make_config(checkpoint__every=3, **o1), w1, a, stop=3)  # only step 3 is resumed
    b = tempfile.mkdtemp(prefix="meshlm-zero-resume-")
    w2, o2 = second
    resumed = train_in(pools, make_config(checkpoint__resume=os.path.join(a, "checkpoints", "step_00000003"),
                                           **o2), w2, b)
    assert [r["step"] for r in resumed] == list(range(4, 7))
    assert_same_losses(ref[3:], resumed, FP32)


# ---------------------------------------------------------------- shapes that need padding

def test_uneven_shapes_pad_and_match(pools):
    """Odd widths: parameters straddle shard boundaries and units are padded; still one-process losses,
    and memory within the padding of the formulas."""
    odd = {"model__dim": 42, "model__n_heads": 3, "model__n_kv_heads": 3, "model__ffn_dim": 85,
           "training__steps": 4}
    ref = reference(**odd)
    got = run_layout(pools, make_config(parallel__dp=4, parallel__zero=3, **odd), 4)
    assert_same_losses(ref, got, FP32)
    psi = _psi(make_config(**odd))
    want = zero_state_bytes(psi, 4, 3, 4, 4, 8)
    mem = got[-1]["mem"]
    for key in ("params", "grads", "optim"):
        assert 0 <= mem[key] - want[key] <= 6 * 4 * 16 * 2, (key, mem[key], want[key])


# ---------------------------------------------------------------- fp16: overflow seen by every rank

def train_tweaked(cfg_dict: dict, run_dir: str, scale: float = 0.0, inflight: int = -1) -> None:
    """Train (in a pool worker or here) with a forced initial loss scale and/or reduction depth."""
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.train.trainer import Trainer

    cfg = C.from_dict(cfg_dict)
    layout = build_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_context(layout.shape(), pick_device("cpu"), timeout_s=120)
    trainer = Trainer(cfg, run_dir, ctx, layout)
    if scale:
        trainer.state.scaler.scale = scale
    if inflight >= 0:
        trainer.par.grads.inflight = inflight
    trainer.fit()


def test_fp16_overflow_skips_on_every_shard(pools):
    """An inf in any rank's gradient shard reaches every rank through the sharded norm: the same steps
    are skipped as in one process (a rank that disagreed would diverge or hang in the next gather)."""
    over = {"training__precision": "fp16", "training__micro_batch": 1}
    local_dir = tempfile.mkdtemp(prefix="meshlm-fp16-ref-")
    train_tweaked(C.to_dict(make_config(**over)), local_dir, 2.0 ** 30)
    ref = read_metrics(local_dir)
    run_dir = tempfile.mkdtemp(prefix="meshlm-fp16-zero-")
    pools(2).run(train_tweaked, C.to_dict(make_config(parallel__dp=2, parallel__zero=2, **over)),
                 run_dir, 2.0 ** 30)
    got = read_metrics(run_dir)
    skipped = [r["step"] for r in got if r.get("skipped")]
    assert skipped == [r["step"] for r in ref if r.get("skipped")] and skipped, skipped
    assert_same_losses(ref, got, 1e-3)


# ---------------------------------------------------------------- zero 3 frees what forward gathered

def _saved_bytes_after_forward(zero: int) -> tuple[int, object]:
    """Bytes of distinct storages autograd holds for backward at the end of one forward (one process)."""
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.train.trainer import Trainer

    cfg = make_config(parallel__zero=zero)
    layout = build_layout(cfg, 1)
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-saved-"), init_context(layout.shape(), pick_device("cpu")),
                 layout)
    x, y, _ = tr.data.next_batch(0, 1)
    from meshlm.train.observe.saved import saved_bytes
    out = []
    saved = saved_bytes(lambda: out.append(tr.par.runner.loss(x[:2], y[:2])))
    out[0].backward()
    return saved.total, tr


def test_zero3_saved_tensors_do_not_pin_gathered_blocks():
    """Autograd saves views of the weights (weight.t() for a matmul). zero 3 frees a block by resizing
    the storage those views share, so after forward no block's parameters stay resident: the graph
    holds at least every block weight's bytes less than under zero 0."""
    z0, _ = _saved_bytes_after_forward(0)
    z3, tr = _saved_bytes_after_forward(3)
    blocks = sum(p.numel() * 4 for n, p in tr.model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    print(f"saved after forward: zero0 {z0} B, zero3 {z3} B, block weights {blocks} B")
    assert z0 - z3 >= blocks
    assert all(u.full.untyped_storage().nbytes() == 0 for u in tr.par.grads.units)


@pytest.mark.parametrize("stage", [1, 3])
def test_reductions_left_in_flight_match(pools, stage):
    """GPUs keep one reduce-scatter (and HSDP all-reduce) in flight behind the newest, CPUs none: run
    the GPU policy here too, with HSDP and accumulation."""
    over = {"training__micro_batch": 1}
    ref = reference(**over)
    run_dir = tempfile.mkdtemp(prefix="meshlm-inflight-")
    cfg = make_config(parallel__dp=4, parallel__zero=stage, parallel__zero_group=2, **over)
    pools(4).run(train_tweaked, C.to_dict(cfg), run_dir, 0.0, 1)
    assert_same_losses(ref, read_metrics(run_dir), FP32)
