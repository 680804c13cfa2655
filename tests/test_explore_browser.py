"""`meshlm explore` in a real headless Chromium (Debian's `chromium`, driven by playwright without a
browser download): the explorer reacts to its inputs, the runs dashboard draws a real run.

Screenshots of both views go to $MESHLM_EXPLORE_SHOTS (docs/img for the docs) or the test's tmp dir.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from meshlm.core.model_args import PRESETS
from plan_rows import emitted_rows

from browser import CHROMIUM, FLAGS, env as _env, sync_playwright

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="no browser could be installed here: needs Debian's chromium (apt-get install -y chromium; .ci/run "
           "does it) and the playwright package (the dev extra)")]


@pytest.fixture(scope="module")
def explore(tmp_path_factory):
    """(URL, runs root, run name): `meshlm explore` started as a user would, over one short real run."""
    root = tmp_path_factory.mktemp("runs")
    run = root / "debug-6steps"
    subprocess.run([sys.executable, "-m", "meshlm.cli", "train", "--run-dir", str(run), "--model.preset", "debug",
                    "--data.seq_len", "32", "--training.global_batch", "4", "--training.micro_batch", "2",
                    "--training.steps", "6", "--training.eval_every", "3", "--training.eval_batches", "1",
                    "--metrics.progress", "false"], check=True, env=_env(), timeout=300, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "explore", "--port", "0", "--runs", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = proc.stdout.readline()
        assert line.startswith("meshlm explore: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        yield line.split()[2], root, run.name
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def page(explore):
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(tempfile.mkdtemp(prefix="chromium-"), executable_path=CHROMIUM,
                                                   headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000})
        pg = ctx.new_page()
        pg.set_default_timeout(120000)  # a search of 405B on 128 GPUs takes ~10 s alone, several times that on a busy machine
        errors = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(explore[0])
        pg.wait_for_selector("#mem-table[data-model]")
        yield pg
        ctx.close()
        assert not errors, errors


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    d = os.environ.get("MESHLM_EXPLORE_SHOTS") or str(tmp_path_factory.mktemp("shots"))
    os.makedirs(d, exist_ok=True)
    return d


def _param_bytes(page, tp: int) -> float:
    page.fill('input[name="parallel.tp"]', str(tp))
    page.wait_for_selector(f'#mem-table[data-model="llama3-70b"][data-gpus="64"][data-tp="{tp}"]')
    return float(page.get_attribute("#mem-params", "data-bytes"))


def test_explorer_tp8_divides_parameter_memory(page, shots):
    page.select_option('select[name="model.preset"]', "llama3-70b")
    page.select_option('select[name="gpu"]', "h100-sxm-80gb")
    page.fill('input[name="gpus"]', "64")
    one = _param_bytes(page, 1)
    eight = _param_bytes(page, 8)
    # all 70.6e9 parameters in bf16 on one GPU; tp = 8 splits all but the norms (and pads the vocabulary)
    assert one == 2 * PRESETS["llama3-70b"].num_params()
    assert one / eight == pytest.approx(8, rel=2e-3)
    assert page.inner_text("#mem-params").endswith("GiB")
    page.wait_for_function("document.querySelector('#plan-caption').textContent.startsWith('meshlm plan')")
    assert page.locator("#plan-table tbody tr").count() == 10
    page.screenshot(path=os.path.join(shots, "explore_explorer.png"), full_page=True)


def test_impossible_combination_shows_the_reason_next_to_the_input(page, shots):
    page.fill('input[name="gpus"]', "64")
    page.fill('input[name="parallel.tp"]', "3")
    err = page.locator('label:has(input[name="parallel.tp"]) .err')
    err.wait_for()
    assert "does not divide" in err.inner_text()
    assert page.locator("#outputs.stale").count() == 1 and page.is_disabled("#export")
    page.screenshot(path=os.path.join(shots, "explore_error.png"))
    page.fill('input[name="parallel.tp"]', "8")
    page.wait_for_selector("#outputs:not(.stale)")
    assert err.inner_text() == ""


def test_seed_examples(page):
    page.click("text=405B on 8 GPUs")
    page.wait_for_selector('#mem-table[data-model="llama3-405b"][data-gpus="8"]')
    assert "does not fit" in page.inner_text("#mem-caption")
    page.click("text=405B on 128 GPUs")
    page.wait_for_selector('#mem-table[data-model="llama3-405b"][data-gpus="128"]')
    page.wait_for_function("document.querySelector('#mem-caption').textContent.includes('fits')")
    assert page.locator("#pipe rect.act").count() > 0  # pp = 4: the simulator's timeline is drawn


def _searched(page):
    """Past the plan's 600 ms debounce, until the search it started has answered (a search left running
    would hold the server's CPU from the next test's requests)."""
    page.wait_for_timeout(800)
    page.wait_for_function("document.querySelector('#plan-caption').textContent.startsWith('meshlm plan')")


def test_optimizer_choice_reprices_the_optimizer_state(page):
    """The optimizer select sends optim.name: Muon's one moment per matrix holds less than AdamW's two.
    On the 7B-on-8 example, whose searches take a fraction of a second."""
    page.click("text=7B on 8 GPUs")
    page.wait_for_selector('#mem-table[data-model="llama3-8b"][data-gpus="8"]')
    _searched(page)
    assert page.eval_on_selector('select[name="optim.name"]', "s => [...s.options].map(o => o.value)") == ["adamw", "muon"]
    assert page.input_value('select[name="optim.name"]') == "adamw"
    adamw = float(page.get_attribute("#mem-optim", "data-bytes"))
    page.select_option('select[name="optim.name"]', "muon")
    page.wait_for_function(f"+document.querySelector('#mem-optim').dataset.bytes < {adamw}")
    assert 0 < float(page.get_attribute("#mem-optim", "data-bytes")) < adamw
    _searched(page)
    page.select_option('select[name="optim.name"]', "adamw")
    page.wait_for_function(f"+document.querySelector('#mem-optim').dataset.bytes === {adamw}")
    _searched(page)


def test_runs_dashboard_draws_every_logged_step(page, explore, shots):
    _, root, name = explore
    page.click("#tab-runs")
    page.click(f"#run-list li[data-name='{name}']")
    page.wait_for_selector(f'#chart-loss[data-run="{name}"]')
    lines = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = sum("loss" in x for x in lines)
    assert steps == 6
    assert page.locator("#chart-loss circle.train").count() == steps
    assert page.locator("#chart-loss circle.eval").count() == sum("eval_loss" in x for x in lines)
    assert "measured" in page.inner_text("#peak-label")
    page.screenshot(path=os.path.join(shots, "explore_runs.png"), full_page=True)


def test_runs_dashboard_follows_a_growing_run(page, explore):
    """While a run trains the dashboard re-reads it: a step appended to metrics.jsonl (with a half
    written line after it, as a reader can catch the writer) appears without a reload."""
    _, root, name = explore
    page.click("#tab-runs")
    page.click(f"#run-list li[data-name='{name}']")
    page.wait_for_selector(f'#chart-loss[data-run="{name}"]')
    path = root / name / "metrics.jsonl"
    steps = [json.loads(x) for x in path.read_text().splitlines() if '"loss"' in x]
    last, n = steps[-1], len(steps)
    page.wait_for_function(f"document.querySelectorAll('#chart-loss circle.train').length === {n}")
    with open(path, "a") as f:
        f.write(json.dumps(dict(last, step=last["step"] + 1)) + "\n" + '{"step": 99, "lo')
    page.wait_for_function(f"document.querySelectorAll('#chart-loss circle.train').length === {n + 1}", timeout=30000)
    page.wait_for_function(f"document.querySelector(\"#run-list li[data-name='{name}']\").textContent"
                           f".includes('{n + 1} steps')", timeout=30000)  # the list follows on its next poll


def test_runs_dashboard_plots_power_and_j_per_token_where_measured(page, explore):
    """This CPU's run logs null energy fields: no energy card. A copy of it whose lines carry measured
    values (as NVML's would) plots power and J/token, one point per logged step (docs/energy.md,
    "Measured energy")."""
    _, root, name = explore
    page.click("#tab-runs")
    page.click(f"#run-list li[data-name='{name}']")
    page.wait_for_selector(f'#chart-loss[data-run="{name}"]')
    assert page.locator("#run-energy-card").is_hidden()
    measured = root / "measured-energy"
    shutil.copytree(root / name, measured)
    text = (measured / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in text if x.endswith("}") and '"loss"' in x]  # an earlier test left a half line
    steps = [x for x in steps if x["step"] <= 6]
    assert steps and all("energy_j" in x and x["energy_j"] is None for x in steps)
    with open(measured / "metrics.jsonl", "w") as f:
        for i, x in enumerate(steps):
            f.write(json.dumps(dict(x, energy_j=720.0 * (i + 1), power_w=350.0 + i, j_per_token=0.5)) + "\n")
    page.click("#tab-explorer")
    page.click("#tab-runs")
    page.wait_for_selector("#run-list li[data-name='measured-energy']", timeout=30000)
    page.click("#run-list li[data-name='measured-energy']")
    page.wait_for_selector('#chart-loss[data-run="measured-energy"]')
    page.wait_for_selector("#run-energy-card:not([hidden]) #chart-power polyline.power")
    assert page.locator("#chart-jpt polyline.jpt").count() == 1
    n = len(steps)
    kwh = 720.0 * n * (n + 1) / 2 / 3.6e6
    assert page.inner_text("#run-energy-caption") == f"{kwh:.4f} kWh measured, summed over the job"


# ------------------------------------------------------------------------- a plan row loads exactly

def _set_cluster(page, preset: str, gpus: int):
    page.click("#tab-explorer")
    page.select_option('select[name="model.preset"]', preset)
    page.select_option('select[name="gpu"]', "h100-sxm-80gb")
    page.fill('input[name="gpus"]', str(gpus))
    page.wait_for_selector(f'#plan-table[data-model="{preset}"][data-gpus="{gpus}"]')


@pytest.mark.parametrize("preset,gpus", [("llama3-70b", 64), ("llama3-405b", 128), ("mixtral-8x7b", 16)])
def test_plan_rows_load_exactly_and_export_the_cli_file(page, explore, shots, preset, gpus):
    """Each of the top three rows, clicked: the page's estimate is the row's (bytes and seconds, not
    just the digits shown), it fits, and "export config" is `plan --emit-config --emit-rank N`'s file.
    From a fresh page, whose inputs are the CLI's defaults (an earlier test may have left muon or fp32)."""
    page.goto(explore[0])
    page.wait_for_selector("#mem-table[data-model]")
    with ThreadPoolExecutor(1) as pool:  # the CLI's search runs while the page's does
        cli = pool.submit(emitted_rows, ["--model", preset, "--gpu", "h100-sxm-80gb", "--gpus", str(gpus)], 3)
        _set_cluster(page, preset, gpus)
        rows = page.locator("#plan-table tbody tr[data-i]")
        assert rows.count() == 10
        for i in range(3):
            rows.nth(i).click()
            page.wait_for_selector(f'#plan-table[data-loaded="{i}"]')
            row = rows.nth(i)
            assert page.get_attribute("#headline", "data-step") == row.get_attribute("data-step")
            assert page.get_attribute("#mem-total", "data-bytes") == row.get_attribute("data-bytes")
            assert "does not fit" not in page.inner_text("#mem-caption")
            with page.expect_download() as dl:
                page.click("#export")
            assert open(dl.value.path()).read() == cli.result()[i], (preset, gpus, i)
    if preset == "llama3-70b":  # the row's stage split is shown read-only, and can be cleared
        rows.nth(0).click()
        page.wait_for_selector('#plan-table[data-loaded="0"]')
        assert page.locator('#extras output[name="parallel.pp_layers"]').count() == 1
        page.screenshot(path=os.path.join(shots, "explore_row_loaded.png"), full_page=True)
        page.click("#extras button.clear")
        page.wait_for_function("document.querySelector('#headline').dataset.step !== "
                               f"'{rows.nth(0).get_attribute('data-step')}'")
        assert page.locator('#extras output').count() == 0


