"""The incidents a run's metrics.jsonl records (stragglers, loss spikes, restarts and resizes), as the
lines the launcher prints when a job ends and the runs dashboard shows: the trainer writes the records
(train/observe/, train/resilience/), both readers read them here."""
from __future__ import annotations

import json
import os

def incidents(run_dir: str) -> list[str]:
    """One line per straggler named, spike and restart in RUN_DIR/metrics.jsonl (the launcher prints
    them when the job ends; docs/fault_tolerance.md)."""
    path, out, slow = os.path.join(run_dir, "metrics.jsonl"), [], {}
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            for s in rec.get("stragglers", []):
                first, _ = slow.get(s["rank"], (rec["step"], s))
                slow[s["rank"]] = (first, s)
            if "spike" in rec:
                sp = rec["spike"]
                what = (f"rolled back to step {rec['rollback_to']}, skipped global batches "
                        f"{rec['skipped_batches'][0]}..{rec['skipped_batches'][1]}") if "rollback_to" in rec \
                    else "update skipped"
                out.append(f"meshlm: spike at step {sp['step']}: {sp['on']} {sp['value']:.4g} "
                           f"(window mean {sp['mean']:.4g}, std {sp['std']:.3g}): {what}")
            if "restart" in rec:
                out.append(f"meshlm: restart {rec['restart']}: resumed from step {rec['resumed_from']}"
                           + (f", world {rec['old_world']} -> {rec['world']} ranks, layout {rec['old_layout']} -> {rec['layout']}"
                              if rec.get("resized") else ""))
    for rank, (first, s) in sorted(slow.items()):
        out.append(f"meshlm: straggler: rank {rank} from step {first}: busy {s['ratio']:.1f}x the others' median "
                   f"(compute {s['compute_s'] * 1e3:.0f} ms, data {s['data_s'] * 1e3:.0f} ms, "
                   f"blocked in collectives {s['comm_s'] * 1e3:.0f} ms per step)")
    return out
