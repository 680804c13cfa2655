"""DiLoCo islands (issue #52, docs/diloco.md): bad input in one line before any worker; the layout inside an
island changes nothing (fp32, 1e-5 per step) and equals a plain one-process reference that runs the islands one
after another; with H = 1, outer lr 1 and no momentum the parameters after a step are the islands' mean; the
cross-island bytes equal plan/cost/islands.py's formula and are at most 1/H (int8: 1/(2H)) of synchronous DP's."""
import os
import tempfile

import pytest
import torch
from harness import (
    assert_refused_in_one_line,
    assert_same_losses,
    make_config,
    read_metrics,
    train_in,
)

from meshlm.core import config as C
from harness import build_layout
from meshlm.plan.cost.islands import bytes_per_step

FP32 = 1e-5
STEPS = 6
ISLANDS = {"parallel__islands": 2, "training__steps": STEPS, "training__outer__sync_every": 2}


# ---------------------------------------------------------------- bad input, before launch

@pytest.mark.parametrize("overrides,world,message", [
    ({"parallel__islands": 3}, 4, "parallel.islands: 3 does not divide the world size 4"),
    ({"parallel__islands": 0}, 1, "parallel.islands: must be >= 1, got 0"),
    ({"parallel__islands": 2, "parallel__zero": 1, "parallel__offload": "nvme", "parallel__offload_dir": "/tmp/x"}, 2,
     ("parallel.islands: 2 islands not with parallel.offload = nvme (the outer step reads and writes the fp32 "
      "masters in memory)")),
    ({"parallel__islands": 2, "parallel__elastic": "replan"}, 2,
     "parallel.islands: 2 islands not with parallel.elastic = replan (the planner knows no islands)"),
    ({"parallel__islands": 2, "training__outer__fragments": 3, "training__outer__sync_every": 6, "model__n_layers": 2}, 2,
     "training.outer.fragments: 3 fragments of 2 blocks (each fragment holds whole blocks)"),
    ({"training__outer__fragments": 3, "training__outer__sync_every": 4}, 1,
     ("training.outer.fragments: must be >= 1 and divide training.outer.sync_every 4 (fragment k syncs at step "
      "k·H/K mod H), got 3")),
    ({"training__outer__quantize": "int4"}, 1,
     "training.outer.quantize: 'int4' is not one of none, bf16, fp8, int8"),
    ({"training__outer__sync_every": 0}, 1, "training.outer.sync_every: must be >= 1, got 0"),
    ({"training__outer__sync_every": 4, "training__outer__delay": 4}, 1,
     ("training.outer.delay: must be in [0, sync_every 4) (a fragment's average lands before its next sync "
      "starts), got 4")),
    ({"training__outer__alpha": 1.0}, 1, "training.outer.alpha: must be in [0, 1), got 1.0"),
    ({"training__outer__delay": 1, "training__outer__on_island_loss": "continue"}, 1,
     ("training.outer.delay: not with on_island_loss = continue (a round over the island link applies when "
      "it commits)")),
    ({"parallel__islands": 2, "training__global_batch": 6}, 2,
     "training.global_batch: 6 is not divisible by micro_batch×dp×islands = 2×1×2"),
])
def test_bad_islands_input_is_one_clear_line(overrides, world, message):
    assert_refused_in_one_line(lambda: build_layout(make_config(**overrides), world), message)


@pytest.mark.parametrize("argv,line", [
    (["--nproc", "4", "--parallel.islands", "3"], "meshlm: parallel.islands: 3 does not divide the world size 4"),
    (["--training.outer.quantize", "int4"], "meshlm: training.outer.quantize: 'int4' is not one of none, bf16, fp8, int8"),
])
def test_the_command_line_refuses_before_any_worker(tmp_path, capsys, argv, line):
    from meshlm.cli import main
    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), "--model.preset", "debug", *argv])
    assert (code, capsys.readouterr().err.strip()) == (2, line) and not run_dir.exists()


def test_islands_split_the_world_and_the_batch_like_dp():
    lay = build_layout(make_config(parallel__islands=2, parallel__zero=3), 4)
    assert (lay.islands, lay.dp, lay.accum, lay.global_batch, lay.world_size) == (2, 2, 1, 8, 4)
    assert lay.shape()["islands"] == 2 and "islands" not in build_layout(make_config(), 4).shape()


