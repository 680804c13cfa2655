"""Muon (parallel/optim/muon.py): Newton-Schulz against a plain reference, the update against a hand-written
Muon step, which parameters the model plan gives it, and every layout built so far reproducing one
process's losses (fp32 <= 1e-5); checkpoints carry the momentum and reshard."""
from __future__ import annotations

import math
import os
import shutil
import tempfile

import pytest
import torch
from harness import (assert_layout_losses, assert_same_losses, make_config, reference, rows, run_layout, train_case,
                     train_in)

from meshlm.core import config as C
from meshlm.core.config.model import model_args
from meshlm.model.llama import Llama
from meshlm.parallel.optim.muon import NS_COEFFS, MuonAdamW, deal, newton_schulz, ns_flops
from meshlm.parallel.placement import PlacementTable
from meshlm.parallel.model_plans.moe import model_plan_for
from meshlm.parallel.optim.master import MasterOptimizer

FP32 = 1e-5
MUON = {"optim__name": "muon"}


def _reference_ns(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Jordan et al.'s quintic iteration written out for one matrix, transposing a tall one."""
    a, b, c = NS_COEFFS
    x = g / (torch.linalg.matrix_norm(g) + 1e-7)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.t()
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.t() if tall else x


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48)])
def test_newton_schulz_orthogonalises(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape)
    o = newton_schulz(g, 5)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())  # the quintic's band around 1
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    core = u.t() @ o @ vh.t()  # the same singular vectors: diagonal in g's singular bases
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 1e-4, off.abs().max()
    torch.testing.assert_close(o, _reference_ns(g, 5), rtol=1e-5, atol=1e-6)


def test_newton_schulz_is_per_matrix_over_stacked_experts():
    torch.manual_seed(1)
    g = torch.randn(3, 16, 40)
    torch.testing.assert_close(newton_schulz(g, 5), torch.stack([_reference_ns(m, 5) for m in g]),
                               rtol=1e-5, atol=1e-6)


def _model(preset: str) -> tuple[torch.nn.Module, list]:
    cfg = make_config(model__preset=preset)
    torch.manual_seed(0)
    model = Llama(model_args(cfg))
    return model, [(n, p) for n, p in model.named_parameters()]


def test_plan_gives_muon_the_block_matrices_only():
    model, named = _model("debug")
    got = model_plan_for(model).muon_params(model)
    want = {n for n, p in named if n.startswith("layers.") and p.dim() == 2}
    assert got == want and got
    moe, named = _model("moe-debug")
    got = model_plan_for(moe).muon_params(moe)
    assert any(n.endswith("experts.w1") for n in got)
    assert not any("router" in n or "norm" in n or "embeddings" in n or n.startswith("output") for n in got)
    assert {n for n, p in named if n.startswith("layers.") and p.dim() >= 2 and "router" not in n} == got


def test_one_step_is_the_muon_update():
    """Nesterov momentum, Newton-Schulz, 0.2·sqrt(max(rows, cols)), decoupled weight decay; AdamW elsewhere."""
    model, named = _model("debug")
    cfg = make_config(**MUON, optim__muon_lr=0.02).optim
    table = PlacementTable()
    for n, p in named:
        table.add(n, tuple(p.shape))
    muon = model_plan_for(model).muon_params(model)
    opt = MuonAdamW.local(named, cfg, torch.device("cpu"), MasterOptimizer, muon, table, None)
    w = dict(named)["layers.0.feed_forward.w1.weight"]
    before, mom = w.detach().clone(), torch.zeros_like(w)
    emb = dict(named)["tok_embeddings.weight"]
    emb_before = emb.detach().clone()
    opt.set_lr(cfg.lr)
    flat = [torch.zeros(sum(opt.params[i].numel() for i in g)) for g in opt.groups]
    opt.bind_grads(flat)
    at = {}  # parameter name -> its view of the gradient buffers
    for g, buf in zip(opt.groups, flat):
        off = 0
        for i in g:
            at[opt.names[i]] = buf[off:off + opt.params[i].numel()].view(opt.params[i].shape)
            off += opt.params[i].numel()
    for step in range(2):
        torch.manual_seed(step)
        for buf in flat:
            buf.copy_(torch.randn_like(buf))
        g = at["layers.0.feed_forward.w1.weight"].clone()
        opt.step()
        mom = 0.95 * mom + g
        rows_, cols = w.shape
        want = before * (1 - 0.02 * cfg.weight_decay) - 0.02 * 0.2 * math.sqrt(max(rows_, cols)) * _reference_ns(
            g + 0.95 * mom, 5)
        torch.testing.assert_close(w.detach(), want, rtol=1e-5, atol=1e-6)
        before = want
    assert not torch.equal(emb.detach(), emb_before)  # AdamW moved the embedding
    kinds = {(n, k) for n, k, _ in opt.state_storage()}
    assert ("layers.0.feed_forward.w1.weight", "momentum") in kinds
    assert ("tok_embeddings.weight", "exp_avg") in kinds
    assert ("layers.0.feed_forward.w1.weight", "exp_avg") not in kinds


