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

import pytest

from meshlm.model.args import PRESETS

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="no browser could be installed here: needs Debian's chromium (apt-get install -y chromium; .ci/run "
           "does it) and the playwright package (the dev extra)")]
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _env():
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


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


def test_best_layout_row_loads_and_exports(page):
    page.click("#plan-table tbody tr:first-child")
    row = page.locator("#plan-table tbody tr:first-child td")
    tp = row.nth(5).inner_text().replace("+sp", "")
    page.wait_for_function(f"document.querySelector('#mem-table').dataset.tp === '{tp}'")
    with page.expect_download() as dl:
        page.click("#export")
    text = open(dl.value.path()).read()
    assert f"\ntp = {tp}\n" in text and 'preset = "llama3-70b"' in text


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