def test_one_island_makes_no_group_and_trains_on_the_world_group():
    """islands = 1 (the default): the island's group is the world's own and the cross-island one is empty,
    so no collective and no process group is added (the losses are the suite's references)."""
    from meshlm.distributed.mesh import ISLAND, groups_along
    shape = build_layout(make_config(parallel__tp=2), 4).shape()
    assert groups_along(ISLAND, shape) == [[0, 1, 2, 3]] and groups_along(("islands",), shape) == [[r] for r in range(4)]
    two = dict(shape, islands=2, dp_replicate=1)
    assert groups_along(ISLAND, two) == [[0, 1], [2, 3]] and groups_along(("tp",), two) == [[0, 1], [2, 3]]
    assert groups_along(("islands",), two) == [[0, 2], [1, 3]]


def test_one_island_ignores_the_outer_keys_bit_for_bit():
    """At islands = 1 no outer step runs, whatever training.outer says: the same losses, bit for bit."""
    from harness import reference
    base = reference(training__steps=4)
    outer = reference(training__steps=4, parallel__islands=1, training__outer__sync_every=1,
                      training__outer__lr=1.0, training__outer__momentum=0.0, training__outer__quantize="int8")
    assert [r["loss"] for r in base] == [r["loss"] for r in outer] and "outer" not in base[-1]["comm"]


# ---------------------------------------------------------------- a plain one-process reference

class _Batch:
    """The island's sampler as its Trainer reads it: its share of the (fixed) global batch."""

    def __init__(self, size: int):
        self.size = size

    def batch_size(self) -> int:
        return self.size


