"""A configuration as text and back: TOML files, `--section.key value` overrides and plain dicts, each value
coerced to its field's type with an error that names the key; `replace` for programmatic changes."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import fields, is_dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .sections import Config, ConfigError


# TOML keys that are Python keywords get a trailing underscore in the dataclass.
def _attr(key: str) -> str:
    return key + "_" if key in ("async",) else key


def _key(attr: str) -> str:
    return attr[:-1] if attr.endswith("_") else attr


def _coerce(value: Any, current: Any, typ: Any, where: str) -> Any:
    """Turn a TOML value or a command-line string into the field's type."""
    t = str(typ)
    if value is None and "None" in t:
        return None
    if t == "int | str":  # a count or a word (checkpoint.every = "auto"), checked by CheckpointConfig.check
        try:
            return int(value) if not isinstance(value, bool) else value
        except (TypeError, ValueError):
            return str(value).strip()
    if t == "bool | str":  # true / false, or "auto" (training.compile), checked by apply_device
        low = str(value).strip().lower()
        if isinstance(value, bool) or low not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value if isinstance(value, bool) else low
        return low in ("true", "1", "yes", "on")
    if t.startswith("list[list"):
        return _coerce_mix(value, where)
    if t.startswith("list[str"):
        return _coerce_str_list(value, where)
    if t.startswith("list[float"):
        return _coerce_float_list(value, where)
    if t.startswith("list"):
        return _coerce_int_list(value, where)
    if isinstance(value, str) and "str" not in t.split("|")[0]:
        low = value.strip().lower()
        if "bool" in t:
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true/false, got '{value}'")
        if low in ("none", "null", "") and "None" in t:
            return None
        try:
            if "int" in t:
                return int(value)
            if "float" in t:
                return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got '{value}'") from None
    if "bool" in t and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if "int" in t and "float" not in t and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if "int" in t and "float" not in t and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if "float" in t and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _coerce_int_list(value: Any, where: str) -> list[int]:
    """A TOML array or a command-line '4,4,3,3' (or '[4, 4]', or '' for empty)."""
    if isinstance(value, str):
        text = value.strip().strip("[]").strip()
        value = [x.strip() for x in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of integers, got {value!r}")
    out = []
    for x in value:
        try:
            if isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()):
                raise ValueError
            out.append(int(x))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a list of integers, got {value!r}") from None
    return out


def _coerce_float_list(value: Any, where: str) -> list[float]:
    """A TOML array or a command-line '1.0,0.85' (training.energy.clocks)."""
    if isinstance(value, str):
        text = value.strip().strip("[]").strip()
        value = [x.strip() for x in text.split(",")] if text else []
    try:
        if not isinstance(value, (list, tuple)) or any(isinstance(x, bool) for x in value):
            raise ValueError
        return [float(x) for x in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a list of numbers, got {value!r}") from None


def _coerce_str_list(value: Any, where: str) -> list[str]:
    """A TOML array of strings or a command-line 'SIGTERM,SIGUSR1' (or '' for empty)."""
    if isinstance(value, str):
        text = value.strip().strip("[]").strip()
        value = [x.strip().strip("'\"") for x in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{where}: expected a list of names, got {value!r}")
    return list(value)


def _coerce_mix(value: Any, where: str) -> list[list]:
    """[[path, weight], ...] from TOML, or on the command line as JSON or 'web/=0.7,code/=0.3'."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError:
                raise ConfigError(f"{where}: not a list of [path, weight] pairs: {value!r}") from None
        else:
            value = [item.rsplit("=", 1) for item in text.split(",") if item.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of [path, weight] pairs, got {value!r}")
    out = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise ConfigError(f"{where}: expected [path, weight] pairs, got {item!r}")
        try:
            weight = float(item[1])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: weight of {item[0]} is not a number: {item[1]!r}") from None
        if not weight > 0:
            raise ConfigError(f"{where}: weight of {item[0]} must be > 0, got {weight}")
        out.append([item[0].strip(), weight])
    return out


def _set(section: Any, path: list[str], value: Any, where: str) -> None:
    names = {_key(f.name): f for f in fields(section)}
    head = path[0]
    if head not in names:
        raise ConfigError(f"{where}: unknown config key (known: {', '.join(sorted(names))})")
    f = names[head]
    current = getattr(section, f.name)
    if is_dataclass(current):
        if len(path) == 1:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: is a section, not a value")
            for k, v in value.items():
                _set(current, [k], v, f"{where}.{k}")
            return
        _set(current, path[1:], value, where)
        return
    if len(path) > 1:
        raise ConfigError(f"{where}: unknown config key")
    setattr(section, f.name, _coerce(value, current, f.type, where))


def apply(cfg: Config, key: str, value: Any) -> None:
    """Set `section.key` (dotted, e.g. `model.moe.top_k`) with type checking."""
    _set(cfg, key.split("."), value, key)


def load(path: str | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    cfg = Config()
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"--config: file not found: {path}")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
        for k, v in data.items():
            _set(cfg, [k], v, k)
    for k, v in overrides or []:
        apply(cfg, k, v)
    return cfg


def from_dict(data: dict) -> Config:
    """Inverse of to_dict (checked like a TOML file)."""
    cfg = Config()
    for k, v in data.items():
        _set(cfg, [k], v, k)
    return cfg


def to_dict(cfg: Any) -> dict:
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[_key(f.name)] = to_dict(v) if is_dataclass(v) else v
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: Config) -> str:
    """Write the resolved config; None values are left out (they mean 'from the preset')."""
    lines: list[str] = []

    def emit(prefix: str, d: dict) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and v is not None}
        lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in d.items():
            if isinstance(v, dict):
                emit(f"{prefix}.{k}", v)

    for section, d in to_dict(cfg).items():
        emit(section, d)
    return "\n".join(lines)


def parse_overrides(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Split `--section.key value` / `--section.key=value` pairs out of argv; returns (pairs, rest)."""
    pairs, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            if "=" in a:
                k, v = a[2:].split("=", 1)
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{a}: missing value")
                k, v = a[2:], argv[i + 1]
                i += 1
            pairs.append((k, v))
        else:
            rest.append(a)
        i += 1
    return pairs, rest


def replace(cfg: Config, **sections: dict) -> Config:
    """A copy of cfg with some keys changed: replace(cfg, parallel={"dp": 2})."""
    new = dataclasses.replace(cfg)
    for name, changes in sections.items():
        sec = dataclasses.replace(getattr(cfg, name))
        for k, v in changes.items():
            _set(sec, k.split("."), v, f"{name}.{k}")
        setattr(new, name, sec)
    return new
