"""Issue #21 in the layouts (docs/architecture.md, invariant 1): document masking and data mixtures give one process's
losses in dp, ZeRO-3, tp+sp and pp; a mixture resumes across layouts with its data position; a run over
a 1-trillion-token index starts as fast and as small as one over a tiny index."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from harness import assert_same_losses, make_config, read_metrics, reference, run_layout, run_local, train_case
from meshlm.core import config as C
from meshlm.data import prepare, stdlib_files


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two prepared sets of short documents (3-60 bytes: a 32-token window holds several boundaries):
    `docs` from JSON Lines, `code` from other stdlib lines as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("corpora")
    files = stdlib_files()
    lines = [ln.strip() for f in files[:3] for ln in open(f, encoding="utf-8") if ln.strip()][:6000]
    rng = np.random.default_rng(0)
    docs, i = [], 0
    while i < len(lines):
        k = int(rng.integers(1, 3))
        docs.append(" ".join(lines[i:i + k])[:60])
        i += k
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    other = [ln.strip()[:40] for f in files[3:6] for ln in open(f, encoding="utf-8") if ln.strip()][:4000]
    pq.write_table(pa.table({"text": other}), root / "code.parquet")
    out = {}
    for name, src in (("docs", root / "docs.jsonl"), ("code", root / "code.parquet")):
        prepare([str(src)], "bytes", str(root / name), val_fraction=0.05)
        out[name] = str(root / name)
    return out


def _cfg(corpora, overrides: dict) -> dict:
    out = {}
    for k, v in overrides.items():
        if isinstance(v, str) and v.startswith("$"):
            v = corpora[v[1:]]
        elif k == "data__mix":
            v = [[corpora[p[1:]], w] for p, w in v]
        out[k] = v
    return out


MASK = {"data__path": "$docs", "data__document_mask": True, "model__attn_impl": "sdpa"}
FLEX = {**MASK, "model__attn_impl": "flex"}  # compared with the SDPA-mask reference
MIX = {"data__mix": [("$docs", 0.7), ("$code", 0.3)]}
CASES = [
    ("mask-dp2", 2, {**MASK, "parallel__dp": 2}),
    ("mask-zero3-dp2-accum", 2, {**MASK, "parallel__dp": 2, "parallel__zero": 3, "training__micro_batch": 1}),
    ("mask-tp2-sp", 2, {**MASK, "parallel__tp": 2, "parallel__sp": True}),
    ("mask-pp2-1f1b", 2, {**MASK, "parallel__pp": 2}),
    ("mask-tp2-pp2-ac-selective", 4, {**MASK, "parallel__tp": 2, "parallel__pp": 2, "training__ac": "selective"}),
    ("flex-one-process", 1, FLEX),
    ("flex-dp2-zero2", 2, {**FLEX, "parallel__dp": 2, "parallel__zero": 2}),
    ("flex-tp2-sp", 2, {**FLEX, "parallel__tp": 2, "parallel__sp": True}),
    ("flex-pp2-zbh1-ac-selective", 2, {**FLEX, "parallel__pp": 2, "parallel__pp_schedule": "zb-h1",
                                       "training__ac": "selective"}),
    ("mask-cp2-allgather", 2, {**MASK, "parallel__cp": 2, "parallel__cp_impl": "allgather"}),
    ("mask-cp2-allgather-gqa-ac-full", 2, {**MASK, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                           "model__n_kv_heads": 2, "training__ac": "full"}),
    ("mask-cp2-allgather-tp2-sp", 4, {**MASK, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                      "parallel__tp": 2, "parallel__sp": True}),
    ("mask-pp2-cp2-allgather", 4, {**MASK, "parallel__pp": 2, "parallel__cp": 2, "parallel__cp_impl": "allgather"}),
    ("flex-cp2-allgather-gqa-ac-selective", 2, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                                "model__n_kv_heads": 2, "training__ac": "selective"}),
    ("flex-cp2-allgather-tp2-sp", 4, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                      "parallel__tp": 2, "parallel__sp": True}),
    ("mask-cp2-ulysses", 2, {**MASK, "parallel__cp": 2, "parallel__cp_impl": "ulysses"}),
    ("flex-cp2-ulysses-gqa-ac-selective", 2, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "ulysses",
                                              "model__n_kv_heads": 2, "training__ac": "selective"}),
    ("flex-cp2-ulysses-tp2-sp", 4, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "ulysses",
                                    "parallel__tp": 2, "parallel__sp": True}),
    ("mix-dp2", 2, {**MIX, "parallel__dp": 2}),
    ("mix-zero3-dp4", 4, {**MIX, "parallel__dp": 4, "parallel__zero": 3}),
    ("mix-tp2-pp2", 4, {**MIX, "parallel__tp": 2, "parallel__pp": 2}),
    ("mix-mask-dp2-tp2", 4, {**MIX, **MASK, "data__path": "", "parallel__dp": 2, "parallel__tp": 2}),
]
def _reference(corpora, overrides: dict) -> list:
    """One process with SDPA's dense mask (flex rows are compared with it too)."""
    one = {k: v for k, v in overrides.items() if not k.startswith("parallel__")}
    if one.get("model__attn_impl") == "flex":
        one["model__attn_impl"] = "sdpa"
    return reference(**one)


