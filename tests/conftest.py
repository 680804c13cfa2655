import os
import shutil
import tempfile

import pytest

from harness import Pool


def pytest_configure(config):
    """One temporary root for the session, removed at its end: tests and their spawned ranks make run
    directories with `tempfile` (TMPDIR is inherited), and thousands of checkpoints must not pile up in
    /tmp run after run."""
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


def pytest_collection_modifyitems(items):
    """`make test-fast` (-m "not slow") is the edit loop: a test that needs gloo worker pools is slow
    unless it is marked `fast` (one equivalence row per dimension is); others say `slow` themselves. A
    `slowest` test (left out of `make test` too) is always slow."""
    for item in items:
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
