"""Issue 6 item 6: the planner's per-rank params/grads/optimizer bytes equal what the trainer measures
from live tensors (metrics.jsonl `mem`, rank 0) within 2%, for every layout that can run here."""
import pytest
from harness import make_config, run_layout, run_local

from meshlm.core import config as C
from meshlm.plan.cost.estimate import Options, estimate
from meshlm.plan.cost.memory import stage_memory
from meshlm.plan.spec import code_options, priced_on, shape_from_config, spec_from_config

CASES = [
    ("one-process-fp32", 1, {}),
    ("one-process-bf16", 1, {"training__precision": "bf16"}),
    ("dp2-fp16", 2, {"parallel__dp": 2, "training__precision": "fp16"}),
    ("zero1-dp2", 2, {"parallel__dp": 2, "parallel__zero": 1}),
    ("zero2-dp2", 2, {"parallel__dp": 2, "parallel__zero": 2}),
    ("zero3-dp2", 2, {"parallel__dp": 2, "parallel__zero": 3}),
    ("zero3-dp2-bf16", 2, {"parallel__dp": 2, "parallel__zero": 3, "training__precision": "bf16"}),
    ("hsdp-zero2-dp4-g2", 4, {"parallel__dp": 4, "parallel__zero": 2, "parallel__zero_group": 2}),
    ("zero1-dp2-offload", 2, {"parallel__dp": 2, "parallel__zero": 1, "parallel__offload": "optimizer"}),
    ("tp2", 2, {"parallel__tp": 2}),
    ("tp2-sp-bf16", 2, {"parallel__tp": 2, "parallel__sp": True, "training__precision": "bf16"}),
    ("dp2-tp2-zero3", 4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__zero": 3}),
    ("pp2-1f1b", 2, {"parallel__pp": 2}),
    ("pp4-zb-h1", 4, {"parallel__pp": 4, "parallel__pp_schedule": "zb-h1", "model__n_layers": 4}),
    # vocabulary padding (model.vocab_multiple 128): 300 ids take 384 rows, at tp=2 512 (256 per rank)
    ("vocab300-padded", 1, {"model__vocab_size": 300}),
    ("tp2-vocab300-padded", 2, {"parallel__tp": 2, "model__vocab_size": 300}),
    # mixture of experts (issue 13): experts split over ep, ZeRO over the expert-data group
    ("moe-ep2", 2, {"model__preset": "moe-debug", "parallel__dp": 2, "parallel__ep": 2}),
    ("moe-dp4-ep2-zero3", 4, {"model__preset": "moe-debug", "parallel__dp": 4, "parallel__ep": 2, "parallel__zero": 3}),
    ("moe-ep2-tp2-every2", 4, {"model__preset": "moe-debug", "parallel__dp": 2, "parallel__ep": 2, "parallel__tp": 2,
                               "model__moe__every": 2}),
    # optim.name = "muon": one momentum instead of Adam's two moments for the block matrices
    ("muon-one-process", 1, {"optim__name": "muon"}),
    ("muon-zero3-dp2-bf16", 2, {"optim__name": "muon", "parallel__dp": 2, "parallel__zero": 3,
                                "training__precision": "bf16"}),
]


def predicted(cfg, world: int) -> dict:
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, world)
    if spec.pp_enabled:  # rank 0 holds the first stage
        return stage_memory(shape, spec, "first", Options(attn_math_bytes=4)).breakdown()
    return estimate(shape, spec)["per_gpu"]


@pytest.mark.parametrize("name,world,overrides", CASES, ids=[c[0] for c in CASES])
def test_predicted_state_bytes_match_measured(pools, name, world, overrides):
    cfg = make_config(training__steps=2, **overrides)
    recs = run_local(cfg) if world == 1 else run_layout(pools, cfg, world)
    measured = recs[-1]["mem"]
    pred = predicted(cfg, world)
    # With optimizer offload the optimizer's bytes live in host memory: the planner reports them as
    # `cpu_optim` and leaves them out of the GPU total; the trainer counts them under `optim`.
    pred_optim = pred["optim"] + pred.get("cpu_optim", 0)
    for key, want in (("params", pred["params"]), ("grads", pred["grads"]), ("optim", pred_optim)):
        assert measured[key] == pytest.approx(want, rel=0.02), (key, measured[key], want)


@pytest.mark.parametrize("sp,ac", [(False, "none"), (True, "none"), (False, "full"), (True, "full")])
def test_planner_tp_traffic_matches_runtime_count(sp, ac):
    """The planner's TP collectives per step equal the runtime's count and bytes (verified byte for byte
    against Comm's books in test_tp), every kind."""
    from meshlm.core.config.model import model_args
    from meshlm.plan.cost.comm import collectives
    from meshlm.plan.cost.volume import tp_step_bytes as expected_bytes

    cfg = make_config(parallel__tp=2, parallel__sp=sp, training__ac=ac, data__seq_len=32)
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, 2)
    planned = {c.kind: (c.calls, c.calls * c.buffer_bytes * (2 if c.kind == "all_reduce" else 1))
               for c in collectives(shape, spec, 0, 0, shape.args.n_layers, True, True, None) if c.group == "tp"}
    runtime = expected_bytes(model_args(cfg), spec.micro_batch, spec.seq_len, spec.accum, 2, sp, ac)
    assert planned.keys() == runtime.keys(), (planned, runtime)
    for kind, (calls, nbytes) in runtime.items():  # the same formulas (plan/cost/volume.py), one per kind
        assert planned[kind][0] == calls and planned[kind][1] == pytest.approx(nbytes, rel=1e-12), (kind, planned, runtime)


