"""Hugging Face Llama in and out: a tiny random `LlamaForCausalLM` (GQA, tied and untied, rope theta
≠ 10000) gives the same logits after `--from-hf`; an exported checkpoint loads with
`from_pretrained`; `model.init_from = hf:` trains from it in any layout; greedy generation matches
transformers' token for token; bad input is one line and writes nothing."""
import json
import os
import shutil

import pytest
import torch

from harness import make_config, read_metrics, run_layout, run_local
from meshlm.cli import main

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject [dev])

SHAPES = {"untied": dict(tie_word_embeddings=False, rope_theta=50000.0),
          "tied": dict(tie_word_embeddings=True, rope_theta=20000.0)}


def make_hf(path, tie_word_embeddings: bool, rope_theta: float, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=rope_theta,
                                   tie_word_embeddings=tie_word_embeddings, max_position_embeddings=128,
                                   rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: logits far apart, a real test of argmax
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {k: (str(root / k), make_hf(root / k, **v)) for k, v in SHAPES.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tokens(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(SHAPES))
def test_from_hf_gives_transformers_logits(hf_models, tmp_path, kind):
    from meshlm.train.convert import load_model
    hf_dir, hf = hf_models[kind]
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")]) == 0
    model, cfg, meta, _ = load_model(str(tmp_path / "ck"))
    assert model.args.n_kv_heads == 2 and model.args.rope_theta == SHAPES[kind]["rope_theta"]
    assert model.args.tie_embeddings == SHAPES[kind]["tie_word_embeddings"]
    x = tokens()
    with torch.no_grad():
        assert rel(model(x), hf(x).logits) <= 1e-5
        # the permutation matters: without it (or with theta 10000) the logits differ
        model.rope_cache = None
        model.args = type(model.args)(**{**model.args.to_dict(), "rope_theta": 10000.0})
        assert rel(model(x), hf(x).logits) > 1e-3


@pytest.mark.parametrize("tied", [False, True])
def test_trained_checkpoint_exports_to_transformers(tmp_path, tied):
    from meshlm.train.convert import load_model
    cfg = make_config(training__steps=2, checkpoint__every=2, model__tie_embeddings=tied,
                      model__n_kv_heads=2, model__rope_theta=30000.0)
    run_local(cfg, str(tmp_path / "run"))
    out = tmp_path / "hf"
    # a run directory means its newest checkpoint; a small shard limit forces an index
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(out), "--dtype", "fp32",
                 "--max-shard-gb", "0.0001"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) != tied
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    model = load_model(str(tmp_path / "run"))[0]
    x = tokens()
    with torch.no_grad():
        assert rel(hf(x).logits, model(x)) <= 1e-5
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "bf16")]) == 0
    hf16 = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert next(hf16.parameters()).dtype == torch.bfloat16
    assert (tmp_path / "bf16" / "model.safetensors").is_file()