# ------------------------------------------------------------------------- bad input, display fixes

def test_blank_and_malformed_numbers_name_the_field(page, shots):
    page.click("#tab-explorer")
    page.click("text=7B on 8 GPUs")  # a possible layout to start from
    _searched(page)
    err = page.locator('label:has(input[name="gpus"]) .err')
    page.fill('input[name="gpus"]', "")
    err.wait_for()
    assert err.inner_text() == "gpus: required, got a blank value"
    assert page.locator("#outputs.stale").count() == 1 and page.is_disabled("#export")
    page.wait_for_selector("#plan-card.stale")  # the rows belong to the earlier inputs: dimmed, not loadable
    assert page.eval_on_selector("#plan-table", "t => getComputedStyle(t).opacity") == "0.35"
    assert "required" in page.inner_text("#plan-caption")
    page.screenshot(path=os.path.join(shots, "explore_blank_gpus.png"))
    page.click('input[name="gpus"]')
    page.keyboard.type("8-")  # a number input keeps what the browser cannot read as a number
    page.wait_for_function("document.querySelector('label:has(input[name=\"gpus\"]) .err').textContent"
                           " === 'gpus: not a number'")
    page.fill('input[name="data.seq_len"]', "")
    page.fill('input[name="gpus"]', "8")
    seq_err = page.locator('label:has(input[name="data.seq_len"]) .err')
    seq_err.wait_for()
    assert seq_err.inner_text() == "data.seq_len: required, got a blank value"
    page.fill('input[name="data.seq_len"]', "8192")
    page.wait_for_selector("#outputs:not(.stale)")
    page.wait_for_selector("#plan-card:not(.stale)", timeout=60000)
    assert err.inner_text() == "" and seq_err.inner_text() == ""


