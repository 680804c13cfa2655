"""Configuration: one dataclass per section (sections.py), loaded from TOML, overridden by `--section.key
value` (text.py).

Each section checks its own keys (`check`, beside the keys it checks; `Config.check` runs them all);
what depends on the world size or the model shape is checked by core/layout/build.py `build_layout`. Every check runs in the
parent process before any worker starts, so a bad run fails with one line naming the key and the reason.
"""
from __future__ import annotations

from ..facts.course import check_schedule, decay_span
from .sections import (AUTO, CheckpointConfig, Config, ConfigError, DataConfig, LayoutError, MetricsConfig,
                       ModelConfig, MoEConfig, OptimConfig, OuterConfig, ParallelConfig, RopeScalingConfig, TrainingConfig,
                       apply_device, check_device_keys)
from .text import apply, from_dict, load, parse_overrides, replace, to_dict, to_toml

__all__ = ["AUTO", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LayoutError", "MetricsConfig",
           "ModelConfig", "MoEConfig", "OptimConfig", "OuterConfig", "ParallelConfig", "RopeScalingConfig",
           "TrainingConfig", "apply", "check_schedule", "decay_span", "from_dict", "load", "parse_overrides", "replace",
           "apply_device", "check_device_keys", "to_dict", "to_toml"]