def test_tokenizer_travels_with_the_weights(hf_models, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf_dir = str(tmp_path / "with_tok")
    shutil.copytree(hf_models["untied"][0], hf_dir)
    tok = Tokenizer(models.WordLevel({chr(97 + i): i for i in range(26)} | {"[UNK]": 26}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")]) == 0
    assert (tmp_path / "ck" / "tokenizer.json").is_file()
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_text() == (tmp_path / "ck" / "tokenizer.json").read_text()


def batch_loss(logits_of, cfg, step: int = 1) -> float:
    """The mean loss of `logits_of` on step `step`'s global batch (what a run logs for that step)."""
    from meshlm.data import GlobalBatchSampler, TokenShards, default_data_dir
    data = TokenShards(default_data_dir(), "train")
    s = GlobalBatchSampler.for_shards(data, cfg.data.seq_len, cfg.training.global_batch, cfg.training.seed)
    for _ in range(step):
        x, y, _ = s.next_batch(data, 0, 1)
    with torch.no_grad():
        logits = logits_of(x)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def first_batch_loss(hf, cfg) -> float:
    """transformers' mean loss on step 1's global batch (what a run from these weights logs first)."""
    return batch_loss(lambda x: hf(x).logits, cfg)


def test_init_from_hf_same_first_loss_in_every_layout(hf_models, pools):
    hf_dir, hf = hf_models["untied"]
    cfg = make_config(model__init_from=f"hf:{hf_dir}", training__steps=2)
    ref = run_local(cfg)
    assert abs(ref[0]["loss"] - first_batch_loss(hf, cfg)) <= 1e-5 * ref[0]["loss"]
    for layout in ({"parallel__dp": 2, "parallel__zero": 3, "training__micro_batch": 1},
                   {"parallel__tp": 2, "parallel__sp": True}):
        got = run_layout(pools, make_config(model__init_from=f"hf:{hf_dir}", training__steps=2, **layout), 2)
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a["step"], a["loss"], b["loss"])


def test_sharded_checkpoint_loads_whole_and_exports(tmp_path, pools):
    """A checkpoint written in pieces (ZeRO-3 flat ranges over 2 ranks) is read whole into one process
    by generate/export: the loaded weights give the loss the run logged for the next step."""
    from harness import train_case
    from meshlm.core import config as C
    from meshlm.train.convert import load_model
    cfg = make_config(training__steps=2, checkpoint__every=1, checkpoint__keep=5, metrics__every=1,
                      parallel__dp=2, parallel__zero=3, training__micro_batch=1)
    run = str(tmp_path / "run")
    pools(2).run(train_case, C.to_dict(cfg), run)
    logged = {r["step"]: r["loss"] for r in read_metrics(run)}
    ck = os.path.join(run, "checkpoints", "step_00000001")
    model = load_model(ck)[0]
    loss = batch_loss(model, cfg, step=2)
    assert abs(loss - logged[2]) <= 1e-5 * logged[2], (loss, logged)
    assert main(["convert", "--to-hf", ck, "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = tokens()
    with torch.no_grad():
        assert rel(hf(x).logits, model(x)) <= 1e-5


class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_checkpoint_index_is_never_unpickled_unsafely(hf_models, tmp_path, capsys):
    """DCP's `.metadata` is a pickle: export and generate read it through the safe loader, so a
    crafted one is refused with one line and its payload never runs."""
    import pickle
    ck = tmp_path / "ck"
    assert main(["convert", "--from-hf", hf_models["untied"][0], "--out", str(ck)]) == 0
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    err = _one_line_error(capsys, ["convert", "--to-hf", str(ck), "--out", str(tmp_path / "out")])
    assert ".metadata" in err
    err = _one_line_error(capsys, ["generate", str(ck), "--prompt", "x", "--max-new-tokens", "2"])
    assert ".metadata" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def assert_greedy_matches(hf_dir: str, hf, ck: str, n: int) -> None:
    """`convert --from-hf` then meshlm's greedy `generate` (KV cache) gives transformers' n tokens."""
    from meshlm.train.convert import load_model
    from meshlm.generate import generate
    assert main(["convert", "--from-hf", hf_dir, "--out", ck]) == 0
    model = load_model(ck)[0]
    prompt = [5, 17, 99, 3, 250, 64, 7]
    ours = generate(model, prompt, n, temperature=0.0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    assert len(set(ours)) > 1  # not a degenerate repeat of one token


def test_greedy_generate_matches_transformers(hf_models, tmp_path):
    hf_dir, hf = hf_models["tied"]
    assert_greedy_matches(hf_dir, hf, str(tmp_path / "ck"), 20)


def test_kv_cache_equals_full_recompute(hf_models, tmp_path):
    """Prefill + one-token steps through the cache give the logits of running the whole sequence."""
    from meshlm.train.convert import load_model
    from meshlm.model.kv_cache import KVCache
    hf_dir, _ = hf_models["untied"]
    main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")])
    model = load_model(str(tmp_path / "ck"))[0]
    x = tokens(16)[:1]
    cache = KVCache(model.args, 1, 16, "cpu")
    with torch.no_grad():
        full = model(x)
        parts = [model(x[:, :5], cache=cache), model(x[:, 5:9], cache=cache)]
        parts += [model(x[:, i:i + 1], cache=cache) for i in range(9, 16)]
    assert rel(torch.cat(parts, dim=1), full) <= 1e-5


def test_generate_cli_prints_the_continuation(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models["untied"]
    main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")])
    capsys.readouterr()
    args = ["generate", str(tmp_path / "ck"), "--prompt", "def f(", "--max-new-tokens", "8", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0 and capsys.readouterr().out == first  # seeded sampling is reproducible
    assert not first.startswith("def f(")
    assert main(args[:-1] + ["4"]) == 0  # another seed: (almost surely) another sample
    assert capsys.readouterr().out != first


def edited_copy(hf_dir: str, dst, **changes) -> str:
    """A copy of HF directory `hf_dir` at `dst` with some config.json keys changed."""
    shutil.copytree(hf_dir, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    with open(path, "w") as f:
        json.dump(c, f)
    return str(dst)


def _one_line_error(capsys, argv, code=2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_line_and_writes_nothing(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models["untied"]
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json" in _one_line_error(capsys, ["convert", "--from-hf", str(empty), "--out", str(out)])
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), no_weights)
    assert "safetensors" in _one_line_error(capsys, ["convert", "--from-hf", str(no_weights), "--out", str(out)])

    def edited(name, **changes):
        return edited_copy(hf_dir, tmp_path / name, **changes)
    gpt2 = edited("gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert "GPT2LMHeadModel" in _one_line_error(capsys, ["convert", "--from-hf", gpt2, "--out", str(out)])
    wrong = edited("wrong", intermediate_size=128)
    err = _one_line_error(capsys, ["convert", "--from-hf", wrong, "--out", str(out)])
    assert "mlp" in err and "shape" in err and "safetensors" in err
    scaled = edited("scaled", rope_scaling={"rope_type": "dynamic", "factor": 8.0})
    assert "rope_scaling" in _one_line_error(capsys, ["convert", "--from-hf", scaled, "--out", str(out)])
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    # an existing --out is never overwritten
    out.mkdir()
    (out / "keep").write_text("x")
    assert "exists" in _one_line_error(capsys, ["convert", "--from-hf", hf_dir, "--out", str(out)])
    assert (out / "keep").read_text() == "x"
    # the same checks guard training, before any worker starts or the run directory exists
    run = tmp_path / "run"
    for d in (wrong, str(empty)):
        err = _one_line_error(capsys, ["train", "--model.init_from", f"hf:{d}", "--run-dir", str(run)])
        assert err.startswith("meshlm: model.init_from:")
    assert "dim" in _one_line_error(capsys, ["train", "--model.init_from", f"hf:{hf_dir}", "--model.dim", "32",
                                             "--run-dir", str(run)])
    assert not run.exists()
    # a weights-only checkpoint has no optimizer state to resume: pointed to model.init_from
    ck = tmp_path / "ck"
    assert main(["convert", "--from-hf", hf_dir, "--out", str(ck)]) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, ["train", "--checkpoint.resume", str(ck), "--run-dir", str(run)])
    assert "weights only" in err and "init_from" in err
    assert not run.exists()
    assert "--to-hf" in _one_line_error(capsys, ["convert", "--out", str(out)])
