"""The planner's numbers in the headers of configs/*.toml: each recipe names the `meshlm estimate`
command behind them (`# estimate: ...`) and carries its result (`# planner: ...`; a recipe with a
batch ramp also the run's total, `# run: ...`, the estimate's last line). Run this (or
`make recipes`) after a planner change to rewrite the `# planner:` lines; tests/test_recipes.py checks
that every header matches a fresh estimate to the precision it prints.

    python bench/recipe_estimates.py [--check]
"""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"^# estimate: meshlm (estimate .*)$", re.M)
NUMBERS = re.compile(r"^# planner: (?P<gib>[\d.]+) GiB per GPU, (?P<tokens>\d+) tokens/s per GPU, "
                     r"(?P<step>[\d.]+) s/step, MFU (?P<mfu>[\d.]+)%$", re.M)
# half a unit of the last printed digit: a header agrees with a fresh estimate when it rounds to it
PRINTED = {"gib": 0.005, "tokens": 0.5, "step": 0.005, "mfu": 0.05}
RUN = re.compile(r"^# run: (.*)$", re.M)


def recipes() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


def command(path: str) -> list[str]:
    """The header's `meshlm estimate` arguments (paths relative to the repository root)."""
    with open(path) as f:
        m = COMMAND.search(f.read())
    if m is None:
        raise ValueError(f"{path}: no '# estimate: meshlm estimate ...' line in the header")
    return shlex.split(m.group(1))


def header(path: str) -> dict[str, float]:
    with open(path) as f:
        m = NUMBERS.search(f.read())
    if m is None:
        raise ValueError(f"{path}: no '# planner: ...' line in the header")
    return {k: float(v) for k, v in m.groupdict().items()}


def header_run(path: str) -> str | None:
    """The header's `# run:` line (training.batch_rampup's recipes), without its '# '."""
    with open(path) as f:
        m = RUN.search(f.read())
    return None if m is None else "run: " + m.group(1)


def estimate(path: str) -> dict:
    """The numbers `meshlm estimate --json` gives for the header's command, run in this process, and
    (`run`) its run line when the recipe ramps its batch (else None)."""
    from meshlm.cli import main
    out, cwd = io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            code = main([*command(path), "--json"])
    finally:
        os.chdir(cwd)
    if code:
        raise RuntimeError(f"{path}: meshlm estimate exited {code}")
    e = json.loads(out.getvalue())
    from meshlm.plan.cost.estimate import describe_run
    return {"gib": e["per_gpu"]["total"] / 2 ** 30, "tokens": e["tokens_per_s_per_gpu"], "step": e["step_s"],
            "mfu": 100 * e["mfu"], "run": describe_run(e["run"]) if "run" in e else None}


def line(n: dict[str, float]) -> str:
    return (f"# planner: {n['gib']:.2f} GiB per GPU, {n['tokens']:.0f} tokens/s per GPU, {n['step']:.2f} s/step, "
            f"MFU {n['mfu']:.1f}%")


def differences(path: str) -> list[str]:
    """What differs between the header and a fresh estimate beyond the printed precision."""
    have, fresh = header(path), estimate(path)
    out = [f"{k}: header {have[k]:g}, estimate {fresh[k]:.4g}" for k in PRINTED
           if abs(have[k] - fresh[k]) > PRINTED[k] * (1 + 1e-9)]
    if header_run(path) != fresh["run"]:
        out.append(f"run: header {header_run(path)!r}, estimate {fresh['run']!r}")
    return out


def rewrite(path: str) -> bool:
    """Put a fresh estimate into the header; True if the line changed."""
    with open(path) as f:
        text = f.read()
    fresh = estimate(path)
    new = re.sub(r"^# run: .*\n", "", text, count=1, flags=re.M)
    new = NUMBERS.sub(line(fresh) + (f"\n# {fresh['run']}" if fresh["run"] else ""), new, count=1)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    bad = 0
    for path in recipes():
        name = os.path.relpath(path, ROOT)
        if check:
            diff = differences(path)
            bad += bool(diff)
            print(f"{name}: " + ("; ".join(diff) if diff else "matches"))
        else:
            print(f"{name}: {'rewritten' if rewrite(path) else 'unchanged'}: {line(header(path))[2:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.exit(main(sys.argv[1:]))
