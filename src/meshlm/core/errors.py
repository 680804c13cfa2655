"""The configuration's errors: one line that names the key, raised before any worker starts."""
from __future__ import annotations

from .choices import choose


class ConfigError(ValueError):
    """A configuration problem; its message is one line that names the key."""


class LayoutError(ConfigError):
    """A parallel layout or batch split that does not fit the world size or the model (layout.build_layout's
    checks that need both): another layout can fix it, so parallel.elastic = "replan" may replace it."""


def check_choice(value, allowed, key: str) -> None:
    choose(value, allowed, key, ConfigError)
