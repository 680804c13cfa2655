"""The explorer's energy column and time-energy chart (docs/energy.md, "Predicted energy and the Pareto
front"): the API's rows carry the CLI's J/token and the front's rows; a real headless Chromium draws one
dot per row, the front's in red. Screenshots go to $MESHLM_EXPLORE_SHOTS or the test's tmp dir."""
import os

import pytest

from meshlm.explore.api import run_plan
from browser import CHROMIUM, explorer_page, sync_playwright

BODY = {"model.preset": "llama3-8b", "gpu": "h100", "gpus": 32, "data.seq_len": 4096,
        "global_batch_tokens": 2 ** 21, "training.precision": "bf16", "top": 20}


def test_plan_rows_carry_j_per_token_and_the_front():
    res = run_plan(dict(BODY))
    rows = res["ranked"]
    assert rows and all(r["j_per_token"] > 0 for r in rows)
    front = res["pareto"]
    assert front and front == sorted(front, key=lambda i: rows[i]["step_s"])
    for i in front:
        assert not any(q["step_s"] <= rows[i]["step_s"] and q["j_per_token"] <= rows[i]["j_per_token"]
                       and (q["step_s"], q["j_per_token"]) != (rows[i]["step_s"], rows[i]["j_per_token"])
                       for q in rows)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None or sync_playwright is None,
                    reason="needs Debian's chromium and the playwright package (the dev extra)")
def test_explorer_draws_the_energy_column_and_front(tmp_path):
    shots = os.environ.get("MESHLM_EXPLORE_SHOTS") or str(tmp_path)
    with explorer_page(tmp_path, 180000) as (pg, errors):
        pg.wait_for_selector("#mem-table[data-model]")
        pg.select_option('select[name="model.preset"]', "llama3-8b")
        pg.fill('input[name="gpus"]', "32")
        pg.wait_for_selector('#plan-table[data-model="llama3-8b"][data-gpus="32"]')
        pg.wait_for_function("document.querySelector('#pareto-caption').textContent.includes('on the time-energy front')")
        rows = pg.locator("#plan-table tbody tr[data-i]").count()
        assert "J/token" in pg.inner_text("#plan-table thead")
        cells = pg.locator("#plan-table tbody td.energy").all_inner_texts()
        assert len(cells) == rows and all(float(c) > 0 for c in cells)
        assert pg.locator("#pareto-chart circle.dot").count() == rows
        assert pg.locator("#pareto-chart circle.front").count() >= 1
        pg.locator("#plan-card").screenshot(path=os.path.join(shots, "explore_energy.png"))
        assert not errors, errors
