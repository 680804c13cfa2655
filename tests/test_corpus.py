"""`meshlm prepare` on the corpora people have (issue #21): JSON Lines (plain, gz, zst), Parquet and a
`datasets` save_to_disk directory decode to their documents with one EOS each (BOS as the tokenizer's
post-processor adds it); any worker count writes the same bytes; bad input is one line naming the file
and line/row and leaves nothing behind; an interrupted run leaves nothing; memory does not grow with
the corpus."""
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from meshlm.cli import main
from meshlm.data import TokenShards, load_tokenizer, prepare

DOCS = [f"document {i}: " + "héllo wörld " * (i % 5) + f"def f{i}(x): return x" for i in range(120)]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A Llama-3-like tokenizer directory: byte-level BPE, BOS added by the post-processor, EOS named by
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 3, trainer=trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=[BOS, EOS, "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": {"content": EOS}}))
    return d


def _write_jsonl(path, docs, field="text"):
    opener = gzip.open if str(path).endswith(".gz") else open
    if str(path).endswith(".zst"):
        import zstandard
        data = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
        return path
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({field: d, "id": i}) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are skipped
    return path


def _documents(out, tok) -> list[list[int]]:
    """The prepared stream cut at its recorded document starts."""
    s = TokenShards(out, "train")
    ids = s.get(0, len(s))
    starts = np.fromfile(os.path.join(out, "docs.bin"), dtype="<i8").tolist() + [len(ids)]
    return [ids[a:b].tolist() for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "saved"])
def test_formats_decode_to_documents_with_one_eos(tmp_path, tokenizer_dir, fmt):
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        src = tmp_path / "c.parquet"
        pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), src, row_group_size=17)
        field = "content"
    elif fmt == "saved":
        import datasets
        src = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(src), max_shard_size="2KB")
        assert len([f for f in os.listdir(src) if f.endswith(".arrow")]) > 1
        field = "text"
    else:
        src, field = _write_jsonl(tmp_path / f"c.{fmt}", DOCS), "text"
    tj = str(tokenizer_dir / "tokenizer.json")
    index = prepare([str(src)], tj, str(tmp_path / "out"), val_fraction=0.0, text_field=field, workers=1)
    tok = load_tokenizer(tj)
    bos, eos = tok._tok.token_to_id(BOS), tok._tok.token_to_id(EOS)
    assert index["documents"] == len(DOCS) and index["framing"]["eos"] == eos
    docs = _documents(str(tmp_path / "out"), tok)
    assert len(docs) == len(DOCS)
    for ids, text in zip(docs, DOCS):
        assert ids[0] == bos and ids[-1] == eos and ids.count(eos) == 1 and ids.count(bos) == 1
        assert tok.decode(ids[1:-1]) == text


