"""The benchmarks run (CI smoke: tiny shapes on the CPU). Their numbers go to docs/benchmarks.md,
never into assertions: this machine is shared and noisy."""
import contextlib
import io
import json
import os
import pathlib
import runpy
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).parents[1]
pytestmark = pytest.mark.slow  # each runs a whole bench script


def run_json(script, *argv, lines: int = 1):
    """The bench's last JSON line (or its last `lines` lines, as a list), from running `python SCRIPT
    ARGV` as the interpreter would (runpy, `__name__ == "__main__"`, its own argv) but in this process:
    a fresh interpreter per bench cost seconds of imports and a forkserver of its own, and the one the
    harness started serves the bench's gloo workers the same. What a script changes in this process
    (argv, sys.path, environment, cwd, torch's thread count) is put back."""
    import spawn
    from harness import PRELOAD
    spawn.fork_context(PRELOAD)  # the session's forkserver, with everything the pools preload
    saved = sys.argv, dict(os.environ), os.getcwd(), torch.get_num_threads(), list(sys.path)
    out = io.StringIO()
    sys.argv = [str(ROOT / script), *argv]
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = saved[0]
        os.environ.clear()
        os.environ.update(saved[1])
        os.chdir(saved[2])
        torch.set_num_threads(saved[3])
        sys.path[:] = saved[4]
    assert code in (0, None), f"{script} exited {code}: {out.getvalue()[-2000:]}"
    found = [json.loads(line) for line in out.getvalue().strip().splitlines()[-lines:]]
    return found[0] if lines == 1 else found


def test_gpu_bench_smoke():
    out = run_json("bench/gpu.py", "--smoke", "--json")
    r = out["results"][0]
    assert r["preset"] == "debug" and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert r["peak_mem_gib"] > 0 and r["micro_batch"] == 2


@pytest.mark.slow  # two gloo ranks
def test_gloo_collectives_bench_smoke():
    out = run_json("bench/gloo_collectives.py", "--worlds", "2", "--calls", "20")
    rows = out["rows"]
    assert {(r["collective"], r["bytes_per_rank"]) for r in rows} == \
        {(c, b) for c in ("all_reduce", "all_gather", "reduce_scatter") for b in (512, 16384)}
    for r in rows:
        assert r["ring_ms"] > 0 and r["a2a_ms"] > 0 and r["sockets_ms"] > 0
        assert r["speedup"] == pytest.approx(r["ring_ms"] / r["sockets_ms"], rel=0.02)


@pytest.mark.slow
def test_gpu_bench_fp8_compare_smoke():
    out = run_json("bench/gpu.py", "--presets", "", "--fp8-compare", "debug", "--device", "cpu", "--seq-len", "32",
                   "--micro-batches", "2", "--warmup", "1", "--steps", "2", "--json")
    bf16, fp8, ratio = out["results"]
    assert (bf16["precision"], fp8["precision"]) == ("bf16", "fp8") and fp8["micro_batch"] == 2
    assert ratio["speedup"] > 0 and 0 < ratio["final_loss_rel"] < 0.02  # fp8 ran, and near bf16


def test_gpu_bench_takes_loss_chunks_and_flex():
    out = run_json("bench/gpu.py", "--smoke", "--json", "--loss-chunks", "4", "--attn-impl", "flex", "--document-mask")
    r = out["results"][0]
    assert (r["loss_chunks"], r["attn_impl"], r["document_mask"]) == (4, "flex", True) and r["tokens_per_s"] > 0


def test_overhead_bench_smoke():
    out = run_json("bench/overhead.py", "--json", "--preset", "debug", "--seq-len", "32", "--batch", "2",
                   "--steps", "4", "--rounds", "1", "--skip", "1")
    assert out["ratio"] > 0 and out["bare_median_s"] > 0 and out["meshlm_median_s"] > 0


def test_ckpt_bench_smoke():
    out = run_json("bench/ckpt.py", "--json", "--dim", "64", "--n-layers", "2", "--ffn-dim", "128", "--seq-len", "16",
                   "--world", "2", "--steps", "2")
    r = out["results"]
    assert r["none"]["bytes"] == 0 and r["sync"]["bytes"] > 12 * out["params"]  # every element written once
    assert r["sync"]["save_s"] > 0 and r["async"]["write_s"] > 0


SAVED_SET_TINY = ("--dim", "64", "--n-layers", "2", "--ffn-dim", "128", "--seq-len", "32", "--batch", "2",
                  "--steps", "3", "--rounds", "1", "--warmup", "1")


def _check_ab(out: dict, precision: str) -> None:
    (r,) = out["results"]
    assert out["mode"] == "ab" and r["precision"] == precision and r["ratio"] > 0
    for v in ("A", "B"):
        assert r[v]["median_s"] > 0 and r[v]["steps"] == 2 and r[v]["block"] > 0 and r[v]["step"] > r[v]["block"]
    assert r["A"]["first_loss"] == r["B"]["first_loss"]  # same model, init and batch
    assert r["B"]["block"] < r["A"]["block"]  # the minimal saved set keeps fewer bytes (issue 17)


