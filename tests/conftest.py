import os
import shutil
import tempfile

import pytest

from harness import Pool


def pytest_configure(config):
    """One temporary root for the session, removed at its end: tests and their spawned ranks make run
    directories with `tempfile` (TMPDIR is inherited), and thousands of checkpoints must not pile up in
    /tmp run after run. Inductor's cache is meshlm's own per-capability directory
    (meshlm/parallel/compile_cache.py), kept across sessions (compiling is most of a compiled test's
    time), set before TMPDIR moves and before any compile."""
    from meshlm.parallel.compile_cache import capability_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = capability_dir()
    root = tempfile.mkdtemp(prefix="meshlm-tests-")
    config.meshlm_tmp = (root, os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = tempfile.tempdir = root


def pytest_unconfigure(config):
    root, env, before = getattr(config, "meshlm_tmp", (None, None, None))
    if root is None:
        return
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    tempfile.tempdir = before
    shutil.rmtree(root, ignore_errors=True)
    # as every meshlm process ends: the interpreter's exit does not free torch's and the tests' objects one by
    # one (1.2 s and up)
    from meshlm.core.process import freeze_for_exit
    freeze_for_exit()


# The 30 longest items of `make test` on the developers' 2-core machine (`--durations=30`, 2026-11-26: 553 s
# of its 1451 s) join the `slowest` tier that `make test-slow` (and CI) runs, so `make test` fits 15 minutes.
SLOWEST = frozenset({
    "tests/test_quickstart.py::test_a_short_run_prints_a_python_line_after_def",
    "tests/test_elastic.py::test_node_lost_and_back_with_two_agents",
    "tests/test_bench_session.py::test_multirank_plumbing_on_a_cpu",
    "tests/test_saved_set.py::test_saved_bytes_meet_formula[tp4-sp-fp32-compiled]",
    "tests/test_saved_set.py::test_saved_bytes_meet_formula[tp4-bf16-compiled]",
    "tests/test_offload_nvme.py::test_kill_during_checkpoint_write_resumes_from_the_last_committed",
    "tests/test_plan.py::test_plan_405b_on_16k_gpus",
    "tests/test_cp.py::test_cp_layout_matches_one_process[cp2-allgather-compile]",
    "tests/test_data_layouts.py::test_data_layout_matches_one_process[flex-cp2-allgather-tp2-sp]",
    "tests/test_saved_set.py::test_saved_bytes_meet_formula[tp4-sp-bf16-compiled]",
    "tests/test_bench_session.py::test_headline_plumbing_on_a_cpu",
    "tests/test_cp.py::test_cp_layout_matches_one_process[cp2-allgather-ac-full-accum]",
    "tests/test_data_layouts.py::test_data_layout_matches_one_process[flex-cp2-ulysses-tp2-sp]",
    "tests/test_fault.py::test_frozen_worker_is_named_by_the_launcher",
    "tests/test_train.py::test_nproc_launch",
    "tests/test_preempt.py::test_sigterm_to_one_worker_of_a_launch[worker]",
    "tests/test_preempt.py::test_sigterm_to_one_worker_of_a_launch[launcher]",
    "tests/test_saved_set.py::test_saved_bytes_meet_formula[tp2-sp-bf16-compiled]",
    "tests/test_bench.py::test_gpu_peers_bench_smoke",
    "tests/test_cp.py::test_cp_layout_matches_one_process[cp2-tp2-sp-allgather]",
    "tests/test_train.py::test_compiled_blocks_give_the_same_losses[op]",
    "tests/test_saved_set.py::test_saved_bytes_meet_formula[tp1-bf16-compiled]",
    "tests/test_moe.py::test_compiled_moe_matches_eager",
    "tests/test_train.py::test_two_torchrun_agents_as_two_nodes",
    "tests/test_full_disk.py::test_full_disk_launch_exits_one",
    "tests/test_exit.py::test_abort_after_the_run_finished_is_named_and_exits_zero",
    "tests/test_cp.py::test_cp_layout_matches_one_process[cp2-allgather-bf16]",
    "tests/test_convert_mem.py::test_conversion_holds_one_tensor[from_hf]",
    "tests/test_bench.py::test_gpu_bench_fp8_compare_smoke",
    "tests/test_fault.py::test_flight_recorder_names_the_rank_that_never_entered",
    "tests/test_explore_browser.py::test_optimizer_choice_reprices_the_optimizer_state",
    # 2026-11-27: `make test` took 20:12 quietly with this session's 66 new tests; the 22 longest items
    # of that run (`--durations=25`, 205 s) join the tier
    "tests/test_explore_browser.py::test_plan_rows_load_exactly_and_export_the_cli_file[llama3-70b-64]",
    "tests/test_cp.py::test_cp_layout_matches_one_process[cp2-compile]",
    "tests/test_convert_mem.py::test_conversion_holds_one_tensor[to_hf_fp32]",
    # 2026-11-30: the third direction joins the other two, so that their shared module fixture (three
    # conversions in fresh processes, 6.5 s) runs in one tier, not in both
    "tests/test_convert_mem.py::test_conversion_holds_one_tensor[to_hf_bf16]",
    "tests/test_muon.py::test_muon_layout_matches_one_process[tp4-gqa-kv2]",
    "tests/test_fp8.py::test_fp8_layout_within_2_percent_of_bf16[cp2-ring-ac-full]",
    "tests/test_data_layouts.py::test_data_layout_matches_one_process[flex-tp2-sp]",
    "tests/test_data_layouts.py::test_data_layout_matches_one_process[flex-cp2-allgather-gqa-ac-selective]",
    "tests/test_zeropp.py::test_bytes_equal_formulas[2]",
    "tests/test_muon.py::test_muon_layout_matches_one_process[dp2-fp16]",
    "tests/test_equivalence.py::test_layout_matches_one_process[cp2-tp2-sp]",
    "tests/test_checkpoint.py::test_save_memory_stays_within_own_shard",
    "tests/test_equivalence.py::test_layout_matches_one_process[pp2-cp2-tp2-sp-ulysses]",
    "tests/test_cp.py::test_cp_layout_matches_one_process[cp2-tp2-sp-ulysses]",
    "tests/test_saved_set.py::test_ac_modes_meet_planner[2-True-selective-True]",
    "tests/test_muon.py::test_muon_layout_matches_one_process[zero3-dp2-bf16]",
    "tests/test_fp8.py::test_fp8_layout_within_2_percent_of_bf16[tp2-gqa-kv1]",
    "tests/test_saved_set.py::test_saved_bytes_meet_formula[tp1-fp32-compiled]",
    "tests/test_tp.py::test_tp_matches_one_process[tp4-kv2-sp-qkv-bias-qk-norm]",
    "tests/test_explore_browser.py::test_plan_rows_load_exactly_and_export_the_cli_file[llama3-405b-128]",
    "tests/test_data_layouts.py::test_data_layout_matches_one_process[flex-cp2-ulysses-gqa-ac-selective]",
    "tests/test_fp8_moe.py::test_ep_dispatch_moves_float8_bytes",
    "tests/test_data_layouts.py::test_data_layout_matches_one_process[flex-one-process]",
})


def pytest_collection_modifyitems(items):
    """`make test-fast` (-m "not slow") is the edit loop: a test that needs gloo worker pools is slow
    unless it is marked `fast` (one equivalence row per dimension is); others say `slow` themselves. A
    `slowest` test (left out of `make test` too) is always slow."""
    for item in items:
        if item.nodeid in SLOWEST:
            item.add_marker(pytest.mark.slowest)
        if item.get_closest_marker("slowest") is not None or (
                "pools" in item.fixturenames and item.get_closest_marker("fast") is None):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def pools():
    """pools(world) -> a persistent Pool of that many gloo ranks, shared by the whole session."""
    made: dict[int, Pool] = {}

    def get(world: int) -> Pool:
        if world not in made:
            made[world] = Pool(world)
        return made[world]

    yield get
    for p in made.values():
        p.close()
