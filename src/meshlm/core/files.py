"""Reading the small JSON files others write (datasets' state, transformers' shard index) with one line that
names the file when it is not what it should be, instead of a traceback from inside json."""
from __future__ import annotations

import json


def json_field(path: str, key: str, what: str):
    """`key` of the JSON object in the file at `path`; a ValueError "PATH: not WHAT (why)" otherwise."""
    try:
        with open(path) as f:
            return json.load(f)[key]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not {what} ({e})") from None
