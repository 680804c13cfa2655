"""Run one CI tier and say what it did (issue #60): wall time, tests counted, the share of the machine's
CPU time that was busy while it ran (all processes: the pools' forked ranks are not the runner's children,
so the runner's own rusage undercounts them), and the exit status.

    python .ci/tier.py NAME LOG -- COMMAND...      # COMMAND's output goes to the terminal and to LOG
    python .ci/tier.py --machine                   # the CPU model, meshlm's measured fp32 matmul peak, the loop
    python .ci/tier.py --loop                      # the pure-Python loop's time alone (CI's last line)

Standard library only, except --machine (torch, for the peak). Exit status: COMMAND's.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (iowait counts as idle)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    total = sum(fields[:8])
    return total - idle, total


def counts(text: str) -> str:
    """pytest's closing counts ('1310 passed, 14 skipped, ...'), summed over every run in `text`."""
    found: dict[str, int] = {}
    for line in re.findall(r"^=*\s*(\d+ \w+(?:, \d+ \w+)*)(?: in [\d.]+s)?.*$", text, re.M):
        for n, word in re.findall(r"(\d+) (\w+)", line):
            if word in ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "errors", "deselected"):
                found[word] = found.get(word, 0) + int(n)
    return ", ".join(f"{n} {w}" for w, n in found.items()) or "no pytest summary"


def python_loop() -> str:
    """The best of three timings of a pure-Python loop: most of the suite is bound by the interpreter and
    process start-up, not by matmuls, so this is the CPU's speed to compare machines by. Being the best
    of three, it does not see other work on a shared host (docs/architecture.md, "The test suite")."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        sum(i * i for i in range(6 * 10**6))
        times.append(time.perf_counter() - t0)
    return f"python loop {min(times):.2f} s (sum of i*i, 6M)"


def machine() -> str:
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import torch
    from meshlm.train.observe.metrics import measure_cpu_peak

    peak, _ = measure_cpu_peak()
    return (f"ci: machine: {model}, {os.cpu_count()} cores, torch {torch.__version__} capability "
            f"{torch.backends.cpu.get_cpu_capability()}, peak_flops {peak / 1e9:.0f} GFLOP/s "
            f"(fp32 1024² matmul, {torch.get_num_threads()} threads), {python_loop()}")


def run(name: str, log: str, cmd: list[str]) -> int:
    busy0, total0 = cpu_times()
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        rc = proc.wait()
    wall = time.monotonic() - t0
    busy1, total1 = cpu_times()
    share = (busy1 - busy0) / max(total1 - total0, 1.0)
    with open(log) as f:
        summary = counts(f.read())
    line = (f"ci: tier {name}: {wall // 60:.0f} min {wall % 60:02.0f} s wall, {summary}, CPU busy {share:.0%} "
            f"of {os.cpu_count()} cores, exit {rc}")
    print(line, flush=True)
    with open(f"{log}.summary", "w") as f:  # .ci/run repeats every tier's line at the end
        f.write(line + "\n")
    return rc


if __name__ == "__main__":
    if sys.argv[1:] == ["--machine"]:
        print(machine(), flush=True)
        sys.exit(0)
    if sys.argv[1:] == ["--loop"]:
        print(f"ci: after the tiers: {python_loop()}", flush=True)
        sys.exit(0)
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        sys.exit("usage: tier.py NAME LOG -- COMMAND...")
    sys.exit(run(sys.argv[1], sys.argv[2], sys.argv[4:]))
