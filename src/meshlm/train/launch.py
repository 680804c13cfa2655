"""Starting workers: in-process for one rank, `torch.distributed.run` for --nproc N, or joining an
outside torchrun / Slurm job (RANK / WORLD_SIZE / MASTER_ADDR already in the environment)."""
from __future__ import annotations

import os
import subprocess
import sys

SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def under_launcher() -> bool:
    """True when this process is one rank of a job somebody else started."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # srun started one task per GPU: translate Slurm's variables to torch's.
        for src, dst in SLURM_TO_TORCH.items():
            os.environ.setdefault(dst, os.environ[src])
        os.environ.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("Slurm: set MASTER_ADDR to the first node's hostname in the batch script")
        return True
    return False


def spawn(nproc: int, config_path: str, run_dir: str) -> int:
    """Run `meshlm train` on `nproc` local workers through torchrun; returns its exit status."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={logs}", "--redirects=2", "--tee=2",
           "-m", "meshlm.cli", "train", "--config", config_path, "--run-dir", run_dir, "--worker"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    return subprocess.call(cmd, env=env)