# -- context parallelism (issue #12) ------------------------------------------------------------

CP_STATE = [
    ("cp2", 2, {"parallel__cp": 2}),
    ("cp2-zero1", 2, {"parallel__cp": 2, "parallel__zero": 1}),
    ("dp2-cp2-zero3", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__zero": 3}),
    ("hsdp-dp2g1-cp2-zero2-ulysses", 4, {"parallel__dp": 2, "parallel__zero_group": 1, "parallel__cp": 2,
                                         "parallel__zero": 2, "parallel__cp_impl": "ulysses"}),
]


@pytest.mark.parametrize("name,world,overrides", CP_STATE, ids=[c[0] for c in CP_STATE])
def test_predicted_cp_state_bytes_match_measured(pools, name, world, overrides):
    """ZeRO shards over dp_shard×cp (the planner's shard group is zero_group × cp)."""
    test_predicted_state_bytes_match_measured(pools, name, world, overrides)


def activation_task(cfg_dict: dict) -> int:
    """Bytes the whole model saves for backward in one micro-batch's forward + loss on this rank."""
    import os

    import torch

    from meshlm.core import config as C
    from meshlm.distributed.mesh import init_context, pick_device
    from harness import build_layout
    from meshlm.model import Llama
    from meshlm.core.config.model import model_args
    from meshlm.parallel import parallelize, slices
    from meshlm.train.observe.saved import saved_bytes
    from meshlm.parallel.optim.master import MasterOptimizer
    from meshlm.distributed.mesh import device_defaults
    cfg = device_defaults(C.from_dict(cfg_dict))  # the entry's: "auto" keys for this CPU
    layout = build_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_context(layout.shape(), pick_device("cpu"), timeout_s=120)
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    par = parallelize(model, ctx, layout, MasterOptimizer, **slices(cfg))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (cfg.training.micro_batch, cfg.data.seq_len + 1), generator=g)
    x, y = (par.local_tokens(t) for t in (tokens[:, :-1], tokens[:, 1:]))
    return saved_bytes(lambda: par.loss_fn(par.model(x), y), skip=par.model.parameters()).total


CP_ACTS = [(c, impl, ac) for c in (1, 2, 4) for impl in ("ring", "ulysses") for ac in ("none", "selective")
           if not (c == 1 and impl == "ulysses")] + [(2, "ring", "full"), (2, "allgather", "none"),
                                                     (4, "allgather", "selective"), (2, "allgather-sdpa", "none"),
                                                     (4, "allgather-sdpa", "selective")]


@pytest.mark.parametrize("cp,impl,ac", CP_ACTS, ids=[f"cp{c}-{i}-{a}" for c, i, a in CP_ACTS])
def test_predicted_cp_activations_match_measured(pools, cp, impl, ac):
    """The planner's activation bytes per rank (blocks, embedding ids, head and loss) against the
    tensors autograd really saves in one forward, within 3%: they fall as 1/cp (all-gather under SDPA:
    its saved mask copy per block included, memory.saved_mask_bytes; under flex, auto, none)."""
    impl, attn = impl.split("-")[0], "sdpa" if impl.endswith("-sdpa") else "auto"
    over = {"parallel__cp": cp, "parallel__cp_impl": impl, "training__ac": ac, "data__seq_len": 128,
            "model__n_kv_heads": 2 if impl == "ring" else 1, "model__attn_impl": attn}
    cfg = make_config(**over)
    if cp == 1:
        measured = _local(activation_task, cfg)
    else:
        measured = pools(cp).run(activation_task, C.to_dict(cfg))[0]
    code = code_options(priced_on(cfg, gpu=False))
    o = Options(attn_mask=code["attn_mask"], attn_impl=code["attn_impl"])  # all-gather: flex or a dense mask
    pred = estimate(shape_from_config(cfg), spec_from_config(cfg, cp), o=o)["per_gpu"]["activations"]
    print(f"cp{cp} {impl} ac={ac}: measured {measured} B, planned {pred:.0f} B ({measured / pred:.3f})")
    assert measured == pytest.approx(pred, rel=0.03)


def _local(task, cfg):
    return task(C.to_dict(cfg))


@pytest.mark.parametrize("impl,ac,kv", [("ring", "none", 4), ("ring", "full", 2), ("ulysses", "none", 4),
                                        ("ulysses", "full", 1)])
def test_planner_cp_traffic_matches_runtime_count(impl, ac, kv):
    """The planner's CP bytes per step equal the runtime's formula (checked against Comm's books in
    test_cp.test_cp_bytes_match_theory), for cp = 4."""
    from meshlm.core.config.model import model_args
    from meshlm.plan.cost.comm import collectives
    from meshlm.plan.cost.volume import cp_step_bytes as expected_bytes

    cfg = make_config(parallel__cp=4, parallel__cp_impl=impl, training__ac=ac, model__n_kv_heads=kv)
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, 4)
    e = 4
    planned = [c for c in collectives(shape, spec, 0, 0, shape.args.n_layers, True, True, None) if c.group == "cp"]
    runtime = expected_bytes(model_args(cfg), spec.micro_batch, spec.seq_len, spec.accum, 4, impl, 1, ac, e)
    kind = "send" if impl == "ring" else "all_to_all"
    assert sum(c.calls for c in planned) == runtime[kind][0]
    assert sum(c.calls * c.buffer_bytes for c in planned) == pytest.approx(runtime[kind][1], rel=1e-9)
