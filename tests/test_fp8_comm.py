"""training.fp8_comm (docs/fp8.md, "Collectives in float8"): ZeRO-3's weight gathers and SP's activation gathers
moving float8 under fp8, on the CPU through the production path (torch._scaled_mm takes the gathered codes): the cast is torchao's bit for bit, the
gathered weight is the locally cast whole weight, the bytes booked in metrics.jsonl, each entry off
giving bf16 gathers again, losses (identical to the same run gathering bf16; within 2% of bf16) and
checkpoints that bf16 runs read."""
import shutil
import tempfile

import pytest
import torch
from harness import make_config, read_metrics, train_case
from test_fp8 import FP8, STEPS, WITHIN, assert_near_bf16, bf16_reference

from meshlm.core import config as C

# the byte and call counts below are the debug preset's four blocks (TINY trains two)
ZERO3 = {"parallel__dp": 2, "parallel__zero": 3, "model__n_layers": 4}
TP_SP = {"parallel__tp": 2, "parallel__sp": True, "model__n_layers": 4}
SHORT = {"training__steps": 3, "training__micro_batch": 4}  # 2 micro-batches per step under tp2 (1 under dp2)


def test_float8_cast_is_torchaos_bit_for_bit():
    """distributed/float8_comm.py's scale and cast against torchao's: a tensor cast from the MAX of its
    pieces' amaxes is the whole tensor's cast; another scale gives other codes; rows travel with their scales."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from meshlm.distributed.float8_comm import FLOAT8, amax, encode, pack_rows, scales_of, unpack_rows

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 64, generator=g) * torch.logspace(-3, 2, 64)).to(torch.bfloat16)
    ref = hp_tensor_to_float8_dynamic(x, FLOAT8, LinearMMConfig())
    pieces = torch.stack([amax(p) for p in x.view(-1).split([1000, 0, 2072])])  # ranks' pieces, one empty
    scale = scales_of(pieces.max())  # what shared_scales' MAX all-reduce gives every rank
    assert scale.dtype == torch.float32 and torch.equal(scale, ref._scale)
    assert torch.equal(encode(x, scale), ref._data.view(torch.uint8))
    assert not torch.equal(encode(x, scale * 2), ref._data.view(torch.uint8))  # a wrong scale is seen
    rows = torch.stack([scales_of(amax(r)) for r in x]).view(-1, 1)
    codes, got = unpack_rows(pack_rows(x[:, :62], rows), 62)
    assert torch.equal(got, rows) and torch.equal(codes.view(torch.uint8), encode(x[:, :62], rows))


def check_gathered_weights(trainer) -> dict:
    """Runs in a pool rank before training: every float8 weight ZeRO-3 gathers, against torchao's cast of
    the whole bf16 weight (gathered in bf16 here); and the same check with a scale twice as large."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    from meshlm.distributed.float8_comm import encode

    sync, seen = trainer.par.grads, {"exact": 0, "wrong_scale_caught": 0, "weights": 0}
    for u in sync.units:
        if not sync.f8.covers(u):
            continue
        sync._unshard(u)
        flat = torch.empty(u.padded, dtype=u.dtype)
        u.comm.all_gather(flat, u.shard)
        for i, p in enumerate(u.params):
            if id(p) not in sync.f8.where:
                continue
            codes, scale = sync.float8_weight(p)
            ref = hp_tensor_to_float8_dynamic(u.view(flat, i), codes.dtype, None)
            seen["weights"] += 1
            seen["exact"] += torch.equal(codes.view(torch.uint8), ref._data.view(torch.uint8)) and \
                torch.equal(scale, ref._scale)
            seen["wrong_scale_caught"] += not torch.equal(encode(u.view(flat, i), scale * 2, codes.dtype),
                                                          ref._data.view(torch.uint8))
        sync._reshard(u)
    return seen


def test_gathered_float8_weight_is_the_locally_cast_weight(pools):
    cfg = make_config(**FP8, **ZERO3, training__steps=1)
    seen = pools(2).run(train_case, C.to_dict(cfg), tempfile.mkdtemp(prefix="meshlm-fp8c-"), 0,
                        check_gathered_weights)
    assert seen == [{"exact": 28, "wrong_scale_caught": 28, "weights": 28}] * 2  # 7 linears x 4 blocks