def test_unbuilt_combinations_are_refused_in_one_line():
    make_config(**MUON, parallel__auto=True).check()  # the planner's search prices Muon
    with pytest.raises(C.ConfigError, match="optim.name: muon"):
        make_config(**MUON, parallel__zero=1, parallel__dp=2, parallel__offload="optimizer").check()
    with pytest.raises(C.ConfigError, match="optim.name"):
        make_config(optim__name="sgd").check()


# -- equivalence with one process -----------------------------------------------------------------
MOE = {"model__preset": "moe-debug", "training__steps": 4}
CASES = [
    ("dp2", 2, {"parallel__dp": 2}),
    ("dp2-accum", 2, {"parallel__dp": 2, "training__micro_batch": 1}),
    ("pp2-1f1b", 2, {"parallel__pp": 2, "parallel__pp_schedule": "1f1b"}),
    ("tp2-sp", 2, {"parallel__tp": 2, "parallel__sp": True}),
    ("tp2-gqa-kv1", 2, {"parallel__tp": 2, "model__n_kv_heads": 1}),
    ("tp2-pp2", 4, {"parallel__tp": 2, "parallel__pp": 2}),
    ("tp4-gqa-kv2", 4, {"parallel__tp": 4, "model__n_kv_heads": 2}),
    ("zero1-dp2", 2, {"parallel__dp": 2, "parallel__zero": 1}),
    ("zero2-dp2", 2, {"parallel__dp": 2, "parallel__zero": 2}),
    ("zero3-dp2", 2, {"parallel__dp": 2, "parallel__zero": 3}),
    ("zero3-dp4", 4, {"parallel__dp": 4, "parallel__zero": 3}),
    ("hsdp-zero2-dp4-g2", 4, {"parallel__dp": 4, "parallel__zero": 2, "parallel__zero_group": 2}),
    ("zero3-dp2-tp2", 4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__zero": 3}),
    ("zero1-dp2-pp2", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__zero": 1}),
    ("cp2-ring", 2, {"parallel__cp": 2}),
    ("dp2-cp2-zero3", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__zero": 3}),
    ("pp2-zbv-tied", 2, {"parallel__pp": 2, "parallel__pp_schedule": "zbv", "parallel__pp_virtual": 2,
                         "model__tie_embeddings": True, "model__n_layers": 4}),
    ("dp2-fp16", 2, {"parallel__dp": 2, "training__precision": "fp16"}),
    ("zero3-dp2-bf16", 2, {"parallel__dp": 2, "parallel__zero": 3, "training__precision": "bf16"}),
    ("ep2-moe", 2, {**MOE, "parallel__dp": 2, "parallel__ep": 2}),
    ("ep2-tp2-moe", 4, {**MOE, "parallel__dp": 2, "parallel__ep": 2, "parallel__tp": 2}),
    ("dp4-ep2-zero3-moe", 4, {**MOE, "parallel__dp": 4, "parallel__ep": 2, "parallel__zero": 3}),
]


@pytest.mark.parametrize("name,world,overrides", rows(CASES, {"tp2-sp"}))
def test_muon_layout_matches_one_process(pools, name, world, overrides):
    single = {**MUON, **{k: v for k, v in overrides.items() if not k.startswith("parallel__")}}
    ref = reference(**single)
    adamw = reference(**{k: v for k, v in single.items() if k != "optim__name"})
    assert abs(ref[-1]["loss"] - adamw[-1]["loss"]) > 1e-3  # Muon's losses are its own
    got = run_layout(pools, make_config(**MUON, **overrides), world)
    assert_layout_losses(single, got, FP32)


# -- checkpoints ----------------------------------------------------------------------------------
CKPT = {**MUON, "training__steps": 8}


RESHARDS = [({}, {}), ({"parallel__dp": 2}, {"parallel__tp": 2}),
            ({"parallel__dp": 2, "parallel__zero": 3}, {"parallel__tp": 2, "parallel__sp": True}),
            ({"parallel__tp": 2}, {"parallel__dp": 2, "parallel__zero": 1})]


@pytest.mark.parametrize("a,b", RESHARDS, ids=["1proc", "dp2->tp2", "zero3-dp2->tp2-sp", "tp2->zero1-dp2"])
def test_checkpoint_carries_momentum_and_reshards(pools, a, b):
    ref = reference(**CKPT)
    dir_a, dir_b = tempfile.mkdtemp(prefix="meshlm-a-"), tempfile.mkdtemp(prefix="meshlm-b-")
    world = lambda over: over.get("parallel__dp", 1) * over.get("parallel__tp", 1)  # noqa: E731
    first = train_in(pools, make_config(**CKPT, **a, checkpoint__every=4), world(a), dir_a, stop=4)
    assert_same_losses(ref[:4], first, FP32)
    step4 = os.path.join(dir_a, "checkpoints", "step_00000004")
    got = train_in(pools, make_config(**CKPT, **b, checkpoint__resume=step4), world(b), dir_b)
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    assert_same_losses(ref[4:], got, FP32)
    shutil.rmtree(dir_a, ignore_errors=True)
    shutil.rmtree(dir_b, ignore_errors=True)


# -- optimizer memory -----------------------------------------------------------------------------
def _optim_bytes(trainer) -> tuple[int, int]:
    """This rank's optimizer state bytes and the Muon elements it holds momentum for (0 under AdamW)."""
    opt = trainer.par.optimizer
    muon = getattr(opt, "muon", None)
    return opt.state_bytes(), sum(t.numel() for t in muon.own_tensors()) if muon is not None else 0


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_muon_state_is_one_momentum_instead_of_two_moments(pools, zero):
    """Under ZeRO the Adam moments leave Muon's pieces out: each rank's state is 4 bytes less per
    Muon element it holds (8 of moments gone, 4 of momentum added) than the AdamW run's."""
    over = {"parallel__dp": 2, "parallel__zero": zero, "training__steps": 1}
    cfg = make_config(**over)
    adamw = pools(2).run(train_case, C.to_dict(cfg), tempfile.mkdtemp(prefix="meshlm-a-"), 0, _optim_bytes)
    muon = pools(2).run(train_case, C.to_dict(make_config(**MUON, **over)), tempfile.mkdtemp(prefix="meshlm-m-"),
                        0, _optim_bytes)
    model, named = _model("debug")
    matrices = sum(p.numel() for n, p in named if n in model_plan_for(model).muon_params(model))
    assert sum(k for _, k in muon) == matrices  # every Muon element has a momentum on one rank
    for (a, _), (m, k) in zip(adamw, muon):
        assert k > 0 and a - m == 4 * k


def _muon_step_books(trainer) -> dict:
    """Probe: the shard group's Comm books over each Muon step (Muon's step wrapped; the returned dict
    fills during training) and each unit's layout (names, sizes, offsets, shard size)."""
    units = trainer.par.grads.units
    comm = units[0].comm
    assert all(u.comm is comm for u in units)
    seen = {"rank": comm.rank, "steps": [],
            "units": [(u.names, u.numels, u.offsets, u.shard_size) for u in units]}
    muon = trainer.par.optimizer.muon
    inner = muon.step

    def books() -> dict:
        return {k: (s.calls, s.bytes) for k, s in comm.stats.items()}

    def step(lr, cfg):
        before = books()
        inner(lr, cfg)
        after = books()
        seen["steps"].append({k: (c - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1])
                              for k, (c, b) in after.items() if (c, b) != before.get(k, (0, 0))})
    muon.step = step
    return seen


def test_zero_muon_moves_each_piece_to_its_owner_and_back(pools):
    """zero3 dp4: Muon's step is two all-to-alls per unit holding Muon matrices; a rank books its pieces
    of the Muon matrices (to their owners) and its owned matrices whole (the results back), fp32. Over
    the group each Muon element is booked twice: at most 1/n of what an all-gather plus a reduce-scatter
    of every such unit books on all ranks. The planner's all-to-all bytes are the ranks' mean."""
    from meshlm.plan.cost.estimate import estimate
    from meshlm.plan.hardware import get_gpu
    from meshlm.plan.spec import shape_from_config, spec_from_config

    n = 4
    cfg = make_config(**MUON, parallel__dp=n, parallel__zero=3, training__steps=1)
    got = pools(n).run(train_case, C.to_dict(cfg), tempfile.mkdtemp(prefix="meshlm-m-"), 0, _muon_step_books)
    model, named = _model("debug")
    muon = model_plan_for(model).muon_params(model)
    shapes = {name: tuple(p.shape) for name, p in named}
    order = [name for names, *_ in got[0]["units"] for name in names if name in muon]  # units in order
    owner = dict(zip(order, deal([ns_flops(shapes[name], 5) for name in order], n)))
    assert set(owner) == muon
    held = [(names, numels, offsets, size) for names, numels, offsets, size in got[0]["units"] if muon & set(names)]
    booked = []
    for r in got:
        pieces = owned = 0
        for names, numels, offsets, size in held:
            lo = r["rank"] * size
            for name, k, o in zip(names, numels, offsets):
                if name in muon:
                    pieces += max(0, min(o + k, lo + size) - max(o, lo))
                    owned += k if owner[name] == r["rank"] else 0
        (step,) = r["steps"]
        assert step.keys() == {"all_to_all"}, step
        calls, nbytes = step["all_to_all"]
        assert calls == 2 * len(held) and nbytes == 4 * (pieces + owned), (r["rank"], step, pieces, owned)
        booked.append(nbytes)
    matrices = sum(p.numel() for name, p in named if name in muon)
    assert sum(booked) == 2 * 4 * matrices
    whole_units = n * 2 * 4 * sum(n * size for *_, size in held)  # every rank all-gathers + reduce-scatters them
    assert sum(booked) <= whole_units / n
    plan = estimate(shape_from_config(cfg), spec_from_config(cfg, n), get_gpu("h100-sxm-80gb"))
    planned = [c for c in plan["comm"] if c["group"] == "dp_shard" and c["kind"] == "all_to_all" and c["per"] == "step"]
    wire = sum(booked) / n * (n - 1) / n  # the ranks' mean, (n-1)/n of it on a link
    assert sum(c["bytes"] for c in planned) == pytest.approx(wire, rel=1e-9)


def _ns_runs(trainer) -> dict:
    """Probe: per Muon step, how many Newton-Schulz calls this rank ran per matrix and their FLOPs
    (Muon's step wrapped; the returned dict fills during training)."""
    muon = trainer.par.optimizer.muon
    orthos = muon.orthogonalisers()
    seen = {"steps": [], "split": sorted(name for name, o in orthos if o.split),
            "flops": {name: o.flops for name, o in orthos}}
    inner = muon.step

    def step(lr, cfg):
        before = [o.runs for _, o in orthos]
        inner(lr, cfg)
        seen["steps"].append({name: o.runs - b for (name, o), b in zip(orthos, before) if o.runs != b})
    muon.step = step
    return seen


TP_DEALS = [("tp2", 2, {"parallel__tp": 2}),
            ("zero3-dp2-tp2", 4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__zero": 3})]


@pytest.mark.parametrize("name,world,overrides", rows(TP_DEALS))
def test_tp_split_matrix_is_orthogonalised_on_one_rank(pools, name, world, overrides):
    """Each TP-split matrix runs Newton-Schulz on exactly one rank of the world per step (one tp group
    at tp2; under ZeRO one rank of the shard group times tp); the ranks' NS FLOPs differ by at most
    one matrix's, and the busiest rank's equal the planner's `ns_share`."""
    from meshlm.plan.cost.muon import ns_flops as planned_flops
    from meshlm.plan.cost.muon import ns_share
    from meshlm.plan.spec import shape_from_config, spec_from_config

    cfg = make_config(**MUON, **overrides, training__steps=2)
    got = pools(world).run(train_case, C.to_dict(cfg), tempfile.mkdtemp(prefix="meshlm-m-"), 0, _ns_runs)
    model, _ = _model("debug")
    muon = model_plan_for(model).muon_params(model)
    assert all(set(r["split"]) == muon for r in got)  # every Muon matrix is split at tp2
    flops = got[0]["flops"]
    for step in range(2):
        per_rank = [r["steps"][step] for r in got]
        for m in muon:
            assert sum(runs.get(m, 0) for runs in per_rank) == 1, (step, m, per_rank)
        work = [sum(flops[m] * k for m, k in runs.items()) for runs in per_rank]
        assert min(work) > 0 and max(work) - min(work) <= max(flops.values()), work
        assert sum(work) == sum(flops.values())  # one process's NS work, once
        shape = shape_from_config(cfg)
        share = ns_share(shape, spec_from_config(cfg, world), shape.args.n_layers)
        assert max(work) == sum(planned_flops(r, c) for r, c in share), (work, share)


def _tp_exchange(trainer) -> dict:
    """Probe: per Muon step, the tp all-to-all calls, the largest send and receive buffers they got
    (the tp Comm's all_to_all wrapped) and the Muon masters after it; the deal and the buckets."""
    muon = trainer.par.optimizer.muon
    x = muon.exchange
    seen = {"owners": list(x.owners), "buckets": [b.items for b in x.buckets], "buffer_bytes": x.buffer_bytes(),
            "slices": [o.numel for o in x.orthos], "flops": [o.flops for o in x.orthos], "steps": []}
    inner_a2a, inner_step = x.comm.all_to_all, muon.step
    calls = []

    def all_to_all(out, inp, *a, **kw):
        calls.append((4 * inp.numel(), 4 * out.numel()))
        return inner_a2a(out, inp, *a, **kw)

    def step(lr, cfg):
        before = x.comm.stats["all_to_all"].calls if "all_to_all" in x.comm.stats else 0
        calls.clear()
        inner_step(lr, cfg)
        seen["steps"].append({"booked_calls": x.comm.stats["all_to_all"].calls - before,
                              "pairs": [(calls[i][0], calls[i][1]) for i in range(0, len(calls), 2)],
                              "masters": [m.detach().clone() for m in muon.masters]})
    x.comm.all_to_all, muon.step = all_to_all, step
    return seen


def test_tp_exchange_runs_in_buckets_with_the_same_deal_and_results(pools):
    """tp2 without ZeRO, parallel.bucket_mb 40 KiB (the debug model's slices are 320 KiB a step): two
    all-to-alls per bucket; a bucket sends at most max(cap, the largest slice) and receives at most
    max(cap, the largest matrix); the deal is the one over all split matrices; the masters after each
    step are bitwise those of one bucket (a cap above the step's slices). The planner's buffer for the
    exchange equals the runtime's largest bucket."""
    from meshlm.plan.cost.muon import muon_tp_bucket_bytes
    from meshlm.plan.spec import shape_from_config, spec_from_config

    cap_mb = 40 / 1024
    runs = {}
    for mb in (cap_mb, 1e6):
        cfg = make_config(**MUON, parallel__tp=2, parallel__bucket_mb=mb, training__steps=2)
        runs[mb] = pools(2).run(train_case, C.to_dict(cfg), tempfile.mkdtemp(prefix="meshlm-m-"), 0, _tp_exchange)
    cap = cap_mb * 2 ** 20
    for r, (small, one) in enumerate(zip(runs[cap_mb], runs[1e6])):
        assert small["owners"] == one["owners"] == deal(small["flops"], 2)
        assert len(one["buckets"]) == 1 and len(small["buckets"]) >= 4, small["buckets"]
        assert [k for b in small["buckets"] for k in b] == list(range(len(small["slices"])))  # consecutive
        largest = 4 * max(small["slices"])
        for s_, o_ in zip(small["steps"], one["steps"]):
            assert s_["booked_calls"] == 2 * len(small["buckets"]) and o_["booked_calls"] == 2
            assert len(s_["pairs"]) == len(small["buckets"])
            assert max(send for send, _ in s_["pairs"]) <= max(cap, largest)
            assert max(recv for _, recv in s_["pairs"]) <= max(cap, 2 * largest)
            assert max(a + b for a, b in s_["pairs"]) == small["buffer_bytes"]
            assert all(torch.equal(a, b) for a, b in zip(s_["masters"], o_["masters"], strict=True)), r
    cfg = make_config(**MUON, parallel__tp=2, parallel__bucket_mb=cap_mb)
    shape = shape_from_config(cfg)
    planned = muon_tp_bucket_bytes(shape, spec_from_config(cfg, 2), shape.args.n_layers)
    runtime = max(r["buffer_bytes"] for r in runs[cap_mb])
    assert runtime <= planned <= 1.25 * runtime, (runtime, planned)


def test_auto_layout_trains_muon_with_one_process_losses(pools):
    ref = reference(**MUON)
    got = run_layout(pools, make_config(**MUON, parallel__auto=True), 2)
    assert_same_losses(ref, got, FP32)
