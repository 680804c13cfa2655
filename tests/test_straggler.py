"""Stragglers (train/observe/straggler.py): a rank slowed inside every step is named in metrics.jsonl with its
step split, and the launcher's summary and the runs dashboard say so; the fast rank never is."""
from harness import make_config, train_hooked

from meshlm.core.facts.incidents import incidents


def test_slow_rank_is_named(pools, tmp_path):
    run = str(tmp_path / "run")
    cfg = make_config(training__steps=6, metrics__every=1, metrics__straggler_steps=2,
                      metrics__straggler_factor=1.5, parallel__dp=2)
    lines = train_hooked(pools, cfg, 2, run, {"MESHLM_TEST_SLOW_RANK": "1:0.6"})
    steps = [r for r in lines if "loss" in r]
    named = [(r["step"], s["rank"]) for r in steps for s in r.get("stragglers", [])]
    assert named and {rank for _, rank in named} == {1}, named
    assert min(step for step, _ in named) >= 2  # two logged steps in a row before it is named
    s = [x for r in steps for x in r.get("stragglers", [])][-1]
    assert s["compute_s"] >= 0.5 and s["ratio"] > 1.5  # the sleep is compute time on rank 1
    assert all(r["time_split"]["comm_s"] >= 0.4 for r in steps[2:])  # rank 0 waits for it in collectives
    out = incidents(run)
    assert len(out) == 1 and out[0].startswith("meshlm: straggler: rank 1 from step"), out
    import os

    from meshlm.explore.runs import read_run
    assert read_run(os.path.dirname(run), "run")["incidents"] == [out[0].removeprefix("meshlm: ")]