def comm_of(pools, world: int, **overrides) -> tuple[list[float], dict]:
    """Losses and the last step's comm block of a short run."""
    run_dir = tempfile.mkdtemp(prefix="meshlm-fp8c-")
    pools(world).run(train_case, C.to_dict(make_config(**SHORT, **overrides)), run_dir)
    lines = read_metrics(run_dir)
    return [r["loss"] for r in lines], lines[-1]["comm"]


# (layout, its fp8_comm entry, the all-gather bytes ratio fp8 / bf16 that must hold, gathers per step:
# bf16, fp8 (float8 ones included), float8 ones)
BYTES = [
    # per step: 6 units gathered forward, 5 again for backward (the head stays); fp8 adds 8 gathers of the
    # blocks' norms (bf16) beside the 8 float8 ones. Measured 0.571 (the embedding and head stay bf16)
    ("zero3-dp2", ZERO3, "zero", 0.60, (11, 19, 8)),
    # per micro-batch (2 a step): bf16 27 = 9 forward (8 regions + the head) + 9 re-gathers in backward
    # (fused entries) + 9 gradient gathers (8 region exits + the embedding); fp8 19 = 9 + the head's
    # re-gather + 9 (a hook gathers the regions, whose float8 input is saved). Measured 0.556
    ("tp2-sp", TP_SP, "sp", 0.80, (54, 38, 16)),
]


@pytest.mark.parametrize("name,layout,entry,bound,calls", [pytest.param(*b, id=b[0]) for b in BYTES])
def test_float8_gathers_book_their_bytes(pools, name, layout, entry, bound, calls):
    bf16_losses, bf16 = comm_of(pools, 2, training__precision="bf16", **layout)
    on_losses, on = comm_of(pools, 2, **FP8, **layout)
    off_losses, off = comm_of(pools, 2, **FP8, **layout, training__fp8_comm=["ep"])
    ratio = on["all_gather"]["bytes"] / bf16["all_gather"]["bytes"]
    print(f"{name}: all-gather bytes fp8/bf16 {ratio:.3f}, fp8 with '{entry}' off/bf16 "
          f"{off['all_gather']['bytes'] / bf16['all_gather']['bytes']:.3f}")
    assert ratio <= bound
    assert (bf16["all_gather"]["calls"], on["all_gather"]["calls"], on["all_reduce_amax"]["calls"]) == calls
    per_call = bf16["all_gather"]["bytes"] / bf16["all_gather"]["calls"]
    assert "all_reduce_amax" not in off and "all_reduce_amax" not in bf16
    if entry == "sp":  # bf16: 27 gathers of one size; fp8's float8 ones are half of it, the others that size
        assert per_call * calls[0] == bf16["all_gather"]["bytes"]
        assert on["all_gather"]["bytes"] == per_call * (calls[1] - calls[2]) + per_call / 2 * calls[2]
        assert off["all_gather"]["bytes"] == per_call * calls[1]  # the entry off: all in bf16 again
    else:
        assert off["all_gather"]["bytes"] == bf16["all_gather"]["bytes"]
    # the float8 gathers carry what the local casts would have made: the very losses of the bf16 gathers
    assert on_losses == off_losses and on_losses != bf16_losses


def test_rowwise_gathers_stay_bf16(pools):
    """torchao's rowwise recipe casts a weight per row for one GEMM and per column for another: no one
    float8 tensor serves both, so "zero" is not used under it (docs/fp8.md)."""
    _, bf16 = comm_of(pools, 2, training__precision="bf16", **ZERO3)
    _, rowwise = comm_of(pools, 2, **FP8, **ZERO3, training__fp8_recipe="rowwise")
    assert rowwise["all_gather"] == {**bf16["all_gather"], "seconds": rowwise["all_gather"]["seconds"]}
    assert "all_reduce_amax" not in rowwise


# the 4-rank rows in the slowest tier (`make test-slow`): `make test` is at its 15-minute budget
LAYOUTS = [
    ("zero3-dp2", 2, ZERO3, ()),
    ("tp2-sp", 2, TP_SP, ()),
    ("hsdp-dp4-shard2", 4, {"parallel__dp": 4, "parallel__zero": 3, "parallel__zero_group": 2}, (pytest.mark.slowest,)),
    ("dp2-tp2-zero3-sp", 4, {**ZERO3, **TP_SP}, (pytest.mark.slowest,)),
]


