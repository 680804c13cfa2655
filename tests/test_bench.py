"""The benchmarks run (CI smoke: tiny shapes on the CPU). Their numbers go to docs/benchmarks.md,
never into assertions: this machine is shared and noisy."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def run_json(*argv) -> dict:
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gpu_bench_smoke():
    out = run_json("bench/gpu.py", "--smoke", "--json")
    r = out["results"][0]
    assert r["preset"] == "debug" and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert r["peak_mem_gib"] > 0 and r["micro_batch"] == 2


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
