"""Lone surrogates in request text, read as U+FFFD.

JSON can escape half of a UTF-16 pair (`"\\ud83d"`), and JS harnesses send
one whenever they cut text by UTF-16 units; Python's `json` keeps it as a
code point no tokenizer or UTF-8 encoder takes. The providers' APIs read it
as U+FFFD, and so do the proxy (`rollout_server/proxy/jsonio.harness_loads`)
and the engine's text inputs (`legorl_jax/serve`).
"""

from __future__ import annotations

import re
from typing import Any

# `json.loads` joins every escaped pair into one character, so any surrogate left is lone.
_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_lone_surrogates(value: Any) -> Any:
    """`value` with each lone surrogate in its strings and keys (through lists and dicts) replaced by U+FFFD."""
    if isinstance(value, str):
        return value if value.isascii() else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_lone_surrogates(v) for v in value]
    return value