@pytest.mark.isa
@pytest.mark.parametrize("name,world,overrides", [pytest.param(*c[:3], id=c[0], marks=c[3]) for c in LAYOUTS])
def test_fp8_comm_within_2_percent_of_bf16(pools, name, world, overrides):
    """8 steps within 2% of one bf16 process, with bf16's noise floor checked (tests/test_fp8.py, issue #45)."""
    ref = bf16_reference()
    run_dir = tempfile.mkdtemp(prefix="meshlm-fp8c-")
    pools(world).run(train_case, C.to_dict(make_config(**FP8, **STEPS, **overrides)), run_dir)
    got = read_metrics(run_dir)
    assert all("all_reduce_amax" in r["comm"] for r in got)  # the float8 gathers ran
    assert_near_bf16(ref, got)


@pytest.mark.parametrize("model", [{}, pytest.param({"model__preset": "moe-debug"}, marks=pytest.mark.slowest)],
                         ids=["dense", "moe-debug"])  # moe-debug: its routed experts gathered in float8 too
def test_float8_gather_checkpoints_load_into_bf16(pools, tmp_path, model):
    """A checkpoint of a run gathering float8 resumes exactly in the same run and trains on in bf16:
    the state holds fp32 masters, whatever the gathers moved."""
    from test_train import truncate_run

    every = {"checkpoint__every": 3, "checkpoint__keep": 3, "training__steps": 6, **model}
    ref = read_run(pools, make_config(**FP8, **ZERO3, **every), str(tmp_path / "a"))
    truncate_run(str(tmp_path / "a"), 3)
    for name in ("b", "c"):
        (tmp_path / name).mkdir()
        shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / name / "checkpoints")
        shutil.copy(tmp_path / "a" / "metrics.jsonl", tmp_path / name / "metrics.jsonl")
    resumed = read_run(pools, make_config(**FP8, **ZERO3, **every, checkpoint__resume="auto"), str(tmp_path / "b"))
    assert [r["loss"] for r in resumed[3:]] == [r["loss"] for r in ref[3:]]  # exact
    as_bf16 = read_run(pools, make_config(**ZERO3, **every, training__precision="bf16", checkpoint__resume="auto"),
                       str(tmp_path / "c"))
    assert [r["step"] for r in as_bf16] == list(range(1, 7)) and as_bf16[3]["loss"] != ref[3]["loss"]
    assert all(abs(a["loss"] - b["loss"]) / a["loss"] <= WITHIN for a, b in zip(ref[3:], as_bf16[3:]))


def read_run(pools, cfg, run_dir: str) -> list[dict]:
    pools(2).run(train_case, C.to_dict(cfg), run_dir)
    return read_metrics(run_dir)


def test_start_up_line_names_the_float8_collectives():
    """An fp8_comm entry the layout does not have is left out, not refused: the start-up line says which
    entries move float8 and which do not apply, after the path the GEMMs take (docs/fp8.md)."""
    from meshlm.cli import _fp8_comm
    from harness import build_layout
    moe = make_config(**FP8, model__preset="moe-debug", parallel__dp=2, parallel__ep=2, parallel__zero=3)
    assert _fp8_comm(moe, build_layout(moe, 2)) == (
        " (float8 tensorwise through torch._scaled_mm on cpu; experts emulated (no torch._scaled_grouped_mm on cpu); "
        "float8 collectives: zero, ep; not applying here: sp)")
    rowwise = make_config(**FP8, **TP_SP, training__fp8_recipe="rowwise", training__fp8_comm=["sp"])
    assert _fp8_comm(rowwise, build_layout(rowwise, 2)) == (" (float8 rowwise through torch._scaled_mm on cpu; "
                                                       "float8 collectives: none; not applying here: sp)")
    emulated = make_config(**FP8, **TP_SP, training__fp8_emulate=True, training__fp8_comm=["sp"])
    assert _fp8_comm(emulated, build_layout(emulated, 2)).startswith(" (float8 tensorwise emulated (training.fp8_emulate); ")
    assert _fp8_comm(make_config(**TP_SP), 2) == ""  # not fp8: nothing to say