def test_example_note_stays_until_the_next_change(page, shots):
    page.click("#tab-explorer")
    page.click("text=405B on 128 GPUs")
    page.wait_for_selector('#mem-table[data-model="llama3-405b"][data-gpus="128"]')
    page.wait_for_timeout(2500)  # it used to vanish after about 1.5 s, with the estimate's answer
    assert page.inner_text("#note").startswith("TP=8 + PP=4 + FSDP")
    page.screenshot(path=os.path.join(shots, "explore_note.png"), clip={"x": 0, "y": 0, "width": 1400, "height": 260})
    page.fill('input[name="parallel.pp"]', "8")
    page.wait_for_function("document.querySelector('#note').textContent === ''")
    _searched(page)


def test_usable_memory_label_stays_inside_the_chart(page, shots):
    """llama3-70b on one GPU needs ~16x the usable memory: the limit line sits near the left edge."""
    page.click("#tab-explorer")
    page.click("text=7B on 8 GPUs")
    page.select_option('select[name="model.preset"]', "llama3-70b")
    page.fill('input[name="gpus"]', "1")
    page.wait_for_selector('#mem-table[data-model="llama3-70b"][data-gpus="1"]')
    box = page.eval_on_selector("#mem-bar text.limit", "t => { const b = t.getBBox(); return [b.x, b.x + b.width,"
                                " t.ownerSVGElement.getBoundingClientRect().width]; }")
    assert 0 <= box[0] and box[1] <= box[2], box
    page.locator("#mem-bar").screenshot(path=os.path.join(shots, "explore_usable_label.png"))
    page.fill('input[name="gpus"]', "8")
    _searched(page)


