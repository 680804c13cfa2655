"""Loss spikes (train/resilience/spike.py): a corrupt global batch (random tokens, injected by data position) is
judged a spike at the same step in one process and in dp2 / tp2 layouts; `skip` drops its update,
`rollback` reloads the checkpoint before it and skips the global batches since; every later loss is
the same in every layout."""
import json
import os

import pytest
from harness import make_config, sources_corpus, train_hooked

CORRUPT = 9  # data position 9: the batch step 10 reads
# the data is pinned: on another corpus a clean batch may itself be a 4σ spike within 5 steps
BASE = dict(training__steps=14, training__spike_zscore=4.0, training__spike_window=5, metrics__every=1,
            data__path=sources_corpus())


def train(pools, cfg, world: int, run_dir: str, corrupt: int = CORRUPT) -> list[dict]:
    return train_hooked(pools, cfg, world, run_dir, {"MESHLM_TEST_CORRUPT_BATCH": str(corrupt)})


def losses(lines: list[dict]) -> dict[int, float]:
    got = [r for r in lines if "loss" in r]
    assert len({r["step"] for r in got}) == len(got), "a step is logged twice"
    return {r["step"]: r["loss"] for r in got}


def assert_close(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got)
    for s in ref:
        assert abs(ref[s] - got[s]) <= 1e-5 * abs(ref[s]), (s, ref[s], got[s])


LAYOUTS = {"dp2": dict(parallel__dp=2, parallel__zero=1), "tp2": dict(parallel__tp=2, parallel__dp=1)}


@pytest.mark.isa  # the 4σ judgement is data- and kernel-dependent: it must hold with every CPU's kernels
def test_corrupt_batch_is_skipped_alike_in_every_layout(pools, tmp_path):
    ref_lines = train(pools, make_config(**BASE), 1, str(tmp_path / "one"))
    spikes = [r["spike"] for r in ref_lines if "spike" in r]
    assert [(s["step"], s["action"]) for s in spikes] == [(10, "skip")], spikes  # only the corrupt one
    assert spikes[0]["zscore"] is None or spikes[0]["zscore"] > 4
    ref = losses(ref_lines)
    assert [r["step"] for r in ref_lines if r.get("skipped")] == [10]
    # without the guard the corrupt batch's update lands: later losses differ
    plain = losses(train(pools, make_config(**dict(BASE, training__spike_zscore=0.0)), 1, str(tmp_path / "off")))
    assert all(plain[s] == ref[s] for s in range(1, 11)) and plain[14] != ref[14]
    for name, over in LAYOUTS.items():
        got = train(pools, make_config(**BASE, **over), 2, str(tmp_path / name))
        assert [(r["spike"]["step"], r["spike"]["action"]) for r in got if "spike" in r] == [(10, "skip")], name
        assert_close(ref, losses(got))


@pytest.mark.slow
def test_rollback_reloads_the_checkpoint_and_skips_the_batches_since(pools, tmp_path):
    cfg = dict(BASE, training__spike_action="rollback", checkpoint__every=4, checkpoint__keep=10)
    ref_lines = train(pools, make_config(**cfg), 1, str(tmp_path / "one"))
    back = [r for r in ref_lines if "rollback_to" in r]
    assert len(back) == 1 and back[0]["rollback_to"] == 8 and back[0]["spike"]["step"] == 10, back
    assert back[0]["skipped_batches"] == [8, 9]  # global batches of steps 9 and 10, never trained on
    ref = losses(ref_lines)
    assert sorted(ref) == list(range(1, 15))
    # the steps after the rollback read the batches after the corrupt one: the same run as one that
    # skips batches 8 and 9 from a clean step-8 state, i.e. a run whose batch 8 is any batch it skips
    clean = losses(train(pools, make_config(**dict(BASE, training__spike_zscore=0.0)), 1, str(tmp_path / "c"),
                         corrupt=-1))
    assert all(abs(clean[s] - ref[s]) <= 1e-6 * clean[s] for s in range(1, 9))
    assert ref[9] != clean[9]  # step 9 trained on batch 10 after the rollback
    got = train(pools, make_config(**cfg, **LAYOUTS["dp2"]), 2, str(tmp_path / "dp2"))
    assert [r["rollback_to"] for r in got if "rollback_to" in r] == [8]
    assert_close(ref, losses(got))
    meta = json.load(open(tmp_path / "one" / "checkpoints" / "step_00000012" / "meta.json"))
    assert meta["sampler"]["step"] == 14  # the data position (batches 8, 9 skipped) is resumable


def test_bad_spike_keys(tmp_path, capsys):
    from meshlm.cli import main
    for argv, key in ((["--training.spike_action", "ignore"], "training.spike_action"),
                      (["--training.spike_zscore", "-1"], "training.spike_zscore"),
                      (["--training.spike_window", "1"], "training.spike_window"),
                      (["--training.spike_zscore", "6", "--training.spike_action", "rollback"],
                       "training.spike_action"),
                      (["--metrics.straggler_factor", "0.5"], "metrics.straggler_factor")):
        assert main(["train", "--run-dir", str(tmp_path / "r"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"meshlm: {key}") and "\n" not in err, err
    assert not (tmp_path / "r").exists()
