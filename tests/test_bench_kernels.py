"""bench/kernels.py: its CPU plumbing run (--device cpu --tiny) writes every section with positive
rates, its predictions are the planner's own (recomputed here from meshlm.plan.cost.ops), an unavailable
backend is skipped with its reason, and its shape lists are the validation rows' shapes."""
import importlib.util
import json
import pathlib
import sys

import pytest

from meshlm.plan.cost import ops
from meshlm.plan.cost.estimate import Options
from meshlm.plan.hardware import get_gpu
from test_plan_validation import _megatron_shape

ROOT = pathlib.Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
K = sys.modules["bench_kernels"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(K)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "k.json"
    returned = K.main(["--device", "cpu", "--tiny", "--backends", "math,efficient", "--warmup", "1", "--reps", "3",
                       "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["attention"] == json.loads(json.dumps(returned["attention"]))
    return written


def test_tiny_run_has_every_section_with_positive_rates(tiny):
    assert tiny["env"]["torch"] and tiny["env"]["device"] == "cpu" and tiny["gpu_profile"]["name"] == "H100-SXM-80GB"
    att = tiny["attention"]
    assert {r["group"] for r in att} == {"debug", "debug-gqa", "fa3-fig5"} and {r["backend"] for r in att} == {"math"}
    assert any(r["kv_heads"] < r["heads"] for r in att) and any(r["mask"] == "dense" for r in att)
    for r in att:
        assert r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0
        assert r["fwdbwd_s"] == pytest.approx(r["fwd_s"] + r["bwd_s"])
    assert {r["role"] for r in tiny["gemm"]} == {"fwd", "dgrad", "wgrad"}
    assert all(r["tflops"] > 0 and r["pred_tflops"] > 0 and r["ratio"] > 0 for r in tiny["gemm"])
    assert [r["op"] for r in tiny["elementwise"]] == list(K.ELEMENTWISE)
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in tiny["elementwise"])


def test_predictions_are_the_planners(tiny):
    gpu = get_gpu("h100")
    peak = gpu.peak("fp32")  # the tiny shapes run in fp32 on the CPU
    r = next(r for r in tiny["attention"] if r["group"] == "fa3-fig5" and r["causal"] and r["seq"] == 32)
    kernel = Options().attn_kernel  # math (the CPU run) is priced as the planner's default kernel
    fwd = ops.attention_fraction(kernel, r["head_dim"], 32, True, gpu.arch) * peak
    bwd = fwd * ops.BWD_RATIO[kernel]
    assert r["planner_kernel"] == kernel and r["pred_fwd_tflops"] == pytest.approx(fwd / 1e12)
    assert r["pred_bwd_tflops"] == pytest.approx(bwd / 1e12)
    assert r["pred_fwdbwd_tflops"] == pytest.approx(3.5 * fwd * bwd / (bwd + 2.5 * fwd) / 1e12)
    assert r["ratio_fwd"] == pytest.approx(r["fwd_tflops"] / r["pred_fwd_tflops"])
    assert r["flops_fwd"] == 4 * r["batch"] * r["heads"] * 32 ** 2 * r["head_dim"] / 2  # causal: half
    dense = next(r for r in tiny["attention"] if r["mask"] == "dense")
    assert dense["pred_fwd_tflops"] == pytest.approx(peak * ops.DENSE_MASK_FRACTION / 1e12)
    g = next(r for r in tiny["gemm"] if r["weights"] == "w2" and r["role"] == "wgrad" and r["group"] == "debug")
    m, n, k = g["mnk"]
    assert (m, n, k) == (128, 64, 64)  # the planner's gemm(k, n, m) for w2's weight gradient at 64 tokens
    assert g["pred_tflops"] == pytest.approx(2 * m * n * k / ops.gemm_seconds(m, n, k, gpu, 4, peak) / 1e12)
    assert g["ratio"] == pytest.approx(g["tflops"] / g["pred_tflops"])
    fp8 = K.predicted_gemm(g, gpu, fp8=True)[0]  # a block GEMM under fp8: peak × fp8_gemm_speedup
    assert fp8 == pytest.approx(2 * m * n * k / ops.gemm_seconds(m, n, k, gpu, 4, peak * gpu.fp8_gemm_speedup))
    e = next(r for r in tiny["elementwise"] if r["op"] == "rmsnorm_fwd_bwd")
    eager = ops._eager(4)
    nbytes = (eager["norm_f"][0] + eager["norm_b"][0]) * e["tokens"] * e["width"]
    data, launch = ops._parts(nbytes / (gpu.hbm_bw * gpu.hbm_eff), 20, gpu.launch_eager_s, cpu=False)
    assert e["bytes"] == nbytes and e["pred_ms"] == pytest.approx((data + launch) * 1e3)
    assert e["ratio"] == pytest.approx(e["pred_ms"] / e["ms"])


def test_an_unavailable_backend_is_skipped_with_its_reason(tiny):
    skipped = [s for s in tiny["skipped"] if s["case"].startswith("efficient ")]
    assert len(skipped) == len(K.attention_cases(False, True, K.TINY_MODELS))  # every case, none silently
    assert all("RuntimeError" in s["reason"] for s in skipped)
    assert [s["reason"] for s in tiny["skipped"] if s["case"] == "fp8"] == [
        "needs CUDA compute capability >= 8.9 (this device: cpu)"]
    assert not any("fp8_tflops" in r for r in tiny["gemm"])


def test_shapes_are_the_validation_rows():
    assert K.MEGATRON_1_7B == _megatron_shape(24, 2304, 24).args
    assert K.MEGATRON_18_4B == _megatron_shape(48, 6144, 40).args
    tokens = {m.name: m.tokens for m in K.MODELS}
    assert tokens == {"llama3-8b": 16384, "llama3-1b": 32768, "llama3-405b-tp8": 8192, "megatron-1.7b": 32768,
                      "megatron-18.4b-tp8": 16384}
    shapes = {(c["group"], c["weights"], c["role"]): c["mnk"] for c in K.gemm_cases()}
    assert shapes["llama3-8b", "w1,w3", "fwd"] == (16384, 14336, 4096)
    assert shapes["llama3-405b-tp8", "w2", "dgrad"] == (8192, 6656, 16384)  # ffn 53248 / tp 8
    assert shapes["llama3-405b-tp8", "wk,wv", "wgrad"] == (16384, 128, 8192)  # 8 kv heads / tp 8: one
    att = K.attention_cases(quick=False, tiny=False)
    fig = [c for c in att if c["group"] == "fa3-fig5"]
    assert all(c["batch"] * c["seq"] == 16384 and c["heads"] * c["head_dim"] == 2048 for c in fig if c["seq"] <= 16384)
    assert {c["seq"] for c in fig if c["seq"] > 16384} == {32768, 65536, 131072}
    assert all(c["causal"] and c["batch"] == 1 for c in fig if c["seq"] > 16384)
    rows = {c["group"]: c for c in att if c["group"] != "fa3-fig5" and c["mask"] == "none"}
    assert (rows["llama3-8b"]["batch"], rows["llama3-8b"]["heads"], rows["llama3-8b"]["kv_heads"]) == (2, 32, 8)
    assert (rows["llama3-405b-tp8"]["heads"], rows["llama3-405b-tp8"]["kv_heads"]) == (16, 1)


def test_bad_input_is_one_line_before_any_work(capsys):
    for argv, words in ((["--device", "cpu"], "--tiny"), (["--device", "cpu", "--tiny", "--backends", "fa9"], "fa9"),
                        (["--device", "cpu", "--tiny", "--sections", "gemms"], "gemms")):
        with pytest.raises(SystemExit) as e:
            K.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("bench/kernels.py: ") and words in err and "\n" not in err


def test_cp_kernel_plumbing_agrees_and_prices_with_the_planner(tmp_path):
    """bench/cp_kernel.py on a CPU (--tiny): both kernels of an all-gather CP rank give the same
    output (flex under the rows' BlockMask, SDPA under the dense rows mask), and each row carries the
    planner's seconds for its mask kind (flex; rows, or dense with documents)."""
    spec = importlib.util.spec_from_file_location("bench_cp_kernel", ROOT / "bench" / "cp_kernel.py")
    cpk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpk)
    out = cpk.main(["--device", "cpu", "--tiny", "--warmup", "1", "--reps", "3", "--out", str(tmp_path / "c.json")])
    rows = json.loads((tmp_path / "c.json").read_text())["cp_attention"]
    assert [(r["kernel"], r["cp"], r["doc_tokens"]) for r in rows] == [
        (k, c, d) for _, _, _, c, d in cpk.TINY for k in cpk.KERNELS] and rows == out["cp_attention"]
    gpu = get_gpu("h100")
    for r, case in zip(rows, [c for c in cpk.TINY for _ in cpk.KERNELS]):
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0
        pf, pb = cpk.predicted(case, r["kernel"], gpu, "fp32")
        assert r["pred_fwd_ms"] == pytest.approx(pf * 1e3) and r["pred_bwd_ms"] == pytest.approx(pb * 1e3)
        if r["kernel"] == "sdpa":
            assert r["max_diff"] < 1e-5
    flex, sdpa = (cpk.predicted(cpk.CASES[-1], k, gpu, "bf16") for k in cpk.KERNELS)  # 131K, cp 16, 8K docs
    assert 10 * sum(flex) < sum(sdpa)  # flex skips the blocks outside the documents; the dense mask computes all
    with pytest.raises(SystemExit):
        cpk.main(["--device", "cpu"])  # only --tiny runs on a CPU