def test_plan_caption_counts_add_up_and_no_row_hint_without_rows(page, shots):
    _set_cluster(page, "llama3-405b", 8)  # nothing fits: no row to click
    caption = page.inner_text("#plan-caption")
    assert "no layout fits" in caption and "click a row" not in caption
    counts = {k: int(page.inner_text(f'#plan-caption [data-count="{k}"]').replace(",", ""))
              for k in ("candidates", "fit", "dominated", "oom", "invalid")}
    assert counts["fit"] + counts["dominated"] + counts["oom"] + counts["invalid"] == counts["candidates"] > 0
    page.locator("#plan-card").screenshot(path=os.path.join(shots, "explore_no_fit.png"))


def test_select_labels_are_not_cut(page, shots):
    """Every option of every select fits its box (the GPU select cut 'H100-SXM-80GB' to 'H100-SXM-80GI')."""
    page.click("#tab-explorer")
    for d in page.locator("#inputs details").all():
        d.evaluate("d => d.open = true")
    # a select is wide enough when it is at least as wide as the browser makes it with width: auto
    # (its longest option, the padding and the arrow)
    cut = page.evaluate("""() => [...document.querySelectorAll('#inputs select')].filter((s) => {
        const w = s.getBoundingClientRect().width, c = s.cloneNode(true);
        c.style.cssText = 'width: auto; min-width: 0; max-width: none; position: absolute';
        document.body.appendChild(c);
        const need = c.getBoundingClientRect().width;
        c.remove();
        return w + 0.5 < need; }).map((s) => s.name)""")
    assert cut == []
    page.locator("#inputs").screenshot(path=os.path.join(shots, "explore_form.png"))


