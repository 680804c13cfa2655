"""Bad input is refused before any worker starts, with one line naming the key; nothing is written."""
import json
import os

import pytest

from meshlm.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


BAD = [
    (["--model.nonsense", "3"], "model.nonsense: unknown config key"),
    (["--training.global_batch", "10", "--training.micro_batch", "4"], "training.global_batch"),
    (["--nproc", "4", "--parallel.dp", "3"], "--nproc"),
    (["--nproc", "3", "--parallel.tp", "2"], "does not divide the world size 3"),
    (["--data.path", "/nonexistent/data"], "data.path"),
    (["--data.tokenizer", "/nonexistent/tok.json"], "data.tokenizer"),
    (["--model.n_heads", "4", "--model.n_kv_heads", "3"], "model.n_kv_heads"),
    (["--training.precision", "fp8", "--training.fp8_recipe", "delayed"], "training.fp8_recipe"),
    (["--parallel.zero", "5"], "parallel.zero"),
    (["--training.steps", "many"], "training.steps: expected a number"),
    (["--checkpoint.on_error", "retry"], "checkpoint.on_error: 'retry' is not one of stop, continue"),
    (["--checkpoint.on_signal", "SIGTERM,SIGKILL"], "checkpoint.on_signal: 'SIGKILL' is not a signal"),
    (["--parallel.bucket_mb", "0"], "parallel.bucket_mb: must be > 0, got 0.0"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, needle):
    run_dir = tmp_path / "run"
    code, err = run(capsys, "train", "--run-dir", str(run_dir), "--model.preset", "debug", *argv)
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert needle in err
    assert not run_dir.exists()


def test_unreadable_tokenizer_file(tmp_path, capsys):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{not json")
    code, err = run(capsys, "train", "--run-dir", str(tmp_path / "r"), f"--data.tokenizer={tok}")
    assert code == 2 and err.startswith("meshlm: data.tokenizer: cannot read tokenizer")


def test_missing_config_file_and_bad_toml(tmp_path, capsys):
    code, err = run(capsys, "train", "--config", str(tmp_path / "nope.toml"))
    assert code == 2 and "--config: file not found" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = = 3\n")
    code, err = run(capsys, "train", "--config", str(bad))
    assert code == 2 and "not valid TOML" in err and len(err.splitlines()) == 1


def test_bad_input_keeps_existing_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.toml").write_text("# old\n")
    code, _ = run(capsys, "train", "--run-dir", str(run_dir), "--training.micro_batch", "7")
    assert code == 2
    assert (run_dir / "config.toml").read_text() == "# old\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_config_file_and_overrides(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\npreset = "debug"\n[training]\nsteps = 2\nglobal_batch = 4\nmicro_batch = 2\n'
                   'eval_every = 0\n[data]\nseq_len = 16\n[metrics]\nprogress = false\n')
    run_dir = tmp_path / "run"
    code, err = run(capsys, "train", "--config", str(cfg), "--run-dir", str(run_dir), "--training.steps=3")
    assert code == 0, err
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2, 3]
    resolved = (run_dir / "config.toml").read_text()
    assert "steps = 3" in resolved and 'preset = "debug"' in resolved
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu", "step_s", "mem"):
        assert key in recs[-1]
    assert set(recs[-1]["mem"]) >= {"params", "grads", "optim", "peak"}
    assert recs[-1]["tokens"] == 3 * 4 * 16


def test_one_process_resolves_the_layout_once(tmp_path, capsys, monkeypatch):
    import meshlm.plan.search.auto as auto
    calls, real = [], auto.build_layout
    monkeypatch.setattr(auto, "build_layout", lambda cfg, world: calls.append(world) or real(cfg, world))
    code, err = run(capsys, "train", "--run-dir", str(tmp_path / "run"), "--model.preset", "debug",
                    "--training.steps", "1", "--training.global_batch", "2", "--training.micro_batch", "2",
                    "--data.seq_len", "16", "--training.eval_every", "0", "--metrics.progress", "false")
    assert code == 0, err
    assert calls == [1]  # the command line's; the trainer takes that layout


def test_prepare_and_report(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello world, this is meshlm. " * 400)
    out = tmp_path / "data"
    code, err = run(capsys, "prepare", "--input", str(src), "--tokenizer", "bytes", "--out", str(out))
    assert code == 0, err
    assert json.load(open(out / "index.json"))["dtype"] == "uint16"
    run_dir = tmp_path / "run"
    code, err = run(capsys, "train", "--run-dir", str(run_dir), "--model.preset", "debug", "--data.path", str(out),
                    "--data.seq_len", "16", "--training.steps", "4", "--training.global_batch", "4",
                    "--training.micro_batch", "4", "--training.eval_every", "2", "--metrics.progress", "false")
    assert code == 0, err
    code, err = run(capsys, "report", str(run_dir))
    assert code == 0
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000
    code, err = run(capsys, "report", str(tmp_path / "missing"))
    assert code == 2 and "no metrics.jsonl" in err


def test_readme_config_block_is_a_valid_config(tmp_path):
    """The README's example config lists every section and loads as it is (keeps the docs honest)."""
    import pathlib

    from meshlm.core import config as C
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("```toml")[1].split("```")[0]
    path = tmp_path / "readme.toml"
    path.write_text(block)
    cfg = C.load(str(path))
    assert set(C.to_dict(cfg)) == {"model", "data", "parallel", "training", "optim", "checkpoint", "metrics"}
    for section, values in C.to_dict(cfg).items():
        header = f"[{section}]"
        assert header in block, header
        for key, value in values.items():
            if not isinstance(value, dict) and section != "model":
                assert f"\n{key} = " in block, f"{section}.{key} missing from the README"


def test_a_broken_command_module_fails_loudly(monkeypatch):
    """A command module that cannot be imported is an error, not a command that silently vanishes from the
    CLI; only torch missing (an install for `meshlm plan` / `estimate` alone) leaves its commands out."""
    import sys

    from meshlm.cli import build_parser

    class Broken:
        def __getattr__(self, name):
            raise ImportError("cannot import name 'gone' from 'meshlm.plan.nowhere'", name="meshlm.plan.nowhere")

    monkeypatch.setitem(sys.modules, "meshlm.core.schedule.command", None)  # import of it raises ImportError
    with pytest.raises(ImportError):
        build_parser()
    monkeypatch.setitem(sys.modules, "meshlm.core.schedule.command", Broken())
    with pytest.raises(ImportError, match="meshlm.plan.nowhere"):
        build_parser()
    real = __import__

    def no_torch(name, *args, **kw):
        if name == "meshlm.core.schedule.command":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, *args, **kw)

    monkeypatch.delitem(sys.modules, "meshlm.core.schedule.command")
    monkeypatch.setattr("builtins.__import__", no_torch)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert "schedule" not in commands and "plan" in commands and "train" in commands
