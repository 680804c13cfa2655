"""configs/*.toml: each recipe's header carries the planner's estimate of it (the `# planner:` line,
rewritten by `make recipes`), and the recipe resolves into a layout for the GPUs it names."""
import importlib.util
import pathlib

import pytest

from meshlm.core import config as C
from harness import build_layout

ROOT = pathlib.Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("recipe_estimates", ROOT / "bench" / "recipe_estimates.py")
recipe_estimates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe_estimates)
RECIPES = recipe_estimates.recipes()


def test_the_seven_recipes_are_there_and_linked_from_the_readme():
    names = {pathlib.Path(p).name for p in RECIPES}
    assert names == {"llama3-8b-8xh100.toml", "llama3-70b-32xh100.toml", "mixtral-8x7b-16xh100.toml",
                     "llama3-8b-128k-8xh100.toml", "finetune-llama3-8b-hf.toml", "deepseek-v3-1024xh100.toml",
                     "llama3-8b-h100-a100.toml"}
    readme = (ROOT / "README.md").read_text()
    assert all(f"configs/{n}" in readme for n in names)


@pytest.mark.parametrize("path", RECIPES, ids=[pathlib.Path(p).name for p in RECIPES])
def test_header_matches_meshlm_estimate(path):
    assert recipe_estimates.differences(path) == []


@pytest.mark.parametrize("path", RECIPES, ids=[pathlib.Path(p).name for p in RECIPES])
def test_recipe_resolves_for_its_gpus(path):
    args = recipe_estimates.command(path)
    world = int(args[args.index("--gpus") + 1])
    pairs, _ = C.parse_overrides(args)  # the fine-tune's estimate leaves the Hugging Face directory out
    cfg = C.load(path, pairs)
    layout = build_layout(cfg, world)
    assert layout.world_size == world