def test_index_html_and_prediction_wording(page, explore):
    base, _, name = explore
    import urllib.request
    with urllib.request.urlopen(base + "index.html", timeout=30) as r:
        assert r.status == 200 and b"<title>meshlm explore</title>" in r.read()
    page.click("#tab-runs")
    page.click(f"#run-list li[data-name='{name}']")
    page.wait_for_selector(f'#chart-loss[data-run="{name}"]')
    caption = page.inner_text("#pred-caption")
    assert caption.startswith("planner: rank 0 of 1 rank, no pipeline") and "only stage" not in caption
    page.click("#tab-explorer")


# ------------------------------------------------------------------------- mixed clusters, the schedule

def _fresh(page, url):
    page.goto(url)
    page.wait_for_selector("#mem-table[data-model]")


def test_mixed_cluster_rows_per_type_facts_and_comparison(page, explore, shots):
    """Issue #51 on the page: the GPU select's "mixed cluster" and its TYPE:COUNT text give the estimate
    per device type, the mixed plan's rows and the verdict against the fastest type alone; a row loads
    exactly; a bad cluster is named next to its input; an example brings the one-type form back."""
    _fresh(page, explore[0])
    assert page.is_hidden('input[name="cluster"]')
    page.select_option('select[name="gpu"]', "mixed")
    err = page.locator('label:has(input[name="cluster"]) .err')
    err.wait_for()
    assert err.inner_text().startswith("gpu: give the cluster as TYPE:COUNT")
    page.fill('input[name="cluster"]', "h100:8,a100-80gb:8")
    page.wait_for_selector('#mem-table[data-mixed][data-gpus="16"]')
    assert page.input_value('input[name="gpus"]') == "16" and page.is_disabled('input[name="gpus"]')
    types = page.locator("#mem-table tr[data-card] td:first-child").all_inner_texts()
    assert types == ["H100-SXM-80GB", "A100-80GB"] and err.inner_text() == ""
    page.wait_for_function("document.querySelector('#plan-caption').textContent.startsWith('meshlm plan (mixed)')")
    rows = page.locator("#plan-table tbody tr[data-i]")
    assert rows.count() == 10
    compare = page.inner_text("#plan-compare")
    alone = float(page.get_attribute("#plan-compare", "data-alone"))
    pays = float(rows.nth(0).get_attribute("data-step")) < alone
    assert page.get_attribute("#plan-compare", "data-pays") == str(pays).lower()
    assert "fastest type alone: 8 × H100-SXM-80GB" in compare and "adding 8 × A100-80GB" in compare
    assert ("(they pay)" in compare) == pays and ("does not pay" in compare) == (not pays)
    assert page.locator("#plan-compare tr[data-card]").count() == 2  # the best row, per device type
    rows.nth(1).click()
    page.wait_for_selector('#plan-table[data-loaded="1"]')
    assert page.get_attribute("#headline", "data-step") == rows.nth(1).get_attribute("data-step")
    assert "fits" in page.inner_text("#mem-caption") and "does not fit" not in page.inner_text("#mem-caption")
    page.screenshot(path=os.path.join(shots, "explore_mixed.png"), full_page=True)
    page.fill('input[name="cluster"]', "h100:8,a100-80gb:x")
    page.wait_for_function("document.querySelector('label:has(input[name=\"cluster\"]) .err').textContent"
                           ".startsWith(\"gpu: 'a100-80gb:x' is not TYPE:COUNT\")")
    assert page.locator("#outputs.stale").count() == 1
    page.wait_for_timeout(800)  # the search answers the same line (and leaves the rows dimmed)
    page.wait_for_selector("#plan-card.stale")
    assert "is not TYPE:COUNT" in page.inner_text("#plan-caption")
    page.click("text=7B on 8 GPUs")
    page.wait_for_selector('#mem-table[data-model="llama3-8b"][data-gpus="8"]:not([data-mixed]) #mem-params')
    assert page.is_hidden('input[name="cluster"]') and page.is_enabled('input[name="gpus"]')
    _searched(page)