@pytest.mark.parametrize("name,world,overrides", CASES, ids=[c[0] for c in CASES])
def test_data_layout_matches_one_process(pools, corpora, name, world, overrides):
    o = _cfg(corpora, overrides)
    ref = _reference(corpora, o)
    got = run_local(make_config(**o)) if world == 1 else run_layout(pools, make_config(**o), world)
    assert_same_losses(ref, got, 1e-5)
    if "parallel__cp" in o:  # the mask matters on this data: the unmasked losses differ
        plain = reference(**{k: v for k, v in o.items() if k in ("data__path", "model__n_kv_heads")})
        assert abs(plain[0]["loss"] - got[0]["loss"]) > 1e-4, (plain[0]["loss"], got[0]["loss"])
    if "data__mix" in o:  # tokens drawn per source, logged every step
        n = len(ref)
        assert ref[-1]["data"] == {os.path.normpath(corpora["docs"]): n * 6 * 32,   # 0.7·8 -> 6 sequences
                                   os.path.normpath(corpora["code"]): n * 2 * 32}


@pytest.mark.slow
def test_document_mask_changes_the_loss_and_isolates_documents(corpora):
    """Masking is not a no-op on this corpus, and a masked token sees only its own document: the logits
    of document B inside [A B] equal B's logits alone (RoPE is relative, positions need no restart)."""
    plain = run_local(make_config(data__path=corpora["docs"], training__steps=2))
    masked = run_local(make_config(data__path=corpora["docs"], data__document_mask=True, training__steps=2))
    assert abs(plain[0]["loss"] - masked[0]["loss"]) > 1e-4
    from meshlm.core.config.model import model_args
    from meshlm.model import Llama
    torch.manual_seed(0)
    model = Llama(model_args(make_config())).eval()
    a, b = torch.randint(0, 256, (1, 11)), torch.randint(0, 256, (1, 21))
    docs = torch.tensor([[0] * 11 + [1] * 21])
    with torch.no_grad():
        both = model(torch.cat([a, b], 1), docs=docs)
        alone = model(b)
        unmasked = model(torch.cat([a, b], 1))
    assert torch.allclose(both[:, 11:], alone, atol=1e-5)
    assert not torch.allclose(unmasked[:, 11:], alone, atol=1e-3)


def test_mixture_resumes_across_layouts(pools, corpora, tmp_path):
    """Checkpoint a dp2 mixture run at step 5, resume it as tp2: steps 6-10 equal one process's."""
    o = {**_cfg(corpora, MIX), "training__steps": 10}
    ref = _reference(corpora, o)
    first = make_config(**o, parallel__dp=2, checkpoint__every=5)
    pools(2).run(train_case, C.to_dict(first), str(tmp_path / "a"), 5)  # stop after step 5, the one resumed
    ck = str(tmp_path / "a" / "checkpoints" / "step_00000005")
    assert os.path.isdir(ck)
    resumed = make_config(**o, parallel__tp=2, checkpoint__resume=ck)
    pools(2).run(train_case, C.to_dict(resumed), str(tmp_path / "b"))
    got = read_metrics(str(tmp_path / "b"))
    assert [r["step"] for r in got] == list(range(6, 11))
    assert_same_losses(ref[5:], got, 1e-5)
    assert got[-1]["data"] == ref[-1]["data"]


def test_attn_impl_resolves_and_refuses():
    """auto is flex under a document mask (not under the ring) and under all-gather CP (whose causal
    rows SDPA would get as a dense mask), sdpa otherwise; the ring refuses flex."""
    from harness import build_layout
    from meshlm.core.config.model import model_args
    assert model_args(make_config(data__document_mask=True)).attn_kernel == "flex"
    assert model_args(make_config()).attn_kernel == "sdpa"
    assert model_args(make_config(model__attn_impl="flex")).attn_kernel == "flex"
    assert model_args(make_config(data__document_mask=True, model__attn_impl="sdpa")).attn_kernel == "sdpa"
    assert model_args(make_config(parallel__cp=2)).attn_kernel == "sdpa"
    assert model_args(make_config(parallel__cp=2, parallel__cp_impl="allgather")).attn_kernel == "flex"
    assert model_args(make_config(parallel__cp=2, parallel__cp_impl="allgather",
                                  model__attn_impl="sdpa")).attn_kernel == "sdpa"
    with pytest.raises(C.ConfigError, match="model.attn_impl: flex is not available with parallel.cp_impl = ring"):
        build_layout(make_config(model__attn_impl="flex", parallel__cp=2), 2)
    ulysses = model_args(make_config(parallel__cp=2, parallel__cp_impl="ulysses", data__document_mask=True))
    assert ulysses.attn_kernel == "flex" and ulysses.mask_rows == "all"  # its core attends every query
    assert model_args(make_config(parallel__cp=2, parallel__cp_impl="ulysses")).attn_kernel == "sdpa"
    assert model_args(make_config(parallel__cp=2, parallel__cp_impl="allgather")).mask_rows == "local"
    assert model_args(make_config(parallel__tp=2)).mask_rows == "own"
    with pytest.raises(C.ConfigError, match="model.attn_impl: 'xformers' is not one of auto, sdpa, flex"):
        build_layout(make_config(model__attn_impl="xformers"), 1)


