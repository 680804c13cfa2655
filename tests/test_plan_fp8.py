"""Issue #50 item 5: the planner's bytes under fp8 (training.fp8_comm) are what Comm books: SP's float8
entry gathers and their amax all-reduces, EP's float8 dispatch; ZeRO-3's float8 weight gathers as closely as
its bf16 ones."""
import pytest
from harness import make_config
from test_plan_dsv3 import _books
from test_tp import comm_task

from meshlm.core import config as C
from meshlm.core.layout import fp8_comm_in_use, build_layout
from meshlm.core.config.model import model_args
from meshlm.plan.cost.comm import collectives
from meshlm.plan.spec import shape_from_config, spec_from_config
from meshlm.plan.cost.volume import ep_step_bytes, tp_step_bytes

FP8 = {"training__precision": "fp8", "training__steps": 2}


@pytest.mark.parametrize("entries", [["sp"], []], ids=["sp-float8", "sp-off"])
def test_sp_float8_gathers_equal_the_books(pools, entries):
    """Under fp8 no region re-gathers (its hook keeps the gathered input); with "sp" the dense regions'
    entries gather one byte an element after an amax all-reduce; the head's input and gradients stay bf16."""
    cfg = make_config(**FP8, parallel__tp=2, parallel__sp=True, training__fp8_comm=entries)
    lay = build_layout(cfg, 2)
    used = fp8_comm_in_use("fp8", "tensorwise", entries, lay)
    want = tp_step_bytes(model_args(cfg), lay.micro_batch, cfg.data.seq_len, lay.accum, 2, True, "none", 2, 2, used)
    assert _books(pools, cfg, 2, "tp") == {k: (2 * c, 2 * b) for k, (c, b) in want.items()}


def test_ep_float8_dispatch_equals_the_books(pools):
    """The dispatch direction moves d bytes and a 4-byte scale a row, the combine stays bf16: the mean
    over the ep ranks of what each sends is the formula."""
    cfg = make_config(**FP8, model__preset="moe-debug", parallel__dp=2, parallel__ep=2)
    lay = build_layout(cfg, 2)
    want = ep_step_bytes(model_args(cfg), lay.micro_batch * cfg.data.seq_len, lay.accum, "none", 2, fp8=True)
    ranks = [r["all_to_all"] for r in pools(2).run(comm_task, C.to_dict(cfg), 2, "ep")]
    assert [calls for calls, _ in ranks] == [2 * want["all_to_all"][0]] * 2
    assert sum(b for _, b in ranks) == 2 * 2 * want["all_to_all"][1]


@pytest.mark.parametrize("model", [{"model__n_layers": 4}, {"model__preset": "moe-debug"}], ids=["dense", "moe-debug"])
def test_zero3_float8_gathers_are_priced_as_bf16_ones_are(pools, model):
    """The planner's ZeRO-3 all-gather bytes under fp8 against the books (float8 linears one byte, the
    embedding, head and norms bf16), and its fp8/bf16 ratio under the issue's 0.60. The planner's ZeRO-3
    volume is per parameter, not per unit: it gathers every unit forward and backward, where the runtime
    keeps the last unit gathered into backward; fp8 must add no error beyond that one's (within 3%).
    moe-debug: the routed experts gathered in float8 too (row-wise scales), priced so."""
    def planned(cfg):
        shape, spec = shape_from_config(cfg), spec_from_config(cfg, 2)
        return sum(c.calls * c.buffer_bytes for c in collectives(shape, spec, *_stage(shape, spec), None)
                   if c.group == "dp_shard" and c.kind == "all_gather")

    err = {}
    for prec in ("fp8", "bf16"):
        cfg = make_config(**dict(FP8, training__precision=prec), parallel__dp=2, parallel__zero=3,
                          training__micro_batch=4, **model)
        booked = _books(pools, cfg, 2, "dp_shard_cp")["all_gather"][1] / 2  # two steps
        err[prec] = (planned(cfg), booked)
    (p8, b8), (p16, b16) = err["fp8"], err["bf16"]
    print(f"ZeRO-3 all-gather bytes a step: fp8 planned {p8:.0f} booked {b8:.0f}; bf16 planned {p16:.0f} booked "
          f"{b16:.0f}; fp8/bf16 planned {p8 / p16:.3f} booked {b8 / b16:.3f}")
    assert abs(p8 / b8 - 1) <= abs(p16 / b16 - 1) + 0.03
    assert p8 / p16 <= 0.60 and b8 / b16 <= 0.60


def _stage(shape, spec):
    from meshlm.plan.cost.stages import stage_params
    sp = stage_params(shape, spec, "only")
    return sp.dense, sp.expert, sp.layers, True, True


@pytest.mark.parametrize("recipe,gpus,group,kind,bound", [
    ("llama3-70b-32xh100.toml", 32, "tp", "all_gather", 0.55),     # SP entries halve, gradients stay bf16
    ("deepseek-v3-1024xh100.toml", 1024, "ep", "all_to_all", 0.80)])  # dispatch halves, combine stays
def test_estimate_shows_the_fp8_rows_of_the_recipes(capsys, recipe, gpus, group, kind, bound):
    """`meshlm estimate --training.precision fp8` on the 70B and the DeepSeek-V3 recipes: the collective
    that moves float8 carries fewer bytes than under bf16, and the amax all-reduces are in the table."""
    import json

    from test_plan import _run
    rows = {}
    for prec in ("bf16", "fp8"):
        code = _run(["estimate", "--config", f"configs/{recipe}", "--gpu", "h100", "--gpus", str(gpus), "--json",
                     "--training.precision", prec])
        assert code == 0
        rows[prec] = {(c["group"], c["kind"]): c["bytes"] for c in json.loads(capsys.readouterr().out)["comm"]}
    ratio = rows["fp8"][(group, kind)] / rows["bf16"][(group, kind)]
    print(f"{recipe}: {group} {kind} bytes fp8/bf16 {ratio:.3f}")
    assert ratio <= bound
    if group == "tp":
        assert ("tp", "all_reduce_amax") in rows["fp8"] and ("tp", "all_reduce_amax") not in rows["bf16"]