def test_schedule_chart_of_a_wsd_run_with_a_ramp_and_bad_values_by_their_fields(page, explore, shots):
    """Issue #53 item 5: the LR and the batch over the run (the server's samples of lr_at and BatchRamp,
    a dashed line at each corner), the run total beside the step time, errors next to their fields."""
    from meshlm.core.facts.ramp import BatchRamp
    _fresh(page, explore[0])
    _searched(page)
    caption = page.inner_html("#plan-caption")
    page.evaluate("window.planRuns = 0; const f = runPlan; runPlan = (...a) => { window.planRuns++; return f(...a); }; 0")
    page.select_option('select[name="optim.schedule"]', "wsd")
    page.fill('input[name="training.steps"]', "100000")
    page.fill('input[name="optim.warmup"]', "2000")
    page.fill('input[name="training.batch_rampup"]', "64, 64, 2000000")
    page.wait_for_selector("#batch-chart polyline.batch")
    page.wait_for_function("document.querySelector('#run-total').textContent.includes('100,000')")
    page.wait_for_timeout(800)  # past the plan's debounce: no layout's price depends on the schedule
    assert page.evaluate("window.planRuns") == 0 and page.inner_html("#plan-caption") == caption
    ramp_end = BatchRamp(512, [64, 64, 2_000_000]).ramp_steps  # 4 Mi tokens / 8192 = 512 sequences
    corners = {c.get_attribute("data-corner"): int(c.get_attribute("data-step"))
               for c in page.locator("#lr-chart line.corner").all()}
    assert corners == {"warmup_end": 1999, "decay_start": 80_000, "ramp_end": ramp_end}
    assert f"ramp: first {ramp_end:,} steps at smaller batches" in page.inner_text("#run-total")
    n = int(page.get_attribute("#lr-chart", "data-points"))
    levels = len(BatchRamp(512, [64, 64, 2_000_000]).levels)  # each batch size's first step, and the one before
    assert 200 <= n <= 200 + 2 * (3 + levels) and page.eval_on_selector("#lr-chart polyline", "p => p.points.length") == n
    for chart in ("#lr-chart", "#batch-chart"):  # drawn inside its box (not cut at the right edge)
        inside = page.eval_on_selector(chart, "s => { const b = s.querySelector('polyline').getBBox(); "
                                              "return b.x >= 0 && b.x + b.width <= s.getBoundingClientRect().width; }")
        assert inside, chart
    first, last = page.eval_on_selector("#batch-chart polyline", "p => [p.points[0].y, p.points[p.points.length - 1].y]")
    assert last < first  # the batch grows: its line rises
    page.locator("#course-card").screenshot(path=os.path.join(shots, "explore_schedule.png"))
    for name, value, words in (("optim.decay_steps", "99000", "optim.decay_steps: the decay (99000 steps) is longer"),
                               ("training.batch_rampup", "64, 60, 1000", "training.batch_rampup: the increment 60")):
        page.fill(f'[name="{name}"]', value)
        err = page.locator(f'label:has([name="{name}"]) .err')
        page.wait_for_function(f"document.querySelector('label:has([name=\"{name}\"]) .err')?.textContent"
                               f".startsWith({json.dumps(words)})")
        assert page.locator("#outputs.stale").count() == 1
        page.fill(f'[name="{name}"]', "0" if name == "optim.decay_steps" else "")
        page.wait_for_selector("#outputs:not(.stale)")
        assert err.inner_text() == ""
    assert page.is_hidden("#batch-chart")  # no ramp: the batch chart goes