def test_mixture_and_mask_refusals(corpora):
    from harness import build_layout
    cfg = make_config(**_cfg(corpora, {**MASK, "parallel__cp": 2}))
    with pytest.raises(C.ConfigError, match="data.document_mask: not available with context parallelism") as e:
        build_layout(cfg, 2)
    assert "parallel.cp_impl = ring: its core takes no mask" in str(e.value) and "\n" not in str(e.value)
    assert "use parallel.cp_impl = allgather or ulysses" in str(e.value)
    for impl in ("allgather", "ulysses"):
        build_layout(make_config(**_cfg(corpora, {**MASK, "parallel__cp": 2, "parallel__cp_impl": impl})), 2)
    cfg = make_config(**_cfg(corpora, {**MIX, "data__path": "$docs"}))
    with pytest.raises(C.ConfigError, match="give data.path or data.mix, not both"):
        build_layout(cfg, 1)
    with pytest.raises(ValueError, match="gets 0 of 8 sequences"):
        run_local(make_config(**_cfg(corpora, {"data__mix": [("$docs", 0.99), ("$code", 0.01)]})))
    for bad in ('[["a", 0]]', '[["a"]]', "a=x"):
        with pytest.raises(C.ConfigError, match="data.mix"):
            C.apply(C.Config(), "data.mix", bad)
    cfg = C.Config()
    C.apply(cfg, "data.mix", "web/=0.7,code/=0.3")
    assert cfg.data.mix == [["web/", 0.7], ["code/", 0.3]]
    assert C.load(None, [("data.mix", '[["web/", 0.7], ["code/", 0.3]]')]).data.mix == cfg.data.mix


_SCALE = textwrap.dedent("""
    import json, os, resource, sys, time
    from meshlm.data.dataset import open_data
    path, seq, batch = sys.argv[1], 2048, 512
    t0 = time.perf_counter()
    data = open_data(path, [], seq, batch, seed=0)
    x, y, _ = data.next_batch(3, 8)
    x2, _, _ = data.next_batch(3, 8)
    print(json.dumps({"s": time.perf_counter() - t0, "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "windows": data.sampler.num_windows, "shape": list(x.shape)}))
""")


def _sparse_index(root, tokens: int) -> str:
    """An index over one sparse token file (zeros; no disk blocks): the sampler's view of a corpus."""
    os.makedirs(root)
    with open(os.path.join(root, "tokens_00000.bin"), "wb") as f:
        f.truncate(2 * tokens)
    open(os.path.join(root, "docs.bin"), "wb").close()
    index = {"version": 2, "tokenizer": "bytes", "vocab_size": 256, "dtype": "uint16", "documents": 0,
             "tokens": tokens, "files": [{"file": "tokens_00000.bin", "tokens": tokens}], "doc_starts": "docs.bin",
             "splits": {"train": {"start": 0, "tokens": tokens - 10**6}, "val": {"start": tokens - 10**6, "tokens": 10**6}}}
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump(index, f)
    return root


@pytest.mark.slow
def test_trillion_token_index_starts_fast_and_small(tmp_path):
    """The sampler's memory and start-up do not grow with the corpus: 1e12 tokens (488M windows of 2048)
    vs 1e7, each in a fresh interpreter; first two batches of a dp rank within 2 s, RSS within 100 MiB."""
    out = {}
    for name, n in (("small", 10**7), ("huge", 10**12)):
        path = _sparse_index(str(tmp_path / name), n)
        res = subprocess.run([sys.executable, "-c", _SCALE, path], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["huge"]["windows"] == (10**12 - 10**6 - 1) // 2048 and out["huge"]["shape"] == [64, 2048]
    assert out["huge"]["s"] < 2.0, out
    assert out["huge"]["rss_kb"] - out["small"]["rss_kb"] < 100 * 1024, out
