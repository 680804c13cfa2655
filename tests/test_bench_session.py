"""The GPU session's pieces cannot rot between the rare sessions that have a GPU: each piece fits one
lent-device call (its `timeout`s summed from bench/gpu_session.sh), the headline piece fits 8 minutes,
the ledger lists every piece and picks the oldest, and the new pieces run end to end on a CPU in their
plumbing mode (issue 47)."""
import argparse
import json
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
import headline  # noqa: E402
import ledger  # noqa: E402


def piece_timeouts() -> dict[str, int]:
    """{piece: the sum of its `timeout N` commands}, read from the script's case arms."""
    text = (ROOT / "bench" / "gpu_session.sh").read_text()
    out, current = {}, None
    for line in text.splitlines():
        if m := re.match(r"^([a-z0-9][a-z0-9-]*)\)$", line):
            current = m.group(1)
            out[current] = 0
        elif line.strip() == ";;":
            current = None
        elif current and (m := re.search(r"\btimeout (\d+) ", line)):
            out[current] += int(m.group(1))
    return out


def test_every_piece_fits_one_call_and_headline_fits_eight_minutes():
    sums = piece_timeouts()
    assert set(ledger.pieces()) <= set(sums)
    too_long = {p: s for p, s in sums.items() if s >= 570}
    assert not too_long, too_long  # a lent-device call runs at most 600 s
    assert sums["headline"] <= 480
    assert sum(t for _, t in headline.ROWS) <= headline.HEADLINE_BUDGET_S < sums["headline"]
    for piece in ("headline", "next", "overlap", "multirank"):
        assert piece in sums, piece


def test_next_takes_never_run_pieces_first_then_the_oldest(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "LEDGER", str(tmp_path / "LEDGER.json"))
    order = ledger.pieces()
    assert ledger.next_piece() == order[0]  # nothing ran yet
    ran = {p: {"date": f"2026-11-{10 + i:02d}"} for i, p in enumerate(order)}
    ledger.write_json(ledger.LEDGER, {"pieces": dict(list(ran.items())[:-1])})
    assert ledger.next_piece() == order[-1]  # the one never run
    ran[order[-1]]["date"], ran[order[2]]["date"] = "2026-11-30", "2026-11-01"
    ledger.write_json(ledger.LEDGER, {"pieces": ran})
    assert ledger.next_piece() == order[2]  # the oldest


