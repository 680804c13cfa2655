"""The GPU results ledger: which piece of bench/gpu_session.sh ran last when, on which card, driver and
torch, and where its JSON lies (bench/results/<date>-<card>/<piece>/). The pieces are read from
gpu_session.sh itself, so a new piece shows as "never" until it runs.

    python bench/ledger.py meta PIECE --out DIR   # on the GPU machine: DIR/meta.json (card, driver, torch)
    python bench/ledger.py ingest DIR             # here: each DIR/<piece>/ with a meta.json into bench/results/
    python bench/ledger.py next                   # the piece whose last run is oldest (never-run first)
    python bench/ledger.py render [--check]       # LEDGER.md and docs/benchmarks.md's generated GPU tables
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
LEDGER = os.path.join(RESULTS, "LEDGER.json")
SESSION = os.path.join(ROOT, "bench", "gpu_session.sh")
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- ledger:begin (bench/ledger.py render) -->", "<!-- ledger:end -->"
SMI_KEYS = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"


def write_json(path: str, obj) -> None:
    """Whole or not at all: a run killed mid-write leaves the previous file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def pieces() -> list[str]:
    """The pieces gpu_session.sh knows, in its order (its `case` labels)."""
    with open(SESSION) as f:
        labels = re.findall(r"^([a-z0-9][a-z0-9-]*)\)$", f.read(), flags=re.M)
    return [p for p in labels if p not in ("all", "next")]


def smi() -> dict:
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_KEYS}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    return dict(zip(SMI_KEYS.split(","), (v.strip() for v in line.split(","))))


def environment(device: str = "cuda") -> dict:
    """Card, driver, clocks, power, torch, date and commit, read without a CUDA context in this process
    (the rows' processes get the whole card). `card`: the planner profile of the card, or None."""
    import torch

    from meshlm.plan.hardware import DEVICE_NAMES
    s = smi() if device == "cuda" else {}
    name = s.get("name", "cpu")
    card = next((prof for key, prof in DEVICE_NAMES if key.lower() in name.lower()), None)
    commit = os.environ.get("MESHLM_COMMIT") or _git_commit()
    return {"name": name, "card": card, "driver": s.get("driver_version"), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
            time.gmtime()), "commit": commit, "nvidia_smi": s}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def row_line(r: dict) -> str:
    """One measured row in a few words (empty for rows without tokens/s)."""
    if "tokens_per_s" not in r:
        return ""
    mem = r.get("peak_mem_gib")
    return (f"mb {r.get('micro_batch')}: {r['tokens_per_s']:,.0f} tok/s, MFU {100 * r.get('mfu', 0):.1f}%"
            + (f", peak {mem:.1f} GiB" if mem is not None else ""))


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def load() -> dict:
    if not os.path.exists(LEDGER):
        return {"pieces": {}}
    with open(LEDGER) as f:
        return json.load(f)


def ingest(src: str) -> list[str]:
    """Every DIR/<piece>/ holding a meta.json: its files into bench/results/<date>-<card>/<piece>/, and
    the ledger's line for that piece. Returns the pieces taken."""
    led, taken = load(), []
    for piece in sorted(os.listdir(src)):
        meta_path = os.path.join(src, piece, "meta.json")
        if not os.path.isfile(meta_path):
            continue
        with open(meta_path) as f:
            meta = json.load(f)
        rel = os.path.join(f"{meta['date']}-{slug(meta['name'])}", piece)
        dest = os.path.join(RESULTS, rel)
        os.makedirs(dest, exist_ok=True)
        files = sorted(n for n in os.listdir(os.path.join(src, piece)) if n.endswith((".json", ".txt")))
        for n in files:
            shutil.copyfile(os.path.join(src, piece, n), os.path.join(dest, n))
        led["pieces"][piece] = {k: meta.get(k) for k in ("date", "name", "driver", "torch", "commit", "note")}
        led["pieces"][piece]["dir"] = rel
        taken.append(piece)
    write_json(LEDGER, led)
    return taken


def next_piece() -> str:
    """Never-run pieces first (in gpu_session.sh's order), then the one whose last run is oldest."""
    led = load()["pieces"]
    order = pieces()
    return min(order, key=lambda p: (p in led, led.get(p, {}).get("date") or "", order.index(p)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("meta", help="write OUT/meta.json for PIECE (on the GPU machine)")
    m.add_argument("piece")
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    sub.add_parser("ingest", help="take a GPU call's output folder into bench/results").add_argument("src")
    sub.add_parser("next", help="print the piece whose last run is oldest")
    a = p.parse_args(argv)
    if a.cmd == "meta":
        if a.piece not in pieces():
            p.exit(2, f"bench/ledger.py: unknown piece {a.piece!r} (gpu_session.sh has {', '.join(pieces())})\n")
        os.makedirs(a.out, exist_ok=True)
        write_json(os.path.join(a.out, "meta.json"), dict(environment(a.device), piece=a.piece))
    elif a.cmd == "ingest":
        if not os.path.isdir(a.src):
            p.exit(2, f"bench/ledger.py: ingest: no folder {a.src}\n")
        taken = ingest(a.src)
        print("ingested: " + (", ".join(taken) or "nothing (no <piece>/meta.json below it)"))
    elif a.cmd == "next":
        print(next_piece())
    return 0


if __name__ == "__main__":
    sys.exit(main())
