"""`make test-isa`: the precision-sensitive tests (marker `isa`) under every CPU kernel family torch offers
on this machine (issue #45). bf16 and fp8 results depend on the order the kernels accumulate in, which
follows the instruction set: ATen's vectorised ops (ATEN_CPU_CAPABILITY) and oneDNN's matmuls
(ONEDNN_MAX_CPU_ISA; AMX tiles, AVX-512 brgemm, or no oneDNN bf16 at all below AVX-512, where torch falls
back to its own kernels). A bound measured on one of them held on the others only by luck before.

Each row is probed first in a fresh interpreter (torch.backends.cpu.get_cpu_capability() and oneDNN's
verbose line for one bf16 matmul), since both variables only lower what the CPU has: a row the CPU cannot
honour is skipped with the reason printed, and a row that would run the same kernels as an earlier one
is skipped as a duplicate. Exit status: non-zero if any row ran and failed, or if no row ran at all.

    python tests/isa_matrix.py [--skip ROW]... [pytest args...]

`--skip native` is what CI passes (.ci/run): the native row is the machine's defaults, under which
`make test` and `make test-slow` have just run every `isa` test; its kernels still count for the
duplicate check, so a row that would run the same kernels again is skipped as before.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (row, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, the capability torch must report). The first row is the
# machine's own defaults (on an AMX CPU: AMX tiles for bf16 matmuls).
ROWS = [
    ("native", None, None, None),
    ("avx512", "avx512", "AVX512_CORE", "AVX512"),
    ("avx2", "avx2", "AVX2", "AVX2"),
]

PROBE = """
import torch
a = torch.ones(64, 64, dtype=torch.bfloat16)
(a @ a).sum().item()
print("capability", torch.backends.cpu.get_cpu_capability(), flush=True)
from meshlm.core.process import exit_frozen
exit_frozen(0)
"""


def probe(env: dict) -> tuple[str, str]:
    """(torch's CPU capability, what runs a bf16 matmul: oneDNN's implementation or ATen's fallback)."""
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "ONEDNN_VERBOSE": "1"}, capture_output=True,
                         text=True, check=True).stdout
    cap = re.search(r"^capability (\S+)", out, re.M).group(1)
    impl = re.search(r"primitive,exec,cpu,matmul,([^,]+)", out)
    isa = re.search(r"info,cpu,isa:(.*)", out)
    return cap, (f"oneDNN {impl.group(1)} ({isa.group(1).strip()})" if impl else "ATen's own bf16 matmul")


def main(argv: list[str]) -> int:
    skip = set()
    while argv[:1] == ["--skip"] and len(argv) > 1:
        if argv[1] not in {r[0] for r in ROWS}:
            print(f"isa: --skip {argv[1]}: no such row (rows: {', '.join(r[0] for r in ROWS)})", flush=True)
            return 2
        skip.add(argv[1])
        argv = argv[2:]
    seen: dict[tuple, str] = {}
    results = []
    for name, aten, onednn, want in ROWS:
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
        env.update({k: v for k, v in (("ATEN_CPU_CAPABILITY", aten), ("ONEDNN_MAX_CPU_ISA", onednn)) if v})
        cap, matmul = probe(env)
        if want is not None and cap != want:
            print(f"isa: {name}: skipped, this CPU lacks it (torch reports capability {cap}, not {want})", flush=True)
            continue
        if (cap, matmul) in seen:
            print(f"isa: {name}: skipped, the same kernels as row {seen[cap, matmul]} ({cap}, {matmul})", flush=True)
            continue
        seen[cap, matmul] = name
        if name in skip:
            print(f"isa: {name}: skipped as asked (--skip; capability {cap}, bf16 matmul by {matmul})", flush=True)
            continue
        print(f"isa: {name}: capability {cap}, bf16 matmul by {matmul}", flush=True)
        start = time.monotonic()
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "isa", *argv], env=env, cwd=ROOT).returncode
        results.append((name, cap, rc, time.monotonic() - start))
    print("isa: summary")
    for name, cap, rc, took in results:
        print(f"isa:   {name:8s} {cap:8s} {'passed' if rc == 0 else f'FAILED (pytest exit {rc})'} in {took:.0f} s")
    ran_none = not results and not skip  # every row skipped as asked is not a failure
    return 1 if ran_none or any(rc for _, _, rc, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
