"""Resolve a config against a world size: the mesh degrees and the batch split (`Layout`, degrees.py), and
the checks that need both (degrees against the model shape and each other: checks.py; run in order by
resolve.py). A section's own keys are checked beside them (config/sections.py, `Config.check`); the
model arguments come from model/from_config.py."""
from __future__ import annotations

from ..model.from_config import model_args
from .checks import check_cp, check_ep, check_rampup, check_shape, check_zeropp
from .degrees import Layout, batch_split, fp8_comm_in_use, from_config, weighted_accums
from .resolve import device_defaults, resolve

__all__ = ["Layout", "batch_split", "check_cp", "check_ep", "check_rampup", "check_shape", "check_zeropp",
           "device_defaults", "fp8_comm_in_use", "from_config", "model_args", "resolve", "weighted_accums"]
