"""Tests for meshlm.data: tokenizers, shards, default corpus, global batch sampler."""

import json
import os

import numpy as np
import pytest
import torch

from meshlm.data import (DEFAULT_CORPUS_NAME, ByteTokenizer, GlobalBatchSampler, HFTokenizer, TokenShards,
                         default_data_dir, eval_batches, load_tokenizer, prepare)


def _write_corpus(root, n_files=4, lines=60):
    root.mkdir(parents=True, exist_ok=True)
    for k in range(n_files):
        text = "".join(f"def f{k}_{i}(x):\n    return x * {i} + {k}  # héllo\n"
                       for i in range(lines))
        (root / f"m{k}.py").write_text(text, encoding="utf-8")
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "notes.md").write_text("# notes\nsome text\n", encoding="utf-8")
    (root / "sub" / "ignored.bin").write_bytes(b"\x00\x01binary")
    return root


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.name == "bytes"
    text = "héllo wörld ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def _train_hf_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x * 2\n", "hello world", "héllo"] * 5,
                            trainer=trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_prepare_and_decode(tmp_path):
    tj = _train_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(tj))
    assert isinstance(tok, HFTokenizer) and tok.name == str(tj)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    src = tmp_path / "doc.txt"
    text = "def f(x):\n    return x * 2\nhello world héllo\n" * 40
    src.write_text(text, encoding="utf-8")
    index = prepare([str(src)], str(tj), str(tmp_path / "out"), val_fraction=0.0, workers=1)
    assert index["tokenizer"] == os.path.abspath(tj)
    assert index["vocab_size"] == tok.vocab_size and index["dtype"] == "uint16"
    shards = TokenShards(tmp_path / "out")
    ids = shards.get(0, len(shards)).tolist()
    eos = tok._tok.token_to_id("<|endoftext|>")  # no tokenizer_config.json: the vocabulary's own EOS
    assert ids[-1] == eos and ids.count(eos) == 1
    assert load_tokenizer(shards.tokenizer).decode(ids[:-1]) == text


def test_bad_tokenizer_is_one_line_value_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    for spec in (str(bad), str(tmp_path / "missing.json"), str(tmp_path)):
        with pytest.raises(ValueError) as ei:
            load_tokenizer(spec)
        msg = str(ei.value)
        assert msg.startswith(f"data.tokenizer: cannot read tokenizer '{spec}': ")
        assert "\n" not in msg


# ---------------------------------------------------------------- shards

def test_prepare_bytes_index_and_splits(tmp_path):
    root = _write_corpus(tmp_path / "src")
    out = tmp_path / "data"
    index = prepare([str(root)], "bytes", str(out), val_fraction=0.1, shard_tokens=1000)
    on_disk = json.loads((out / "index.json").read_text())
    assert on_disk == index
    assert index["version"] == 2 and index["tokenizer"] == "bytes"
    assert index["vocab_size"] == 256 and index["dtype"] == "uint16"
    assert index["documents"] == 5  # 4 .py + notes.md; ignored.bin skipped
    # Expected stream: sorted files, each followed by a blank-line separator.
    files = sorted([*(root / f"m{k}.py" for k in range(4))]) + [root / "sub" / "notes.md"]
    expected = b"".join(p.read_bytes() + b"\n\n" for p in files)
    train, val = TokenShards(out, "train"), TokenShards(out, "val")
    assert len(train) + len(val) == len(expected)
    assert len(val) >= 1025 or len(val) == len(expected) // 2
    assert len(val) > 0 and len(train) > 0
    assert index["splits"]["train"] == {"start": 0, "tokens": len(train)}
    assert index["splits"]["val"] == {"start": len(train), "tokens": len(val)}
    assert sum(e["tokens"] for e in index["files"]) == len(expected)
    for k, e in enumerate(index["files"]):
        assert e["file"] == f"tokens_{k:05d}.bin"
        assert os.path.getsize(out / e["file"]) == 2 * e["tokens"]
    starts = np.fromfile(out / "docs.bin", dtype="<i8")
    assert starts.tolist() == list(np.cumsum([0] + [p.stat().st_size + 2 for p in files])[:-1])
    # Val is exactly the tail of the stream, disjoint from train.
    stream = np.frombuffer(expected, dtype=np.uint8).astype(np.int64)
    np.testing.assert_array_equal(train.get(0, len(train)), stream[:len(train)])
    np.testing.assert_array_equal(val.get(0, len(val)), stream[len(train):])
    assert not list(tmp_path.glob("data.tmp-*"))  # temp dir cleaned up


