"""Benchmark (not a test): `meshlm prepare` memory and throughput (issue #21).

1. Peak RSS of `prepare` (a fresh interpreter each, parent + workers summed at their peaks) over JSON Lines
   corpora of growing size (default 40 MB, 400 MB, 4 GB): it must stay flat (<= 1 GiB).
2. Throughput side by side on the smallest corpus: `prepare` on all cores vs the HF `tokenizers` library
   alone (`encode_batch_fast` of the same documents, already in memory, on the same cores). Ratio >= 0.8.

The tokenizer is a byte-level BPE (Llama 3's kind) trained here on the corpus text (vocab 32,000), so no
download is needed. Documents are ~2 KB pieces of this interpreter's standard-library sources.

Sizes from `--bytes-from-mb` up (default 4000) go through the byte tokenizer instead: BPE runs at ~1-2
MB/s per core here, so a 4 GB corpus would take over half an hour on 2 cores; the bytes row still shows
that nothing is held per document or per byte read (its output is 2 bytes per input byte).

    python bench/data.py [--sizes-mb 40,400,4000] [--bytes-from-mb 4000] [--vocab 32000] [--workers N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_PREPARE = """
import json, resource, sys, time
from meshlm.data import prepare
t0 = time.perf_counter()
index = prepare([sys.argv[1]], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]))
dt = time.perf_counter() - t0
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"s": dt, "rss_self_mb": own / 1024, "rss_worker_mb": kids / 1024, "tokens": index["tokens"],
                  "documents": index["documents"]}))
"""

_TOKENIZER_ALONE = """
import json, sys, time
from tokenizers import Tokenizer
docs = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
tok = Tokenizer.from_file(sys.argv[2])
t0 = time.perf_counter()
n = 0
for i in range(0, len(docs), 4096):
    n += sum(len(e.ids) for e in tok.encode_batch_fast(docs[i:i + 4096], add_special_tokens=False))
print(json.dumps({"s": time.perf_counter() - t0, "tokens": n}))
"""


def documents(piece: int = 2000):
    """Endless ~2 KB documents from the stdlib sources, each made unique by a counter line."""
    from meshlm.data import stdlib_files
    texts = [open(f, encoding="utf-8", errors="replace").read() for f in stdlib_files()]
    k = 0
    while True:
        for t in texts:
            for i in range(0, len(t), piece):
                k += 1
                yield f"# doc {k}\n" + t[i:i + piece]


def write_corpus(path: str, mb: int) -> None:
    target, size = mb * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents():
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            size += len(line)
            if size >= target:
                return


def train_tokenizer(corpus: str, out_dir: str, vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = []
    with open(corpus, encoding="utf-8") as f:
        for _, line in zip(range(3000), f):
            sample.append(json.loads(line)["text"])
    tok.train_from_iterator(sample, trainer=trainers.BpeTrainer(
        vocab_size=vocab, show_progress=False, special_tokens=["<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|end_of_text|>"}, f)
    return os.path.join(out_dir, "tokenizer.json")


def _run(code: str, *argv: str) -> dict:
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="40,400,4000")
    ap.add_argument("--bytes-from-mb", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="scratch directory (needs ~2.5× the largest size free)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes_mb.split(",")]
    root = a.dir or tempfile.mkdtemp(prefix="meshlm-bench-data-")
    os.makedirs(root, exist_ok=True)
    try:
        corpus = os.path.join(root, f"c{sizes[0]}.jsonl")
        write_corpus(corpus, sizes[0])
        tj = train_tokenizer(corpus, os.path.join(root, "tok"), a.vocab)
        alone = _run(_TOKENIZER_ALONE, corpus, tj)
        rows = []
        for mb in sizes:
            path = os.path.join(root, f"c{mb}.jsonl")
            if not os.path.exists(path):
                write_corpus(path, mb)
            out = os.path.join(root, f"out{mb}")
            spec = "bytes" if mb >= a.bytes_from_mb else tj
            r = _run(_PREPARE, path, spec, out, str(a.workers))
            r.update(mb=mb, tokenizer="bytes" if spec == "bytes" else "bpe", mb_per_s=os.path.getsize(path) / 1e6 / r["s"],
                     rss_total_mb=r["rss_self_mb"] + a.workers * r["rss_worker_mb"])
            rows.append(r)
            shutil.rmtree(out, ignore_errors=True)
            if mb != sizes[0]:
                os.remove(path)
        # the tokenizer alone counts document tokens only; prepare's stream adds one EOS per document
        ratio = (alone["s"]) / rows[0]["s"] * (rows[0]["tokens"] - rows[0]["documents"]) / alone["tokens"]
        summary = {"rows": rows, "tokenizer_alone_s": alone["s"], "throughput_ratio": ratio,
                   "workers": a.workers, "cpus": os.cpu_count()}
        if a.json:
            print(json.dumps(summary))
            return
        print(f"{'input':>8} {'tok':>5} {'tokens':>14} {'s':>8} {'MB/s':>7} {'RSS parent':>11} {'RSS/worker':>11} {'RSS total':>10}")
        for r in rows:
            print(f"{r['mb']:>6}MB {r['tokenizer']:>5} {r['tokens']:>14,} {r['s']:>8.1f} {r['mb_per_s']:>7.2f} {r['rss_self_mb']:>9.0f}MB "
                  f"{r['rss_worker_mb']:>9.0f}MB {r['rss_total_mb']:>8.0f}MB")
        print(f"throughput vs tokenizers alone ({a.workers} workers, {os.cpu_count()} cores, {sizes[0]} MB): "
              f"{ratio:.2f}x (tokenizer alone {alone['s']:.1f} s, prepare {rows[0]['s']:.1f} s)")
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
