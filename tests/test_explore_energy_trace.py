"""The explorer's schedule of a trace (explore/energy.py, static/energy_trace.js; docs/energy.md "Scheduling in
time"): the API answers with the windows and the spans `plan` chose, bad traces are one line, and in a real
headless Chromium the card draws the real day of docs/traces (screenshot to $MESHLM_EXPLORE_SHOTS or tmp)."""
import os

import pytest

from meshlm.explore.api import BadRequest
from meshlm.explore.energy import energy_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAY = os.path.join(ROOT, "docs", "traces", "be-day-ahead-2022-01-03.csv")


def test_a_past_day_is_scheduled_from_its_start():
    res = energy_schedule({"trace": open(DAY).read(), "steps": 8, "seconds": 8 * 3600}, BadRequest)
    assert res["kind"] == "price" and not res["from_now"] and len(res["windows"]) == 48
    assert sum(n for _, _, n in res["spans"]) == 8 and res["cost"] < res["cost_now"]  # the negative night
    assert res["saving"] == pytest.approx(1 - res["cost"] / res["cost_now"])


@pytest.mark.parametrize("body,line", [
    ({"trace": "time,cost\n", "steps": 1, "seconds": 1}, "the trace: row 1: expected the header time,price or time,carbon"),
    ({"trace": "", "steps": 0, "seconds": 1}, "the trace: row 1"),
    ({"steps": 4, "seconds": 3600 * 100}, "the trace: row 1"),
])
def test_bad_input_is_one_line(body, line):
    with pytest.raises(BadRequest) as e:
        energy_schedule(body, BadRequest)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_a_deadline_too_soon_is_one_line():
    with pytest.raises(BadRequest, match=r"^training.energy.deadline: cannot be met even running throughout"):
        energy_schedule({"trace": open(DAY).read(), "steps": 8, "seconds": 8 * 3600,
                         "deadline": "2022-01-03T06:00:00+01:00"}, BadRequest)


@pytest.mark.slow
def test_the_card_draws_the_schedule_in_a_browser(tmp_path):
    from browser import CHROMIUM, explorer_page, sync_playwright
    if CHROMIUM is None or sync_playwright is None:
        pytest.skip("no chromium / playwright here (tests/test_explore_browser.py says how to get them)")
    with explorer_page(tmp_path) as (pg, errors):
        pg.wait_for_selector("#run-total[data-seconds]:not([data-seconds=''])")
        pg.fill("#energy-trace", open(DAY).read())
        pg.click("#energy-go")
        pg.wait_for_selector("#energy-chart[data-spans]:not([data-spans=''])")
        assert int(pg.get_attribute("#energy-chart", "data-spans")) == pg.locator("#energy-chart rect.span").count() >= 1
        assert "saved" in pg.inner_text("#energy-caption")
        pg.fill("#energy-trace", "time,price\nnot a time,1\n")
        pg.click("#energy-go")
        pg.wait_for_function("document.querySelector('#energy-caption').textContent.includes('row 2')")
        pg.fill("#energy-trace", open(DAY).read())
        pg.click("#energy-go")
        pg.wait_for_selector("#energy-chart[data-spans]:not([data-spans=''])")
        shots = os.environ.get("MESHLM_EXPLORE_SHOTS") or str(tmp_path)
        pg.locator("#energy-card").screenshot(path=os.path.join(shots, "explore_energy_trace.png"))
        assert not errors, errors
