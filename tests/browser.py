"""A real headless Chromium for the explorer's tests (Debian's `chromium`, driven by playwright without a
browser download): where it is, its flags, and a page on a fresh `meshlm explore` server."""
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def env():
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


@contextlib.contextmanager
def explorer_page(runs_dir, timeout_ms: int = 120000):
    """(page, page errors) of a fresh `meshlm explore --runs runs_dir` in a headless Chromium, for a test
    that needs its own server; the browser and the server go when the block ends."""
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "explore", "--port", "0", "--runs", str(runs_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        url = proc.stdout.readline().split()[2]
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(tempfile.mkdtemp(prefix="chromium-"), executable_path=CHROMIUM,
                                                       headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000})
            pg = ctx.new_page()
            pg.set_default_timeout(timeout_ms)
            errors: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.goto(url)
            yield pg, errors
            ctx.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
