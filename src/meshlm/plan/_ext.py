"""Load pure-Python modules of other meshlm packages without running those packages' __init__.

`meshlm.parallel` imports torch in its __init__ (and torch imports torch.distributed), which plan/
must not do. Its leaf modules `parallel/pipeline/*.py` (the schedules and the simulator) are plain
Python, so they are loaded here under a private package name
whose search path is their directory: relative imports between them keep working, and the real
packages stay untouched.
"""
from __future__ import annotations

import importlib
import os
import sys
import types

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(subdir: str, module: str):
    """meshlm/<subdir>/<module>.py, imported as meshlm.plan._ext_<subdir>.<module>."""
    pkg = "meshlm.plan._ext_" + subdir.replace("/", "_")
    if pkg not in sys.modules:
        mod = types.ModuleType(pkg)
        mod.__path__ = [os.path.join(_SRC, *subdir.split("/"))]
        mod.__package__ = pkg
        sys.modules[pkg] = mod
    return importlib.import_module(f"{pkg}.{module}")