def test_token_shards_get_across_boundaries(tmp_path):
    src = tmp_path / "a.txt"
    src.write_bytes(bytes(range(32, 127)) * 3)
    out = tmp_path / "d"
    index = prepare([str(src)], "bytes", str(out), val_fraction=0.0, shard_tokens=7)
    assert len(index["files"]) > 5 and index["splits"]["val"]["tokens"] == 0
    shards = TokenShards(out)
    full = np.frombuffer(src.read_bytes() + b"\n\n", dtype=np.uint8).astype(np.int64)
    assert len(shards) == len(full)
    for start, length in [(0, 7), (5, 4), (6, 20), (13, 1), (0, len(full)), (len(full) - 3, 3)]:
        got = shards.get(start, length)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, full[start:start + length])
    with pytest.raises(IndexError):
        shards.get(len(full) - 2, 5)
    assert len(TokenShards(out, "val")) == 0


def test_prepare_and_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data: input path does not exist: "):
        prepare([str(tmp_path / "nope")], "bytes", str(tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="no documents found"):
        prepare([str(tmp_path / "empty")], "bytes", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    with pytest.raises(FileNotFoundError, match=r"data.path: no prepared data at .*meshlm prepare"):
        TokenShards(tmp_path / "o")


def test_prepare_overwrite_flag(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a" * 50)
    b.write_text("b" * 80)
    out = str(tmp_path / "d")
    prepare([str(a)], "bytes", out, val_fraction=0.0)
    assert len(TokenShards(out)) == 52
    prepare([str(b)], "bytes", out, val_fraction=0.0, overwrite=False)  # keeps existing
    assert len(TokenShards(out)) == 52
    prepare([str(b)], "bytes", out, val_fraction=0.0)  # replaces
    assert len(TokenShards(out)) == 82
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "d"]


def test_default_data_dir_prepares_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    d = default_data_dir()
    assert d == str(tmp_path / "cache" / DEFAULT_CORPUS_NAME)
    shards = TokenShards(d)
    assert shards.tokenizer == "bytes" and len(shards) > 100_000
    assert len(TokenShards(d, "val")) > 1024
    mtime = os.path.getmtime(os.path.join(d, "index.json"))
    assert default_data_dir() == d  # second call reuses it
    assert os.path.getmtime(os.path.join(d, "index.json")) == mtime
    assert "def " in ByteTokenizer().decode(shards.get(0, 20_000).tolist())


# ---------------------------------------------------------------- sampler

class _ArrayShards:
    """In-memory stand-in for TokenShards: token i has value i."""

    def __init__(self, n):
        self.data = np.arange(n, dtype=np.int64)

    def __len__(self):
        return len(self.data)

    def get(self, start, length):
        return self.data[start:start + length].copy()


def test_sampler_determinism_and_seeds():
    a = GlobalBatchSampler(10_001, 16, 8, seed=1)
    b = GlobalBatchSampler(10_001, 16, 8, seed=1)
    c = GlobalBatchSampler(10_001, 16, 8, seed=2)
    assert a.num_windows == 625
    assert [a.indices(s) for s in range(5)] == [b.indices(s) for s in range(5)]
    assert [a.indices(s) for s in range(5)] != [c.indices(s) for s in range(5)]
    assert a.indices(0) == a.epoch_permutation(0)[:8]


def test_sampler_dp_slices_concatenate_to_global_batch():
    shards = _ArrayShards(2_000)
    s = GlobalBatchSampler(len(shards), 10, 8, seed=0)
    for step in (0, 3, 40):
        ref_x, ref_y, _ = s.batch(shards, step, 0, 1)
        assert ref_x.shape == (8, 10) and ref_x.dtype == torch.long
        # targets are the inputs shifted by one; windows start at multiples of seq_len
        assert torch.equal(ref_y[:, :-1], ref_x[:, 1:])
        assert torch.equal(ref_y[:, -1], ref_x[:, -1] + 1)
        assert ref_x[:, 0].tolist() == [i * 10 for i in s.indices(step)]
        for dp in (2, 4):
            parts = [s.batch(shards, step, r, dp) for r in range(dp)]
            assert all(p[0].shape == (8 // dp, 10) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), ref_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)
    with pytest.raises(ValueError, match="not divisible"):
        s.batch(shards, 0, 0, 3)


def test_sampler_epochs_cover_every_window_once():
    n_tokens, seq, B = 7 * 5 + 1, 5, 3  # N = 7 windows, batches straddle epochs
    s = GlobalBatchSampler(n_tokens, seq, B, seed=3)
    assert s.num_windows == 7
    flat = [i for step in range(7 * 4 // B + 1) for i in s.indices(step)]
    for e in range(4):
        assert sorted(flat[e * 7:(e + 1) * 7]) == list(range(7))
    assert flat[:7] != flat[7:14]  # each epoch reshuffled
    # Batch crossing boundary: step 2 = samples 6,7,8 = perm0[6], perm1[0], perm1[1]
    p0, p1 = s.epoch_permutation(0), s.epoch_permutation(1)
    assert s.indices(2) == [p0[6], p1[0], p1[1]]
    # A fresh sampler jumping straight to a late step agrees.
    assert GlobalBatchSampler(n_tokens, seq, B, seed=3).indices(9) == s.indices(9)
    # The last window reaches the final token exactly.
    x, y, _ = s.batch(_ArrayShards(n_tokens), 0)
    assert int(y.max()) <= n_tokens - 1
    with pytest.raises(ValueError, match="corpus too small for seq_len 8"):
        GlobalBatchSampler(8, 8, 1, seed=0)


def test_sampler_state_dict_resume():
    shards = _ArrayShards(1_000)
    s = GlobalBatchSampler(len(shards), 8, 4, seed=5)
    ref = [s.next_batch(shards) for _ in range(12)]
    s2 = GlobalBatchSampler(len(shards), 8, 4, seed=5)
    for _ in range(5):
        s2.next_batch(shards)
    state = s2.state_dict()
    assert state == {"step": 5}
    s3 = GlobalBatchSampler(len(shards), 8, 4, seed=5)
    s3.load_state_dict(state)
    for k in range(5, 12):
        x, y, _ = s3.next_batch(shards, 0, 1)
        assert torch.equal(x, ref[k][0]) and torch.equal(y, ref[k][1])
    assert s3.state_dict() == {"step": 12}


def test_eval_batches_deterministic(tmp_path):
    shards = _ArrayShards(101)
    batches = eval_batches(shards, 10, 3, n_batches=5)
    assert len(batches) == 3  # 10 windows -> 3 full batches of 3
    assert [int(v) for x, _, _ in batches for v in x[:, 0]] == list(range(0, 90, 10))
    assert all(torch.equal(y[:, :-1], x[:, 1:]) for x, y, _ in batches)
    assert len(eval_batches(shards, 10, 32, n_batches=2)[0][0]) == 10  # partial batch
    with pytest.raises(ValueError, match="val split too small"):
        eval_batches(_ArrayShards(5), 10, 2, 1)


def test_no_torch_distributed_in_data():
    import re
    import meshlm.data as d
    root = os.path.dirname(d.__file__)
    pat = re.compile(r"^\s*(import torch\.distributed|from torch(\.distributed| import distributed))",
                     re.M)
    for name in os.listdir(root):
        if name.endswith(".py"):
            with open(os.path.join(root, name)) as f:
                assert not pat.search(f.read()), name


def test_version1_index_still_reads_but_refuses_document_masking(tmp_path):
    """Sets prepared before document starts were recorded train as before; masking says to re-prepare."""
    from meshlm.data.dataset import open_data
    np.arange(100, dtype="<u2").tofile(tmp_path / "train_00000.bin")
    np.arange(50, dtype="<u2").tofile(tmp_path / "val_00000.bin")
    (tmp_path / "index.json").write_text(json.dumps({
        "version": 1, "tokenizer": "bytes", "vocab_size": 256, "dtype": "uint16", "documents": 1,
        "splits": {"train": [{"file": "train_00000.bin", "tokens": 100}],
                   "val": [{"file": "val_00000.bin", "tokens": 50}]}}))
    assert TokenShards(tmp_path, "val").get(10, 3).tolist() == [10, 11, 12]
    assert open_data(str(tmp_path), [], 8, 2, seed=0).next_batch(0, 1).inputs.shape == (2, 8)
    with pytest.raises(ValueError, match="prepared without document starts .* run `meshlm prepare` again"):
        open_data(str(tmp_path), [], 8, 2, seed=0, document_mask=True)