def test_saved_set_bench_smoke():
    _check_ab(run_json("bench/saved_set.py", "--json", "--precision", "fp32", *SAVED_SET_TINY), "fp32")


def test_saved_set_bench_tp_sp_smoke():
    out = run_json("bench/saved_set.py", "--json", "--precision", "bf16", "--tp", "2", "--sp", *SAVED_SET_TINY)
    assert out["tp"] == 2 and out["sp"]
    _check_ab(out, "bf16")


def test_saved_set_ac_table_smoke():
    out = run_json("bench/saved_set.py", "--json", "--ac-table", "--precision", "bf16", *SAVED_SET_TINY)
    rows = {r["ac"]: r for r in out["results"]}
    assert out["mode"] == "ac-table" and list(rows) == ["none", "op", "selective", "full"]
    for r in rows.values():
        assert r["median_s"] > 0 and r["block"] > 0 and r["pred_block"] > 0 and r["step_ratio"] > 0
    assert rows["op"]["op_cache"] > 0 and rows["none"]["op_cache"] == 0  # op mode keeps matmul outputs in its cache
    assert rows["full"]["block"] < rows["none"]["block"]


def test_peers_bench_smoke():
    """One row per dimension: the same work on both sides (losses agree), and the summary line."""
    rows, worst = run_json("bench/peers.py", "--smoke", "--json", "--rows", "tp2+sp", "pp2 zbv", "cp2", lines=2)
    for name in ("tp2+sp", "pp2 zbv"):
        r = rows[name]
        assert r["loss_rel_diff"] < 1e-4 and len(r["meshlm_losses"]) == 3  # warm-up + 2 timed steps
        assert r["meshlm_losses"][0] != r["meshlm_losses"][-1]  # it trains
        assert r["meshlm_step_s"] > 0 and r["torch_step_s"] > 0 and r["meshlm_peak_mib"] > 0
    assert set(worst) == {"tp", "pp", "cp"}
    assert worst["tp"]["speed"] > 0 and worst["pp"]["memory"] > 0
    if worst["cp"]["speed"] is None:  # torch's ring attention handles only the CUDA SDPA kernels
        assert "_scaled_dot_product_flash_attention_for_cpu" in worst["cp"]["not_comparable"]


def test_gpu_peers_bench_smoke():
    """bench/gpu_peers.py on the CPU: meshlm's row, the plain transformers loop beside it as a ratio, and
    the float8 peer refused in one line (no fp8 on a CPU)."""
    out = run_json("bench/gpu_peers.py", "--device", "cpu", "--presets", "debug", "--seq-len", "16",
                   "--micro-batches", "2", "--warmup", "0", "--steps", "2", "--peers", "bf16,float8",
                   "--precision", "fp32", "--json")
    assert [n for n in out["skipped"] if n.startswith("peer float8:")], out["skipped"]
    mine, peer = out["results"]
    assert mine["run"].startswith("meshlm") and peer["run"] == "peer bf16"
    assert mine["micro_batch"] == peer["micro_batch"] == 2 and peer["seq_len"] == 16
    assert peer["tokens_per_s"] > 0 and peer["final_loss"] > 0
    assert peer["ratio"] == pytest.approx(mine["tokens_per_s"] / peer["tokens_per_s"])


def test_optim_bench_smoke():
    """bench/optim.py: the flat and per-tensor optimizers over the same parameter sets, tiny."""
    rows = run_json("bench/optim.py", "--json", "--layers", "1", "--experts", "4", "--dim", "16",
                    "--expert-dim", "8", "--reps", "2")
    per_expert, stacked = rows
    assert per_expert["tensors"] == 3 + 7 + 4 * 3 and stacked["tensors"] == 3 + 7 + 3  # + embed, head, norm
    assert per_expert["groups"] == stacked["groups"] == 2  # decay and no-decay
    assert all(r["list_step_ms"] > 0 and r["flat_step_ms"] > 0 for r in rows)


def test_data_bench_smoke():
    """bench/data.py end to end on 1 and 2 MB (the 2 MB row through the byte tokenizer)."""
    out = run_json("bench/data.py", "--json", "--sizes-mb", "1,2", "--bytes-from-mb", "2", "--vocab", "400")
    rows = out["rows"]
    assert [r["mb"] for r in rows] == [1, 2] and [r["tokenizer"] for r in rows] == ["bpe", "bytes"]
    assert rows[1]["tokens"] > 1_500_000 and rows[0]["documents"] > 400
    assert out["throughput_ratio"] > 0 and all(r["rss_self_mb"] > 0 for r in rows)


def test_zeropp_bench_smoke(tmp_path):
    """bench/zeropp.py end to end on the debug model: both runs, the plot, the ratios it prints."""
    plot = tmp_path / "zeropp.png"
    out = run_json("bench/zeropp.py", "--json", "--preset", "debug", "--steps", "3", "--seq-len", "16",
                   "--plot", str(plot))
    assert plot.stat().st_size > 0
    assert out["cross_group_reduction"] >= 4  # bytes: deterministic, unlike the timings
    assert set(out["variants"]["zero++"]["bytes"]) >= {"all_gather", "all_gather_hpz", "all_to_all_intra",
                                                        "all_to_all_inter"}
