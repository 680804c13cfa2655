"""Resolve a config against a world size: the mesh degrees and the batch split (`Layout`, degrees.py), and
the checks that need both (degrees against the model shape and each other: checks.py; run in order by
build.py). A section's own keys are checked beside them (core/config/sections.py, `Config.check`); the
model arguments come from core/config/model.py."""
from __future__ import annotations

from ..config.model import model_args
from .checks import check_cp, check_ep, check_rampup, check_shape, check_zeropp
from .degrees import Layout, batch_split, fp8_comm_in_use, from_config, weighted_accums
from .build import build_layout

__all__ = ["Layout", "batch_split", "check_cp", "check_ep", "check_rampup", "check_shape", "check_zeropp",
           "build_layout", "fp8_comm_in_use", "from_config", "model_args", "weighted_accums"]
