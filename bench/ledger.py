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

    from meshlm.core.cards import card as card_of
    s = smi() if device == "cuda" else {}
    name = s.get("name", "cpu")
    card = card_of(name)
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


# ---------------------------------------------------------------------------------- rendering

def _read(rel: str, name: str) -> dict | None:
    path = os.path.join(RESULTS, rel, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:  # the first JSON value: a hand-run file may have the printed table after it
        return json.JSONDecoder().raw_decode(f.read())[0]


def ledger_table(led: dict) -> list[str]:
    out = ["| piece | last run | card | driver | torch | commit | results |", "|---|---|---|---|---|---|---|"]
    for p in pieces():
        e = led.get(p)
        out.append(f"| `{p}` | never | | | | | |" if e is None else
                   f"| `{p}` | {e['date']} | {e['name']} | {e['driver']} | {e['torch']} | {e['commit']} | "
                   f"`bench/results/{e['dir']}/`{' (' + e['note'] + ')' if e.get('note') else ''} |")
    return out


def headline_table(rel: str) -> list[str]:
    h = _read(rel, "headline.json")
    if h is None:
        return ["The headline piece has not run yet."]
    env, rows = h["env"], dict(h["rows"])
    peer = _read(rel, "peer-1b-rerun.json")
    out = [f"Card {env['name']} (driver {env['driver']}, power limit {env['nvidia_smi'].get('power.limit')}), torch "
           f"{env['torch']}, commit {env['commit']}, {env['date']}; {h['steps']['warmup']} warm-up + "
           f"{h['steps']['measured']} measured steps a row, median step (min-max); the row's wall time includes its "
           "process start and cold compile.", "",
           "| row | status | micro-batch | tokens/s | MFU | peak GiB | step ms (min-max) | wall s |",
           "|---|---|---:|---:|---:|---:|---|---:|"]
    if peer and rows.get("peer-1b", {}).get("status") != "ok":
        rows["peer-1b (rerun alone)"] = {"status": "ok", "result": peer["results"][0], "elapsed_s": None}
    for name, row in rows.items():
        r = row.get("result", {})
        if "tokens_per_s" in r:
            spread = (f"{1e3 * r['step_s']:.0f} ({1e3 * r['step_s_min']:.0f}-{1e3 * r['step_s_max']:.0f})"
                      if "step_s_min" in r else f"{1e3 * r['step_s']:.0f}")
            mem = "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.1f}"
            out.append(f"| {name} | ok | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {mem} | "
                       f"{spread} | {row['elapsed_s'] if row['elapsed_s'] is not None else '-'} |")
        else:
            why = row.get("error") or r.get("reason") or ""
            out.append(f"| {name} | {row['status']}{': ' + why if why else ''} | | | | | | {row['elapsed_s']} |")
    c = _read(rel, "ceilings.json")
    if c:
        out += ["", "Ceilings: " + "; ".join(
            f"{g['gemm']} bf16 {g['bf16_tflops']:.0f} TFLOP/s" + (f", fp8 {g['fp8_tflops']:.0f} ({g['fp8_speedup']:.2f}x)"
                                                                  if "fp8_tflops" in g else "") for g in c["gemm"])
            + f"; device copy {c['copy_TBps']:.2f} TB/s (read + write)."]
    ratios = dict(h.get("summary", {}))
    if peer and "tokens_per_s" in rows.get("mfu-1b", {}).get("result", {}):
        ratios.setdefault("meshlm_over_peer_1b", rows["mfu-1b"]["result"]["tokens_per_s"] / peer["results"][0]["tokens_per_s"])
    if ratios:
        out += ["", "Ratios (tokens/s): " + ", ".join(f"{k.replace('_', ' ')} **{v:.3f}x**" for k, v in ratios.items()) + "."]
    return out


def overlap_table(rel: str) -> list[str]:
    o = _read(rel, "overlap.json")
    if o is None:
        return ["The overlap piece has not run yet."]
    rows = o["rows"]
    links = list(dict.fromkeys(r["link"] for r in rows))
    out = [f"{o['env']['name']}, torch {o['env']['torch']}, {o['env']['date']}; interferer: {rows[0]['interferer']}. "
           "GEMM slowdown beside the copy kernel (contended / alone - 1), mean over the shapes "
           f"({', '.join(dict.fromkeys(r['gemm'] for r in rows))}):", "",
           "| CTAs | " + " | ".join(f"{lk} (GB/s moved)" for lk in links) + " | mean |",
           "|---:|" + "---:|" * (len(links) + 1)]
    for c in sorted({r["ctas"] for r in rows}):
        cells, allv = [], []
        for lk in links:
            sel = [r for r in rows if r["ctas"] == c and r["link"] == lk]
            v = sum(r["slowdown"] for r in sel) / len(sel)
            allv += [r["slowdown"] for r in sel]
            cells.append(f"{100 * v:+.1f}% ({sum(r['achieved_GBps'] for r in sel) / len(sel):.0f})")
        out.append(f"| {c} | " + " | ".join(cells) + f" | {100 * sum(allv) / len(allv):+.1f}% |")
    mean = sum(r["slowdown"] for r in rows) / len(rows)
    out += ["", f"Mean over every row: **{100 * mean:+.1f}%** (the planner's `GPU.overlap_slowdown`)."]
    return out


def multirank_table(rel: str) -> list[str]:
    m = _read(rel, "multirank.json")
    if m is None:
        return ["The multirank piece has not run yet."]
    out = [f"{m['env']['name']}, torch {m['env']['torch']}, {m['env']['date']}: two ranks on the one GPU, "
           "per-step losses against one process on the same GPU.", "",
           "| layout | precision | worst relative loss gap | bound | ok |", "|---|---|---:|---:|---|"]
    for r in m["rows"]:
        gap = f"{r['worst_rel']:.2e}" if "worst_rel" in r else r.get("error", "")
        out.append(f"| {r['layout']} | {r['precision']} | {gap} | {r.get('tolerance', '')} | {'yes' if r['ok'] else 'NO'} |")
    p = m.get("preemption")
    if p:
        out += ["", f"Preemption (SIGTERM to rank 1 in step 3 of dp2): exit {p['exit']}, stopped and saved at step "
                f"{p['stopped_at']} (expected {p['expected']}: the flag is read one step late on CUDA), "
                f"checkpoints {p['checkpoints']}: {'ok' if p['ok'] else 'NOT ok'}."]
    return out


def results_table(rel: str) -> list[str]:
    """Any piece whose JSON files hold bench/gpu.py's `results` rows (mfu, docmask, 3b, moe, ...)."""
    out = ["| file | preset | micro-batch | tokens/s | MFU | peak GiB | options |", "|---|---|---:|---:|---:|---:|---|"]
    for name in sorted(os.listdir(os.path.join(RESULTS, rel))):
        data = _read(rel, name) if name.endswith(".json") and name != "meta.json" else None
        for r in (data or {}).get("results", []) if isinstance(data, dict) else []:
            if "tokens_per_s" not in r:
                continue
            opts = ", ".join(f"{k} {r[k]}" for k in ("precision", "loss_chunks", "attn_impl", "document_mask") if k in r)
            out.append(f"| {name} | {r['preset']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
                       f"{100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {data.get('ac', '')} AC{', ' + opts if opts else ''} |")
    return out


def render_docs(led: dict) -> str:
    """The generated block of docs/benchmarks.md: the ledger and the newest run of each new piece."""
    parts = ["### The GPU ledger (bench/results/LEDGER.json)", "", *ledger_table(led["pieces"])]
    for piece, title, table in (("headline", "Headline", headline_table), ("overlap", "Overlapped compute", overlap_table),
                                ("multirank", "Two ranks on one GPU", multirank_table)):
        e = led["pieces"].get(piece)
        parts += ["", f"### {title} (`bash bench/gpu_session.sh {piece}`)", "",
                  *(table(e["dir"]) if e else [f"The {piece} piece has not run yet."])]
    for piece in pieces():
        e = led["pieces"].get(piece)
        if piece in ("headline", "overlap", "multirank") or e is None:
            continue
        rows = results_table(e["dir"])
        if len(rows) > 2:
            parts += ["", f"### `{piece}`: {e['name']}, torch {e['torch']}, {e['date']}", "", *rows]
    return "\n".join(parts) + "\n"


def render(check: bool = False) -> list[str]:
    """Write LEDGER.md and the block between the markers in docs/benchmarks.md; with `check`, only
    say which of them differ from what the ledger gives. Returns the files (to be) changed."""
    led = load()
    md = "# GPU results ledger\n\nGenerated by `python bench/ledger.py render` from LEDGER.json; " \
         "`bash bench/gpu_session.sh next` runs the first never-run piece, else the oldest.\n\n" \
         + "\n".join(ledger_table(led["pieces"])) + "\n"
    with open(DOCS) as f:
        docs = f.read()
    if BEGIN not in docs or END not in docs:
        raise SystemExit(f"bench/ledger.py: {DOCS} has no {BEGIN} ... {END} block")
    head, rest = docs.split(BEGIN, 1)
    new_docs = head + BEGIN + "\n" + render_docs(led) + END + rest.split(END, 1)[1]
    changed = []
    for path, text in ((os.path.join(RESULTS, "LEDGER.md"), md), (DOCS, new_docs)):
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            changed.append(os.path.relpath(path, ROOT))
            if not check:
                with open(path, "w") as f:
                    f.write(text)
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("meta", help="write OUT/meta.json for PIECE (on the GPU machine)")
    m.add_argument("piece")
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    sub.add_parser("ingest", help="take a GPU call's output folder into bench/results").add_argument("src")
    sub.add_parser("next", help="print the piece whose last run is oldest")
    sub.add_parser("render", help="LEDGER.md and docs/benchmarks.md's generated block").add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if either differs from the ledger")
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
    elif a.cmd == "render":
        changed = render(a.check)
        print(("out of date: " if a.check else "wrote: ") + (", ".join(changed) or "nothing"))
        return 1 if a.check and changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