def test_ingest_files_a_piece_under_its_date_and_card(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(ledger, "LEDGER", str(tmp_path / "results" / "LEDGER.json"))
    out = tmp_path / "out" / "overlap"
    out.mkdir(parents=True)
    meta = {"piece": "overlap", "date": "2026-11-26", "name": "NVIDIA H200", "driver": "580.1", "torch": "2.11.0",
            "commit": "abc1234"}
    (out / "meta.json").write_text(json.dumps(meta))
    (out / "overlap.json").write_text("{}")
    (tmp_path / "out" / "log.txt").write_text("not a piece")
    assert ledger.ingest(str(tmp_path / "out")) == ["overlap"]
    assert (tmp_path / "results" / "2026-11-26-nvidia-h200" / "overlap" / "overlap.json").exists()
    line = json.loads((tmp_path / "results" / "LEDGER.json").read_text())["pieces"]["overlap"]
    assert line["dir"] == os.path.join("2026-11-26-nvidia-h200", "overlap") and line["driver"] == "580.1"


@pytest.mark.slow
def test_headline_plumbing_on_a_cpu(tmp_path):
    report = headline.main(["--device", "cpu", "--tiny", "--out", str(tmp_path),
                            "--rows", "ceilings,mfu-1b,docmask-1b-sdpa,docmask-1b-flex,mla-moe-bf16,mla-moe-fp8"])
    rows = report["rows"]
    assert rows["ceilings"]["status"] == "ok" and rows["ceilings"]["result"]["gemm"][0]["bf16_tflops"] > 0
    for name in ("mfu-1b", "docmask-1b-sdpa", "docmask-1b-flex"):
        r = rows[name]["result"]
        assert rows[name]["status"] == "ok" and r["tokens_per_s"] > 0 and r["steps"] == 2, rows[name]
    flex, sdpa = rows["docmask-1b-flex"]["result"], rows["docmask-1b-sdpa"]["result"]
    assert (flex["attn_impl"], sdpa["attn_impl"], flex["micro_batch"]) == ("flex", "sdpa", sdpa["micro_batch"])
    assert report["summary"]["flex_over_sdpa"] > 0
    bf16, fp8 = rows["mla-moe-bf16"]["result"], rows["mla-moe-fp8"]["result"]  # MLA + MoE, both precisions
    assert rows["mla-moe-bf16"]["status"] == rows["mla-moe-fp8"]["status"] == "ok", rows
    assert (bf16["n_layers"], bf16["precision"], fp8["precision"]) == (4, "bf16", "fp8")
    assert fp8["micro_batch"] == bf16["micro_batch"] and report["summary"]["fp8_over_bf16_mla"] > 0
    assert json.loads((tmp_path / "headline.json").read_text())["rows"].keys() == rows.keys()


def test_headline_mla_rows_are_a_four_block_cut_of_a_real_deepseek_preset():
    """On a GPU the MLA rows run the preset's own widths (not a debug model's): 4 blocks, the first
    dense, 3 with all routed experts; the planner prices the cut as fitting an H100 at some micro-batch."""
    from meshlm.core.model_args import PRESETS
    real = headline.shapes(False)
    args = PRESETS[real["mla"]]
    assert real["mla"] in ("deepseek-v2-lite", "moonlight-16b-a3b") and headline.MLA_CUT == {"model.n_layers": 4}
    assert args.dim >= 2048 and args.kv_lora_rank >= 512 and args.num_experts >= 64 and args.n_layers > 4
    assert args.moe_first_dense < headline.MLA_CUT["model.n_layers"]
    cut = {**headline.MLA_CUT, "training.ac": "none", "training.precision": "bf16"}
    sizes = headline.planner_batches(real["mla"], real["mb"], "h100", cut, argparse.Namespace(seq_len=real["seq"]))
    assert sizes[0] >= 4, sizes  # `meshlm estimate` fits the cut at a batch whose MFU means something


@pytest.mark.slow
def test_overlap_plumbing_on_a_cpu(tmp_path):
    out = tmp_path / "overlap.json"
    import overlap
    report = overlap.main(["--device", "cpu", "--tiny", "--reps", "3", "--out", str(out)])
    row, = report["rows"]
    assert row["alone_s"] > 0 and row["contended_s"] > 0 and row["achieved_GBps"] > 0
    assert json.loads(out.read_text())["summary"]["nvlink"]["mean_slowdown"] == row["slowdown"]


@pytest.mark.slow
def test_multirank_plumbing_on_a_cpu(tmp_path):
    import multirank
    report = multirank.main(["--device", "cpu", "--precisions", "fp32", "--layouts", "dp2-zero3",
                             "--out", str(tmp_path / "multirank.json")])
    row, = report["rows"]
    assert row["ok"] and row["steps"] == multirank.BASE["training.steps"] and not row["shared_gpu"], row
    assert report["preemption"]["ok"], report["preemption"]  # a CPU reads the flag in the step it rode in


def test_docs_gpu_tables_are_generated_from_the_ledger():
    """docs/benchmarks.md's GPU block and LEDGER.md equal what `bench/ledger.py render` makes of the
    ledger: a number typed by hand there, or a result ingested without re-rendering, fails here."""
    assert ledger.render(check=True) == [], "run `python bench/ledger.py render`"
    led = ledger.load()["pieces"]
    text = (ROOT / "bench" / "results" / "LEDGER.md").read_text()
    for piece in ledger.pieces():  # every piece is listed, with its date or "never"
        assert re.search(rf"^\| `{re.escape(piece)}` \| ({led[piece]['date'] if piece in led else 'never'}) \|",
                         text, flags=re.M), piece


def test_gpu_rows_record_the_devices_energy():
    """Every GPU row carries the joules its steps drew (metrics.jsonl's energy_j, NVML on a GPU), for the
    planner's J/step beside it once a GPU runs them (docs/energy.md); None where a record has no reading."""
    import gpu
    recs = [{"step_s": 2.0, "energy_j": 1400.0}, {"step_s": 2.0, "energy_j": 1000.0}]
    assert gpu.measured_energy(recs) == {"energy_j_per_step": 1200.0, "power_w": 600.0}
    assert gpu.measured_energy(recs + [{"step_s": 1.0, "energy_j": None}]) == {"energy_j_per_step": None,
                                                                                "power_w": None}