class _Share:
    """Island i's share of every global batch: the i-th of n contiguous slices (what dp = n reads)."""

    def __init__(self, data, i: int, n: int):
        self.data, self.i, self.n = data, i, n
        self.sampler = _Batch(data.sampler.batch_size() // n)

    def next_batch(self, dp_rank: int, dp_size: int, rows=()):
        return self.data.next_batch(self.i, self.n)


def islands_reference(islands: int = 2, **overrides) -> list[list[float]]:
    """Each island a one-process Trainer with 1/islands of the batch, run one after another every step;
    every H steps the outer step, written plainly with torch.optim.SGD(nesterov) on the mean of the
    islands' θ_outer − θ_inner. Returns each island's losses."""
    from meshlm.data import default_data_dir
    from meshlm.data.dataset import open_data
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.train.trainer import Trainer

    full = make_config(**{**ISLANDS, **overrides})
    o, g = full.training.outer, full.training.global_batch
    trainers = []
    for i in range(islands):
        cfg = make_config(**{**ISLANDS, **overrides, "parallel__islands": 1, "training__global_batch": g // islands})
        layout = build_layout(cfg, 1)
        tr = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-island-"), init_context(layout.shape(), pick_device("cpu")),
                     layout)
        tr.data = _Share(open_data(default_data_dir(), [], cfg.data.seq_len, g, cfg.training.seed), i, islands)
        trainers.append(tr)
    named = [[(n, t) for n, kind, t in tr.par.optimizer.state_storage() if kind == "master"] for tr in trainers]
    masters = [[t for _, t in ms] for ms in named]
    layers = trainers[0].args.n_layers
    fragment = [int(n.split(".")[1]) * o.fragments // layers if n.startswith("layers.") else
                0 if n.startswith("tok_embeddings") else o.fragments - 1 for n, _ in named[0]]
    outer = [t.detach().clone().requires_grad_(True) for t in masters[0]]
    sgd = torch.optim.SGD(outer, lr=o.lr, momentum=o.momentum, nesterov=o.momentum > 0)
    losses: list[list[float]] = [[] for _ in range(islands)]

    def land(grads: dict[int, torch.Tensor], alpha: float) -> None:
        """One outer step on the fragments in `grads`; their masters = alpha·masters + (1 − alpha)·θ_outer."""
        with torch.no_grad():
            for k, p in enumerate(outer):
                p.grad = grads.get(k)
        sgd.step()
        with torch.no_grad():
            for tr, ms in zip(trainers, masters):
                for k in grads:
                    ms[k].mul_(alpha).add_(outer[k], alpha=1 - alpha)
                tr.par.optimizer.loaded(tr.par.optimizer.step_count())
    flying: list[tuple[int, dict]] = []  # training.outer.delay: (the step it lands after, its mean Δ)
    for step in range(1, full.training.steps + 1):
        for i, tr in enumerate(trainers):
            losses[i].append(tr.meter.global_loss(tr.train_step()["loss_sum"]))
        for at, grads in [x for x in flying if x[0] == step]:
            land(grads, o.alpha)
        flying = [x for x in flying if x[0] != step]
        due = {k for k in range(o.fragments) if step % o.sync_every == k * o.sync_every // o.fragments}
        if due:
            with torch.no_grad():
                grads = {k: sum(p - m[k] for m in masters) / islands for k, p in enumerate(outer) if fragment[k] in due}
            if o.delay:
                flying.append((step + o.delay, grads))
            else:
                land(grads, 0.0)
    for tr in trainers:
        tr.close()
    return losses


def _as_records(losses: list[float]) -> list[dict]:
    return [{"step": s + 1, "loss": v} for s, v in enumerate(losses)]


_REFS: dict[str, list[list[float]]] = {}


def cached_reference(**overrides) -> list[list[float]]:
    key = repr(sorted(overrides.items()))
    if key not in _REFS:
        _REFS[key] = islands_reference(**overrides)
    return _REFS[key]


@pytest.mark.parametrize("inside,world", [
    ({}, 2),
    ({"parallel__zero": 3}, 4),
    ({"parallel__tp": 2, "parallel__sp": True}, 4),
    ({"parallel__pp": 2}, 4),
    ({"training__outer__fragments": 2}, 2),
    ({"training__outer__fragments": 2, "parallel__zero": 2, "parallel__tp": 2}, 4),
    ({"optim__name": "muon"}, 2),
    ({"parallel__zero": 1, "parallel__offload": "optimizer"}, 2),
    ({"model__preset": "dsv3-debug", "parallel__ep": 2}, 4),
    ({"training__outer__fragments": 2, "training__outer__delay": 1, "training__outer__alpha": 0.5, "parallel__zero": 3}, 4),
], ids=["one-rank", "dp2-zero3", "tp2-sp", "pp2", "streaming", "streaming-zero2-tp2", "muon", "zero1-offload", "dsv3-ep2",
        "overlap-zero3"])
def test_layout_inside_an_island_changes_nothing(pools, inside, world):
    """islands 2 with the layout `inside` each island and the plain reference: island 0's per-step losses
    (rank 0 logs its island's) agree within 1e-5 through three outer syncs (streaming: six, one fragment
    each); island 1's part shows in island 0's losses after each sync. Muon's matrices sync like AdamW's;
    DeepSeek-V3's selection biases (model state, not masters) stay each island's own."""
    same = {k: v for k, v in inside.items() if k in ("training__outer__fragments", "optim__name", "model__preset",
                                                     "training__outer__delay", "training__outer__alpha")}
    ref = cached_reference(**same)
    assert ref[0] != ref[1]  # the islands read different data
    if "training__outer__delay" in inside:  # the delayed landing is not the immediate one
        assert ref[0] != cached_reference(training__outer__fragments=2)[0]
    got = train_in(pools, make_config(**ISLANDS, **inside), world, tempfile.mkdtemp(prefix="meshlm-isl-"))
    assert_same_losses(_as_records(ref[0]), got, FP32)


# ---------------------------------------------------------------- the outer step is DiLoCo's

def mean_case(cfg_dict: dict, run_dir: str) -> list[float]:
    """Runs in a pool rank: wraps the outer step to gather every island's inner masters before it and
    compare the masters after it with their mean; the largest difference per sync."""
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.train.trainer import Trainer

    cfg = C.from_dict(cfg_dict)
    layout = build_layout(cfg, int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(cfg, run_dir, init_context(layout.shape(), pick_device("cpu"), timeout_s=120), layout)
    outer, worst = trainer.outer, []
    inner_step = outer.after_step

    def checked(step: int):
        mine = [t for frag in outer.fragments for _, t in frag]
        flat = torch.cat([t.reshape(-1) for t in mine])
        every = torch.empty(outer.comm.size * flat.numel())
        outer.comm.all_gather(every, flat, kind="test")
        mean = every.view(outer.comm.size, -1).mean(0)
        out = inner_step(step)
        worst.append(float((torch.cat([t.reshape(-1) for t in mine]) - mean).abs().max()))
        assert not torch.equal(every.view(outer.comm.size, -1)[0], every.view(outer.comm.size, -1)[1])
        return out

    outer.after_step = checked
    trainer.fit()
    return worst


def test_h1_lr1_no_momentum_is_the_mean_of_the_islands(pools):
    cfg = make_config(**{**ISLANDS, "training__outer__sync_every": 1, "training__outer__lr": 1.0,
                         "training__outer__momentum": 0.0, "training__steps": 3})
    worst = pools(2).run(mean_case, C.to_dict(cfg), tempfile.mkdtemp(prefix="meshlm-isl-"))
    for per_rank in worst:
        assert len(per_rank) == 3 and max(per_rank) <= 1e-6, per_rank


def _outer_bytes(rec: dict) -> float:
    return rec["comm"].get("outer", {}).get("bytes", 0.0)


_SYNC: dict[str, float] = {}


@pytest.mark.parametrize("quantize,fragments", [("none", 1), ("int8", 2), ("fp8", 1), ("bf16", 4)])
def test_cross_island_bytes_meet_the_formula_and_beat_sync_dp(pools, quantize, fragments):
    """Same seed twice: bit-identical (H > 1); rank 0's booked outer bytes per inner step over the run
    equal plan/cost/islands.py's formula and are <= 1/H (quantised: 1/(2H)) of dp2's reduce bytes per step."""
    h = 4
    blocks = {"model__n_layers": 4} if fragments > 2 else {}  # a fragment holds whole blocks (TINY has two)
    cfg = make_config(**{**ISLANDS, "training__outer__sync_every": h, "training__outer__quantize": quantize,
                         "training__outer__fragments": fragments, "training__steps": 8, **blocks})
    a = train_in(pools, cfg, 2, tempfile.mkdtemp(prefix="meshlm-isl-"))
    b = train_in(pools, cfg, 2, tempfile.mkdtemp(prefix="meshlm-isl-"))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    key = f"dp2 {blocks}"
    if key not in _SYNC:
        dp = train_in(pools, make_config(parallel__dp=2, training__steps=8, **blocks), 2,
                      tempfile.mkdtemp(prefix="meshlm-isl-"))
        _SYNC[key] = sum(r["comm"]["all_reduce"]["bytes"] for r in dp) / len(dp)
    sync_bytes = _SYNC[key]
    outer = sum(_outer_bytes(r) for r in a) / len(a)
    from meshlm.model import build_model
    from meshlm.core.config.model import model_args
    from meshlm.parallel.model_plans.moe import model_plan_for
    with torch.device("meta"):
        model = build_model(model_args(cfg))
    sizes = [0] * fragments
    for name, p in model.named_parameters():
        sizes[model_plan_for(model).fragment_of(name, model.args.n_layers, fragments)] += p.numel()
    assert outer == pytest.approx(bytes_per_step(sizes, 2, h, quantize), rel=1e-12)
    assert outer <= sync_bytes / (h * (2 if quantize != "none" else 1))
    if quantize != "none":  # the quantised outer gradient moves the model as fp32's does, nearly
        exact = train_in(pools, make_config(**{**ISLANDS, "training__outer__sync_every": h, "training__steps": 8,
                                               "training__outer__fragments": fragments, **blocks}), 2,
                         tempfile.mkdtemp(prefix="meshlm-isl-"))
        assert a[-1]["loss"] != exact[-1]["loss"] and abs(a[-1]["loss"] - exact[-1]["loss"]) < 0.01 * exact[-1]["loss"]


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_quantised_outer_gradients_of_four_islands_reduce_in_two_steps(pools, quantize):
    """Four islands (one rank each): fp8 / int8 outer gradients go as an all-to-all of quarters and an
    all-gather of the re-quantised sums (ZeRO++'s qgZ). Booked bytes equal plan/cost/islands.py's formula, half of
    what all-gathering every island's gradient would move; the same seed twice is bit-identical; the loss
    stays within 1% of fp32's."""
    from meshlm.plan.cost.islands import outer_sync_bytes, payload_bytes
    h = 2
    over = {**ISLANDS, "parallel__islands": 4, "training__outer__sync_every": h, "training__steps": 4}
    cfg = make_config(**over, training__outer__quantize=quantize)
    a = train_in(pools, cfg, 4, tempfile.mkdtemp(prefix="meshlm-isl4-"))
    b = train_in(pools, cfg, 4, tempfile.mkdtemp(prefix="meshlm-isl4-"))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    from meshlm.model import build_model
    from meshlm.core.config.model import model_args
    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(model_args(cfg)).parameters())
    outer = sum(_outer_bytes(r) for r in a) / len(a)
    assert outer == pytest.approx(outer_sync_bytes(n, 4, quantize) / h, rel=1e-12)
    assert outer_sync_bytes(n, 4, quantize) <= 0.51 * 4 * payload_bytes(n, quantize)
    exact = train_in(pools, make_config(**over), 4, tempfile.mkdtemp(prefix="meshlm-isl4-"))
    assert a[-1]["loss"] != exact[-1]["loss"] and abs(a[-1]["loss"] - exact[-1]["loss"]) < 0.01 * exact[-1]["loss"]


# ---------------------------------------------------------------- checkpoints

def test_checkpoints_resume_inside_a_round_and_move_between_island_counts_only_when_consistent(pools):
    """islands 2 × dp2 ZeRO-3, H = 4: resuming at step 2 (inside a round: each island's inner state and the
    sharded θ_outer and momentum come back) gives the same losses bit for bit; that checkpoint is refused in
    one line for one island, while step 4's (right after a sync: island 0's masters are θ_outer) loads into one
    process."""
    from meshlm.train import checkpoint as ckpt
    over = {**ISLANDS, "training__outer__sync_every": 4, "training__steps": 8, "parallel__zero": 3,
            "checkpoint__every": 2, "checkpoint__keep": 5}
    run_dir = tempfile.mkdtemp(prefix="meshlm-isl-ckpt-")
    ref = train_in(pools, make_config(**over), 4, run_dir)
    from test_train import truncate_run
    truncate_run(run_dir, 2)
    resumed = train_in(pools, make_config(**over, checkpoint__resume="auto"), 4, run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed[2:]] == [r["loss"] for r in ref[2:]]  # exact
    root = os.path.join(run_dir, "checkpoints")
    one = make_config(**{**over, "parallel__islands": 1, "parallel__zero": 0})
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.check_islands(one, os.path.join(root, "step_00000002"))
    assert str(e.value).startswith("parallel.islands: ") and "\n" not in str(e.value)
    assert "written by 2 islands at step 2, inside an outer round" in str(e.value)
    at_sync = os.path.join(root, "step_00000004")
    ckpt.check_islands(one, at_sync)
    md = ckpt.read_metadata(at_sync)
    name = "layers.0.attention.wq.weight"
    assert torch.equal(ckpt.read_full(at_sync, md, f"master/{name}"), ckpt.read_full(at_sync, md, f"outer/param/{name}"))
    assert torch.equal(ckpt.read_full(at_sync, md, f"island1/master/{name}"), ckpt.read_full(at_sync, md, f"master/{name}"))
    assert not torch.equal(ckpt.read_full(at_sync, md, f"exp_avg/{name}"), ckpt.read_full(at_sync, md, f"island1/exp_avg/{name}"))
    one_dir = tempfile.mkdtemp(prefix="meshlm-isl-one-")
    moved = train_in(pools, C.replace(one, checkpoint={"resume": at_sync}), 1, one_dir)
    assert [r["step"] for r in moved] == [5, 6, 7, 8]
    # and back: an ordinary checkpoint starts DiLoCo, θ_outer = its masters (one island's state in every island)
    plain = os.path.join(one_dir, "checkpoints", "step_00000006")
    two = make_config(**{**ISLANDS, "training__outer__sync_every": 4, "training__steps": 8,
                         "checkpoint__resume": plain})
    ckpt.check_islands(two, plain)
    again = train_in(pools, two, 2, tempfile.mkdtemp(prefix="meshlm-isl-two-"))
    assert [r["step"] for r in again] == [7, 8]
    assert abs(again[0]["loss"] - moved[2]["loss"]) / moved[2]["loss"] < 0.05  # the same model, half the batch


def test_a_delayed_sync_in_flight_is_checkpointed_and_resumes_exactly(pools):
    """training.outer.delay 2, alpha 0.5, H = 4: the checkpoint of step 5 holds the mean of step 4's sync, still
    in flight (it lands after step 6); resuming there gives the same losses bit for bit, and moving that
    checkpoint into one island is refused in one line (the islands' models differ)."""
    from test_train import truncate_run

    from meshlm.train import checkpoint as ckpt
    over = {**ISLANDS, "training__outer__sync_every": 4, "training__outer__delay": 2, "training__outer__alpha": 0.5,
            "training__steps": 8, "checkpoint__every": 1, "checkpoint__keep": 10}
    run_dir = tempfile.mkdtemp(prefix="meshlm-isl-delay-")
    ref = train_in(pools, make_config(**over), 2, run_dir)
    step5 = os.path.join(run_dir, "checkpoints", "step_00000005")
    assert ckpt.meta_of(step5)["outer_pending"] == {"0": 6}
    md = ckpt.read_metadata(step5)
    assert any(k.startswith("outer/pending/") for k in md.state_dict_metadata)
    with pytest.raises(ckpt.CheckpointError, match="^parallel.islands: .* inside an outer round"):
        ckpt.check_islands(make_config(**{**over, "parallel__islands": 1}), step5)
    truncate_run(run_dir, 5)
    resumed = train_in(pools, make_config(**over, checkpoint__resume="auto"), 2, run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed[5:]] == [r["loss"] for r in ref[5:]]  # exact


def resumed_probe(trainer) -> tuple[int, float]:
    """Runs in a pool rank after the resume: (its island, the largest difference between its masters and
    what it should have loaded: its island's own masters if the checkpoint has the island, else θ_outer)."""
    from meshlm.train import checkpoint as ckpt
    path = ckpt.find_resume(trainer.checkpointer.root, trainer.cfg.checkpoint.resume)
    md, written, i = ckpt.read_metadata(path), ckpt.islands_of(path), trainer.state.island
    key = ((f"island{i}/" if i else "") + "master/{}") if i < written else "outer/param/{}"
    worst = 0.0
    for name, kind, t in trainer.par.optimizer.state_storage():
        if kind == "master":
            worst = max(worst, float((ckpt.read_full(path, md, key.format(name)).view_as(t) - t).abs().max()))
    return i, worst


def test_an_island_dropped_or_rejoining_goes_on_from_the_checkpoint(pools):
    """4 islands checkpoint inside a round; resumed as 2 islands (two dropped), each keeps its own inner
    state and θ_outer goes on; that run's checkpoint inside a round resumed as 4 islands: the two that
    rejoin start from θ_outer, the others from their own state."""
    from harness import train_case
    over = {**ISLANDS, "training__outer__sync_every": 4, "training__steps": 6, "checkpoint__every": 2,
            "checkpoint__keep": 5}
    four = tempfile.mkdtemp(prefix="meshlm-isl-four-")
    train_in(pools, make_config(**{**over, "parallel__islands": 4}), 4, four, stop=2)
    two = tempfile.mkdtemp(prefix="meshlm-isl-two-")
    cfg = make_config(**over, checkpoint__resume=os.path.join(four, "checkpoints", "step_00000002"))
    seen = pools(2).run(train_case, C.to_dict(cfg), two, 0, resumed_probe)
    assert [i for i, _ in seen] == [0, 1] and max(w for _, w in seen) == 0.0
    assert [r["step"] for r in read_metrics(two)] == [3, 4, 5, 6]
    back = make_config(**{**over, "training__steps": 8, "parallel__islands": 4,
                          "checkpoint__resume": os.path.join(two, "checkpoints", "step_00000006")})
    again = tempfile.mkdtemp(prefix="meshlm-isl-again-")
    seen = pools(4).run(train_case, C.to_dict(back), again, 0, resumed_probe)
    assert [i for i, _ in seen] == [0, 1, 2, 3] and max(w for _, w in seen) == 0.0
    assert [r["step"] for r in read_metrics(again)] == [7, 8]