def test_bytes_directory_mixes_formats_and_text_files(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    _write_jsonl(tmp_path / "in" / "a.jsonl", ["one", "", "two"])  # the empty document is dropped
    (tmp_path / "in" / "sub" / "b.txt").write_text("three\n")
    (tmp_path / "in" / "sub" / "skip.bin").write_bytes(b"\x00")
    index = prepare([str(tmp_path / "in")], "bytes", str(tmp_path / "out"), val_fraction=0.0)
    s = TokenShards(tmp_path / "out")
    assert bytes(s.get(0, len(s)).astype(np.uint8)) == b"one\n\ntwo\n\nthree\n\n\n"
    assert index["documents"] == 3


def test_worker_count_does_not_change_a_byte(tmp_path, tokenizer_dir, monkeypatch):
    import meshlm.data.build as P
    monkeypatch.setattr(P, "BATCH_CHARS", 500)  # many tasks, so workers really interleave
    src = _write_jsonl(tmp_path / "c.jsonl", DOCS * 4)
    tj = str(tokenizer_dir / "tokenizer.json")
    outs = []
    for w in (1, 3):
        out = tmp_path / f"w{w}"
        prepare([str(src)], tj, str(out), workers=w, shard_tokens=999)
        outs.append({f: (out / f).read_bytes() for f in sorted(os.listdir(out))})
    assert len(outs[0]) > 3 and outs[0] == outs[1]


def test_eos_override_and_missing_eos(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    src = _write_jsonl(tmp_path / "c.jsonl", DOCS[:5])
    tj = str(tokenizer_dir / "tokenizer.json")
    prepare([str(src)], tj, str(tmp_path / "o"), val_fraction=0.0, eos="<|eot_id|>", workers=1)
    tok = load_tokenizer(tj)
    assert all(d[-1] == tok._tok.token_to_id("<|eot_id|>") for d in _documents(str(tmp_path / "o"), tok))
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="names no end-of-document token .* pass --eos TOKEN"):
        prepare([str(src)], str(tmp_path / "bare.json"), str(tmp_path / "o2"))
    with pytest.raises(ValueError, match="--eos: 'nope' is not a token"):
        prepare([str(src)], tj, str(tmp_path / "o2"), eos="nope")
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("content,match", [
    ('{"text": "ok"}\n{"text": "ok"\n', r"c\.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"c\.jsonl:2: field 'text' is missing"),
    ('{"text": 3}\n', r"c\.jsonl:1: field 'text' is int, not text"),
    ('["text"]\n', r"c\.jsonl:1: a JSON line must be an object"),
])
def test_bad_lines_are_one_line_and_leave_nothing(tmp_path, content, match):
    (tmp_path / "c.jsonl").write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier set")  # a failed run never touches what is there
    assert main(["prepare", "--input", str(tmp_path / "c.jsonl"), "--out", str(out)]) == 2
    with pytest.raises(ValueError, match=match):
        prepare([str(tmp_path / "c.jsonl")], "bytes", str(out))
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "out"] and os.listdir(out) == ["keep.txt"]


def test_other_bad_inputs(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: no column 'text' \(columns: body"):
        prepare([str(tmp_path / "p.parquet")], "bytes", str(tmp_path / "o"))
    (tmp_path / "x.csv").write_text("a,b\n")
    assert main(["prepare", "--input", str(tmp_path / "x.csv"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "x.csv: unsupported input format" in err and "\n" not in err
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: cannot read"):
        prepare([str(tmp_path / "bad.jsonl.gz")], "bytes", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    assert main(["prepare", "--input", str(tmp_path / "p.parquet"), "--text-field", "body",
                 "--out", str(tmp_path / "o"), "--val-fraction", "0"]) == 0
    assert len(TokenShards(tmp_path / "o")) == 3  # "x" + the blank-line separator


_MEM = """
import json, resource, sys
from meshlm.data import prepare
prepare([sys.argv[1]], "bytes", sys.argv[2], workers=1)
print(json.dumps({"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _big_jsonl(path, mb: int):
    line = json.dumps({"text": "x" * 2000}) + "\n"
    with open(path, "w") as f:
        for _ in range(mb * 1024 * 1024 // len(line)):
            f.write(line)


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS of prepare over 3 MB and 30 MB of JSON Lines (10× apart), each in a fresh interpreter."""
    rss = {}
    for mb in (3, 30):
        _big_jsonl(tmp_path / f"{mb}.jsonl", mb)
        res = subprocess.run([sys.executable, "-c", _MEM, str(tmp_path / f"{mb}.jsonl"), str(tmp_path / f"o{mb}")],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        rss[mb] = json.loads(res.stdout.strip().splitlines()[-1])["rss_kb"]
    assert rss[30] - rss[3] < 16 * 1024, rss  # 27 MB more input: well under 16 MiB more memory


def test_interrupted_prepare_leaves_nothing(tmp_path):
    _big_jsonl(tmp_path / "c.jsonl", 200)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "prepare", "--input", str(tmp_path / "c.jsonl"),
                             "--out", str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob("out.tmp-*")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("out.tmp-*")), "prepare never started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted; nothing written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
