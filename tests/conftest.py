import pytest

from harness import Pool


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
