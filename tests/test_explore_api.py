"""`meshlm explore`'s JSON API: the same numbers as the CLI, one-line 400s, nothing outside --runs;
and the measured CPU peak behind MFU (training.peak_tflops, best-of tries, MFU never above 100%)."""
import dataclasses
import json
import os
import re
import threading
import urllib.error
import urllib.request

import pytest
import torch
from plan_rows import emitted_rows

from meshlm.core import cards
from meshlm.core import config as C
from meshlm.cli import main
from meshlm.distributed.mesh import pick_device
from meshlm.explore.api import LAYOUT_INPUTS
from meshlm.explore.server import make_server, url_of
from meshlm.train.observe.metrics import PEAK_COMMENT, MetricsLog, device_peak

TINY = ["--model.preset", "debug", "--data.seq_len", "32", "--training.global_batch", "4", "--training.micro_batch",
        "2", "--training.steps", "6", "--training.eval_every", "3", "--training.eval_batches", "1",
        "--metrics.progress", "false", "--metrics.profile_step", "4"]  # its trace: --calibrate's per-category fit


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, runs root, the run's name): a server over a root holding one short real training run."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", "--run-dir", str(root / "tiny"), *TINY]) == 0
    server = make_server("127.0.0.1", 0, str(root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield url_of(server), root, "tiny"
    server.shutdown()
    server.server_close()


def call(base, path, body=None, headers=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(base.rstrip("/") + path, data=data, headers=headers or {},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()) if "json" in r.headers["Content-Type"] else r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def cli_json(capsys, argv):
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err.strip()


# ------------------------------------------------------------------------- explorer = estimate / plan

LAYOUTS = [  # (API body, the same as `meshlm estimate` arguments)
    ({"model.preset": "llama3-70b", "gpu": "h100", "gpus": 64, "data.seq_len": 8192, "global_batch_tokens": 2 ** 22,
      "training.precision": "bf16", "training.micro_batch": 1, "parallel.tp": 8, "parallel.sp": True, "parallel.pp": 4,
      "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2, "parallel.zero": 1, "training.ac": "selective"},
     ["--gpu", "h100", "--gpus", "64", "--model.preset", "llama3-70b", "--data.seq_len", "8192",
      "--training.global_batch", "512", "--training.micro_batch", "1", "--training.precision", "bf16",
      "--parallel.tp", "8", "--parallel.sp", "true", "--parallel.pp", "4", "--parallel.pp_schedule", "interleaved",
      "--parallel.pp_virtual", "2", "--parallel.zero", "1", "--training.ac", "selective"]),
    ({"model.preset": "llama3-8b", "gpu": "a100-40gb", "gpus": 16, "gpus_per_node": 4, "ib_gbps": 12.5,
      "data.seq_len": 4096, "global_batch_tokens": 2 ** 20, "training.micro_batch": 2, "training.precision": "bf16",
      "training.compile": True, "parallel.zero": 3, "parallel.zero_group": 4, "parallel.offload": "optimizer",
      "efficiency": 0.5},
     ["--gpu", "a100-40gb", "--gpus", "16", "--gpus-per-node", "4", "--ib-gbps", "12.5", "--efficiency", "0.5",
      "--model.preset", "llama3-8b", "--data.seq_len", "4096", "--training.global_batch", "256",
      "--training.micro_batch", "2", "--training.precision", "bf16", "--training.compile", "true",
      "--parallel.zero", "3", "--parallel.zero_group", "4", "--parallel.offload", "optimizer"]),
    ({"model.preset": "small", "model.dim": 512, "model.moe.num_experts": 8, "model.moe.top_k": 2, "gpu": "custom",
      "peak_tflops": 100, "hbm_gb": 24, "nvlink_gbps": 64, "ib_gbps": 25, "gpus": 8, "data.seq_len": 512,
      "global_batch_tokens": 512 * 64, "training.micro_batch": 1, "parallel.ep": 4, "parallel.zero": 2, "training.precision": "fp32"},
     ["--gpu", "custom", "--peak-tflops", "100", "--hbm-gb", "24", "--nvlink-gbps", "64", "--ib-gbps", "25",
      "--gpus", "8", "--model.preset", "small", "--model.dim", "512", "--model.moe.num_experts", "8",
      "--model.moe.top_k", "2", "--data.seq_len", "512", "--training.global_batch", "64", "--training.micro_batch",
      "1", "--parallel.ep", "4", "--parallel.zero", "2", "--training.precision", "fp32"]),
    ({"model.preset": "llama3-8b", "gpu": "h100", "gpus": 8, "disk_read_gbps": 3, "disk_write_gbps": 2,
      "data.seq_len": 4096, "global_batch_tokens": 2 ** 20, "training.micro_batch": 1, "training.precision": "bf16",
      "parallel.zero": 3, "parallel.offload": "nvme", "parallel.offload_buffer_mb": 256},
     ["--gpu", "h100", "--gpus", "8", "--disk-read-gbps", "3", "--disk-write-gbps", "2", "--model.preset", "llama3-8b",
      "--data.seq_len", "4096", "--training.global_batch", "256", "--training.micro_batch", "1",
      "--training.precision", "bf16", "--parallel.zero", "3", "--parallel.offload", "nvme",
      "--parallel.offload_buffer_mb", "256"]),
    ({"model.preset": "llama3-8b", "gpu": "h100", "gpus": 8, "data.seq_len": 4096, "global_batch_tokens": 2 ** 20,
      "training.micro_batch": 1, "training.precision": "bf16", "parallel.zero": 3, "optim.name": "muon"},
     ["--gpu", "h100", "--gpus", "8", "--model.preset", "llama3-8b", "--data.seq_len", "4096",
      "--training.global_batch", "256", "--training.micro_batch", "1", "--training.precision", "bf16",
      "--parallel.zero", "3", "--optim.name", "muon"]),
    # DeepSeek-V3's recipe (configs/deepseek-v3-1024xh100.toml): MLA, 256 experts over ep 64, MTP, ZB-V
    ({"model.preset": "deepseek-v3", "gpu": "h100", "gpus": 1024, "data.seq_len": 4096,
      "global_batch_tokens": 3840 * 4096, "training.micro_batch": 1, "training.precision": "bf16",
      "training.compile": True, "training.ac": "full", "parallel.pp": 4, "parallel.pp_schedule": "zbv",
      "parallel.pp_virtual": 2, "parallel.ep": 64, "parallel.zero": 1},
     ["--gpu", "h100", "--gpus", "1024", "--model.preset", "deepseek-v3", "--data.seq_len", "4096",
      "--training.global_batch", "3840", "--training.micro_batch", "1", "--training.precision", "bf16",
      "--training.compile", "true", "--training.ac", "full", "--parallel.pp", "4", "--parallel.pp_schedule", "zbv",
      "--parallel.pp_virtual", "2", "--parallel.ep", "64", "--parallel.zero", "1"]),
]


@pytest.mark.parametrize("body,argv", LAYOUTS, ids=["70b-tp8-pp4-interleaved", "8b-hsdp-offload", "moe-custom-gpu",
                                                    "8b-zero3-nvme", "8b-zero3-muon", "deepseek-v3-1024"])
def test_estimate_is_the_cli_estimate(served, capsys, body, argv):
    code, cli, err = cli_json(capsys, ["estimate", "--json", *argv])
    assert code == 0, err
    status, res = call(served[0], "/api/estimate", body)
    assert status == 200, res
    assert res["estimate"] == cli  # every number, byte for byte after the same JSON round trip
    if body.get("parallel.offload") == "nvme":  # the page gets the host, disk and I/O numbers too
        assert res["estimate"]["per_gpu"]["disk_optim"] > 0 and res["estimate"]["time"]["offload_io_s"] > 0
    assert res["derived"]["dp"] == cli["layout"]["dp"]
    if cli["layout"]["pp"] > 1:  # the simulator's timeline of this schedule, with the planner's costs
        tl = res["pipeline"]
        assert tl["p"] == cli["layout"]["pp"] and len(tl["rows"]) == tl["p"]
        kinds = [x[2] for r in tl["rows"] for x in r]  # one F and one backward per chunk (zero-bubble: I and W)
        assert kinds.count("F") == tl["p"] * tl["m"] * tl["v"]
        assert kinds.count("B") + kinds.count("I") == tl["p"] * tl["m"] * tl["v"]
        assert tl["bubble"] > 0
    cfg = _toml_config(res["toml"])  # the exported TOML is a train config asking for this layout
    assert cfg.parallel.tp == cli["layout"]["tp"] and cfg.parallel.dp == cli["layout"]["dp"]
    assert cfg.training.global_batch == cli["layout"]["global_batch"]


def _toml_config(text):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return C.load(f.name)
    finally:
        os.unlink(f.name)


def test_plan_rows_load_exactly_and_match_emit_config(served, capsys):
    argv = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "16", "--seq-len", "4096",
            "--global-batch-tokens", str(2 ** 21), "--top", "5"]
    code, ranked, err = cli_json(capsys, ["plan", *argv, "--json"])
    assert code == 0, err
    body = {"model.preset": "llama3-8b", "gpu": "h100", "gpus": 16, "data.seq_len": 4096,
            "global_batch_tokens": 2 ** 21, "training.precision": "bf16", "top": 5,
            "parallel.tp": 3}  # layout keys are the search's business: ignored, not an error
    status, res = call(served[0], "/api/plan", body)
    assert status == 200, res
    assert [r["layout"] for r in res["ranked"]] == [r["layout"] for r in ranked]
    assert [r["step_s"] for r in res["ranked"]] == [r["step_s"] for r in ranked]
    # a row's inputs are every layout key of the config (not a list the page keeps), dp and microbatches
    # left derived; the options' layout defaults are the same keys
    assert all(sorted(r["inputs"]) == LAYOUT_INPUTS for r in res["ranked"]) and "parallel.pp_layers" in LAYOUT_INPUTS
    assert all(r["inputs"]["parallel.dp"] == -1 and r["inputs"]["parallel.microbatches"] == 0 for r in res["ranked"])
    defaults = call(served[0], "/api/options")[1]["layout_defaults"]
    assert sorted(defaults) == LAYOUT_INPUTS and defaults["training.micro_batch"] == 1
    del body["top"]
    for row, emitted in zip(res["ranked"], emitted_rows(argv, 3)):
        assert row["toml"] == emitted and row["inputs"]["parallel.pp_layers"] == row["layout"]["pp_layers"]
        # clicking the row loads its inputs: the estimate is then the row's, and its export the same file
        status, est = call(served[0], "/api/estimate", dict(body, **row["inputs"]))
        assert status == 200, est
        assert est["toml"] == emitted
        assert est["estimate"]["step_s"] == row["step_s"]
        assert est["estimate"]["per_gpu"]["total"] == row["per_gpu_total"]


def test_plan_prices_the_chosen_optimizer_as_the_cli_does(served, capsys, tmp_path):
    """optim.name reaches the search: Muon's layouts are the CLI's `plan --optim muon`, none offloads the
    optimizer, the optimizer memory of a layout differs from AdamW's, and the export trains with Muon."""
    emitted = tmp_path / "muon.toml"
    argv = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--seq-len", "4096",
            "--global-batch-tokens", str(2 ** 20), "--top", "20", "--json"]
    code, muon, err = cli_json(capsys, argv + ["--optim", "muon", "--emit-config", str(emitted)])
    assert code == 0, err
    code, adamw, err = cli_json(capsys, argv)
    assert code == 0, err
    assert all(r["layout"]["offload"] == "none" for r in muon)
    body = {"model.preset": "llama3-8b", "gpu": "h100", "gpus": 8, "data.seq_len": 4096,
            "global_batch_tokens": 2 ** 20, "training.precision": "bf16", "top": 20, "optim.name": "muon"}
    status, res = call(served[0], "/api/plan", body)
    assert status == 200, res
    assert [r["layout"] for r in res["ranked"]] == [r["layout"] for r in muon]
    assert [r["per_gpu_total"] for r in res["ranked"]] == [r["per_gpu"]["total"] for r in muon]
    from meshlm.plan.cost.estimate import Options, estimate
    from meshlm.plan.hardware import get_gpu
    from meshlm.plan.spec import Shape, presets, spec_of_layout
    spec = spec_of_layout(muon[0]["layout"])
    shape, o = Shape(presets()["llama3-8b"], "llama3-8b"), Options(compiled=True)
    priced = {name: estimate(shape, dataclasses.replace(spec, optim=name), get_gpu("h100"), o)
              for name in ("muon", "adamw")}
    assert priced["muon"]["per_gpu"]["optim"] == pytest.approx(muon[0]["per_gpu"]["optim"])
    assert priced["muon"]["per_gpu"]["optim"] < priced["adamw"]["per_gpu"]["optim"]  # one moment, not two
    assert _toml_config(res["ranked"][0]["toml"]).optim.name == "muon"
    assert C.load(str(emitted)).optim.name == "muon"
    code = main(argv[:-1] + ["--optim", "muon", "--top", "1"])  # the table says what it priced
    assert code == 0 and "sequences, optimizer muon\n" in capsys.readouterr().out
    status, o = call(served[0], "/api/options")
    assert o["choices"]["optim.name"] == ["adamw", "muon"]


def test_options_lists_presets_profiles_and_the_three_examples(served):
    status, o = call(served[0], "/api/options")
    assert status == 200
    assert {"llama3-70b", "llama3-405b", "debug", "deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b"} <= set(o["presets"])
    assert o["presets"]["deepseek-v3"]["kv_lora_rank"] == 512 and o["presets"]["deepseek-v3"]["mtp_depth"] == 1
    assert "h100-sxm-80gb" in o["gpus"] and o["gpus"]["h100-sxm-80gb"]["peak_tflops"] == pytest.approx(989)
    assert [e["label"] for e in o["examples"]] == ["7B on 8 GPUs", "405B on 128 GPUs", "405B on 8 GPUs"]
    fits = []
    for ex in o["examples"]:
        status, res = call(served[0], "/api/estimate", dict(ex["inputs"], **{"training.precision": "bf16"}))
        assert status == 200, res
        fits.append(res["estimate"]["fits"])
    assert fits == [False, True, False]  # seed 004: DP alone overflows, 405B fits on 128, not on 8


# ------------------------------------------------------------------------- bad input

BAD = [  # (body, key the page shows it next to, a piece of the one-line reason)
    ({"model.preset": "llama3-8b", "gpus": 9, "parallel.tp": 3, "global_batch_tokens": 256 * 48,
      "training.micro_batch": 1}, "parallel.tp", "does not divide model.n_heads"),
    ({"gpus": 8, "parallel.tp": 3}, "gpus", "does not divide the world size 8"),
    ({"gpus": 0}, "gpus", "must be >= 1"),
    ({"gpus": "eight"}, "gpus", "expected an integer"),
    ({"gpu": "k80"}, "gpu", "unknown GPU 'k80'"),
    ({"gpu": "custom", "peak_tflops": 10}, "gpu", "also give --hbm-gb"),
    ({"global_batch_tokens": 1000}, "global_batch_tokens", "not a multiple of data.seq_len"),
    ({"gpus": 8, "parallel.zero": 1, "parallel.zero_group": 3}, "parallel.zero_group", "does not divide dp 8"),
    ({"gpus": 8, "parallel.offload": "optimizer"}, "parallel.offload", "needs a ZeRO stage"),
    ({"gpus": 8, "parallel.pp": 2, "parallel.pp_virtual": 2}, "parallel.pp_virtual", "need pp_schedule = interleaved"),
    ({"parallel.tp": True}, "parallel.tp", "expected a number"),
    ({"parallel.ep": 2}, "parallel.ep", "needs a mixture-of-experts model"),
    ({"model.preset": "gpt5"}, "model.preset", "unknown preset"),
    ({"training.precision": "int4"}, "training.precision", "is not one of"),
    ({"efficiency": 1.5}, "efficiency", "must be in (0, 1]"),
    ({"parallel.nonsense": 1}, "parallel.nonsense", "unknown input"),
    ({"model.dim": {"a": 1}}, "model.dim", "expected a value"),
    ({"gpus": ""}, "gpus", "gpus: required, got a blank value"),  # blank is never 1 GPU
    ({"gpus": None}, "gpus", "gpus: required, got a blank value"),
    ({"global_batch_tokens": " "}, "global_batch_tokens", "required, got a blank value"),
    ({"data.seq_len": ""}, "data.seq_len", "data.seq_len: required, got a blank value"),
    ({"parallel.tp": ""}, "parallel.tp", "parallel.tp: required, got a blank value"),
    ({"parallel.pp_layers": [4, "x"]}, "parallel.pp_layers", "expected a list of integers"),
    ({"gpus": 8, "parallel.pp": 2, "parallel.pp_layers": [10, 20]}, "parallel.pp_layers", "pp_layers"),
]


@pytest.mark.parametrize("body,key,reason", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_with_the_reason(served, body, key, reason):
    status, res = call(served[0], "/api/estimate", body)
    assert status == 400
    assert reason in res["error"] and "\n" not in res["error"]
    assert res["key"] == key


def test_400_messages_are_the_cli_messages(served, capsys):
    """The page shows what `meshlm estimate` prints, not a message of its own."""
    d = C.Config()  # the command line's default global batch, as tokens for the page
    for extra, tokens in (([], d.data.seq_len * d.training.global_batch), (["--training.global_batch", "48", "--training.micro_batch", "1"], 256 * 48)):
        code, _, err = cli_json(capsys, ["estimate", "--gpu", "h100", "--gpus", "9", "--model.preset", "llama3-8b",
                                         "--parallel.tp", "3", *extra])
        body = {"gpu": "h100", "gpus": 9, "model.preset": "llama3-8b", "parallel.tp": 3, "global_batch_tokens": tokens}
        if extra:
            body["training.micro_batch"] = 1
        status, res = call(served[0], "/api/estimate", body)
        assert code == 2 and status == 400 and err == f"meshlm: {res['error']}"


def test_malformed_requests(served):
    base = served[0]
    assert call(base, "/api/plan", {"gpus": "", "model.preset": "llama3-8b"}) == \
        (400, {"error": "gpus: required, got a blank value", "key": "gpus"})
    assert call(base, "/api/estimate", {"model.dim": ""})[0] == 200  # blank shape: the preset's
    assert call(base, "/api/estimate", raw=b"{not json")[0] == 400
    assert call(base, "/api/estimate", raw=b"[1, 2]") == (400, {"error": "request: expected a JSON object", "key": "request"})
    assert call(base, "/api/plan", {"gpus": 8, "global_batch_tokens": 100})[0] == 400
    assert call(base, "/api/nothing")[0] == 404
    status, _ = call(base, "/api/estimate", raw=b"{" + b" " * (1 << 17) + b"}")
    assert status == 400


# ------------------------------------------------------------------------- runs dashboard, paths

def test_runs_dashboard_reads_the_run(served):
    base, root, name = served
    status, listing = call(base, "/api/runs")
    assert status == 200 and [r["name"] for r in listing["runs"]] == [name]
    status, run = call(base, f"/api/run?name={name}")
    assert status == 200
    lines = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    assert len(run["steps"]) == sum("loss" in x for x in lines) == 6
    assert [e["step"] for e in run["evals"]] == [3, 6]
    pred, measured = run["prediction"], run["steps"][-1]["mem"]
    assert pred["world"] == 1 and pred["stage"] == "only"
    for k in ("params", "grads", "optim"):  # the planner's bytes are the trainer's bytes
        assert pred["per_gpu"][k] == measured[k], k
    assert run["pipeline"] is None
    assert "[training]" in run["config_text"]


@pytest.mark.parametrize("name", ["../tiny", "..", "%2e%2e", "%2e%2e%2ftiny", "/etc", "%2Fetc%2Fpasswd", "tiny/..",
                                  "tiny%2f..%2f..", "..%5c..", ""])
def test_no_path_outside_runs(served, name):
    status, res = call(served[0], f"/api/run?name={name}")
    assert status == 400 and res["key"] == "run", res


def test_symlink_out_of_the_root_is_refused(served, tmp_path):
    base, root, _ = served
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "config.toml").write_text("[model]\npreset = \"debug\"\n")
    link = root / "escape"
    link.symlink_to(outside)
    try:
        assert call(base, "/api/run?name=escape")[0] == 400
        assert "escape" not in [r["name"] for r in call(base, "/api/runs")[1]["runs"]]
    finally:
        link.unlink()
    assert call(base, "/api/run?name=missing")[0] == 404


def test_static_files_and_host_check(served):
    base = served[0]
    status, page = call(base, "/")
    assert status == 200 and b"meshlm explore" in page
    assert not re.search(rb'(src|href)="(https?:)?//', page)  # no CDN: every asset is served from here
    assert call(base, "/index.html") == (200, page)
    assets = re.findall(rb'(?:src|href)="(/[\w.]+)"', page)
    assert len(assets) >= 6  # the stylesheet and every script module the page loads
    for path in assets:
        assert call(base, path.decode())[0] == 200
    for path in ("/../../../etc/passwd", "/static/../api.py", "/index.html/../../server.py"):
        assert call(base, path)[0] == 404
    assert call(base, "/api/options", headers={"Host": "attacker.example:80"})[0] == 403


def test_explore_command_refuses_bad_ports(capsys):
    assert main(["explore", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


# ------------------------------------------------------------------------- the peak behind MFU

def test_peak_override_measurement_and_label():
    flops, label = device_peak(torch.device("cpu"), C.TrainingConfig(peak_tflops=0.25))
    assert flops == 0.25e12 and label == "training.peak_tflops = 0.25"
    flops, label = device_peak(torch.device("cpu"), C.TrainingConfig())
    assert flops > 1e9 and f"{torch.get_num_threads()} threads" in label and "best of 7" in label
    assert "must be >= 0" in str(pytest.raises(C.ConfigError, _resolve_negative_peak).value)


def _resolve_negative_peak():
    from harness import build_layout
    build_layout(C.load(None, [("training.peak_tflops", "-1")]), 1)


def test_mfu_over_100_percent_is_impossible(tmp_path):
    """A measured peak the run outruns was taken at a busy moment: measured again, and never below the
    run's own rate. A configured peak is the user's number and is left alone."""
    (tmp_path / "config.toml").write_text(C.to_toml(C.Config()))
    log = MetricsLog(str(tmp_path), True, 3, 0, progress=False)
    slow = 1e6  # a "measurement" far below anything a CPU does
    for step in (1, 2):
        log.write({"step": step, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 1.5 + step, "peak_flops": slow,
                   "peak_label": "cpu (measured: float32 matmul, best of 7 tries, 2 threads)"})
    log.write({"step": 3, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 3.0, "peak_flops": 1e9,
               "peak_label": "training.peak_tflops = 0.001"})
    log.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] <= 1 for r in recs[:2])
    assert recs[0]["peak_flops"] > 1e9 and "measured again at step 1" in recs[0]["peak_label"]
    assert recs[2]["mfu"] == 3.0 and recs[2]["peak_label"] == "training.peak_tflops = 0.001"
    text = (tmp_path / "config.toml").read_text()
    assert text.count(PEAK_COMMENT) == 1 and "training.peak_tflops = 0.001" in text.splitlines()[-1]
    C.load(str(tmp_path / "config.toml"))  # still a valid config


def test_trained_run_records_its_peak(served):
    """Each step's MFU is against the peak of the device that ran (training.device = auto): a CPU's is
    measured, a known GPU's is its datasheet's (cards.PEAK_FLOPS), and an unknown GPU has none
    (MFU 0, nothing noted in config.toml)."""
    _, root, name = served
    recs = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    config = (root / name / "config.toml").read_text()
    device = pick_device("auto")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        family = cards.family(gpu)
        if family is None:
            assert all(r["peak_flops"] == 0 and r["mfu"] == 0 and "unknown peak" in r["peak_label"] for r in steps)
            assert PEAK_COMMENT not in config
            return
        assert all(r["peak_label"] == f"{gpu} (datasheet bf16)" and r["peak_flops"] == cards.PEAK_FLOPS[family]
                   for r in steps)
    else:
        assert all("measured" in r["peak_label"] and r["peak_flops"] > 0 for r in steps)
    assert all(0 < r["mfu"] <= 1 for r in steps)
    assert f"{PEAK_COMMENT} " in config and steps[-1]["peak_label"] in config


def test_per_operation_model_in_the_explorer(served, capsys, tmp_path):
    """Issue 23: the page gets the per-operation breakdown, the attention kernel choice and a calibration."""
    body = {"model.preset": "llama3-1b", "gpu": "h100", "gpus": 1, "data.seq_len": 2048,
            "global_batch_tokens": 8 * 2048, "training.micro_batch": 8, "training.precision": "bf16",
            "attn_kernel": "fa2"}
    code, cli, err = cli_json(capsys, ["estimate", "--json", "--gpu", "h100", "--attn-kernel", "fa2",
                                       "--model.preset", "llama3-1b", "--data.seq_len", "2048",
                                       "--training.global_batch", "8", "--training.micro_batch", "8",
                                       "--training.precision", "bf16"])
    assert code == 0, err
    status, res = call(served[0], "/api/estimate", body)
    assert status == 200 and res["estimate"] == cli
    ops = res["estimate"]["ops"]
    assert ops["gemm_s"] > ops["attention_s"] > 0 and ops["elementwise_s"] > 0
    status, res = call(served[0], "/api/estimate", dict(body, attn_kernel="fa9"))
    assert status == 400 and "attn_kernel" in res["error"]
    # calibrate: a run under --runs (its measured machine replaces the GPU profile), never a path
    for bad in (str(tmp_path), "../tiny", "no-such-run"):
        status, res = call(served[0], "/api/estimate", dict(body, calibrate=bad))
        assert status == 400 and res["error"].startswith("calibrate: ") and res["key"] == "calibrate", (bad, res)


def test_explorer_loads_a_calibration(served, capsys):
    """Issue 23: the explorer prices a layout on the machine a run under --runs measured, with the
    numbers `meshlm estimate --calibrate RUN_DIR` gives (the short real run of the fixture)."""
    base, root, name = served
    tiny = {"model.preset": "debug", "data.seq_len": 32, "training.micro_batch": 2}
    code, cli, err = cli_json(capsys, ["estimate", "--json", "--calibrate", str(root / name), "--gpus", "2",
                                       "--model.preset", "debug", "--data.seq_len", "32", "--training.global_batch",
                                       "8", "--training.micro_batch", "2"])
    assert code == 0, err
    status, res = call(base, "/api/estimate", dict(tiny, gpus=2, global_batch_tokens=8 * 32, calibrate=name))
    assert status == 200 and res["estimate"] == cli and cli["gpu"] == "custom" and cli["step_s"] > 0
    # the run's profile.json split its step: the layout is priced per category at the fitted rates
    assert (root / name / "profile.json").exists()
    assert all(cli["ops"][k] > 0 for k in ("gemm_s", "attention_s", "elementwise_s")) and cli["time"]["overhead_s"] >= 0
    status, plan = call(base, "/api/plan", dict(tiny, gpus=2, global_batch_tokens=8 * 32, calibrate=name))
    assert status == 200 and plan["ranked"] and all(r["step_s"] > 0 for r in plan["ranked"])
    page = call(base, "/app.js")[1].decode()
    assert '"/api/runs"' in page and 'input("calibrate")' in page
