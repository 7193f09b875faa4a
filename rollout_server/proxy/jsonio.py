"""JSON on the proxy's hot path: orjson, with the standard library behind it.

Every model call parses the harness's body (the whole conversation, which
grows every turn), serialises the engine request (the prompt as token ids)
and the answer, and parses the engine's reply; orjson does each in a
fraction of `json`'s time (docs/benchmarks.md).

`loads` answers as `json.loads` does on UTF-8, except that anything else
no sender can mean is a `ValueError` too, never another exception: a lone
surrogate (no Unicode character; the chat template's splice marks are
made of them), nesting past Python's recursion limit, an integer past
its digit limit. Whatever orjson refuses goes to `json`, whose verdict
is final: NaN/Infinity literals (an engine's -Infinity logprob is caught
by the finiteness checks downstream, not as a malformed body), lone
surrogates, nesting past orjson's limit. orjson reads integers past 64
bits as floats without a word, which would change tool arguments that
sampled turns are matched by: a body with a run of 19 or more digits
anywhere (such an integer has one; so may a string, which only costs the
slower path) goes to `json` too.

`harness_loads` is `loads` for what a harness sends: JS CLIs slice text by
UTF-16 units and send the half pair that a cut leaves (as a `\\ud83d`
escape), which their providers take as U+FFFD; so does the proxy
(`legorl_jax/core/surrogates.py`, shared with the engine's text inputs).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import orjson
from starlette.responses import JSONResponse

from legorl_jax.core.surrogates import replace_lone_surrogates

# 18 digits always fit in 64 bits; 19 may not (2**63 has 19). Found by mapping
# every digit to "0" and searching for 19 of them, much faster than a regex.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19
# How a lone surrogate gets into JSON text (valid UTF-8 cannot carry one); also
# matches an escaped backslash before "ud800", which the check then clears.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class LoneSurrogateError(ValueError):
    """JSON text holding half a UTF-16 surrogate pair."""


def loads(raw: bytes) -> Any:
    if raw.translate(_DIGITS_TO_ZERO).find(_LONG_RUN) < 0:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:  # a subclass of json.JSONDecodeError: json's verdict is final
            pass
    text = raw.decode()  # strict: `json` would let encoded surrogates through
    try:
        value = json.loads(text)
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(value, ensure_ascii=False).encode()  # raises on a lone surrogate, key or value
    except json.JSONDecodeError:
        raise
    except UnicodeEncodeError as exc:
        raise LoneSurrogateError(
            f"a lone surrogate ({exc.object[exc.start : exc.end]!r}) is no Unicode character"
        ) from None
    except ValueError:  # int() past its digit limit
        raise ValueError(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise ValueError("it nests too deeply") from None
    return value


def harness_loads(raw: bytes) -> Any:
    """`loads`, with each lone surrogate (in a key or a value) read as U+FFFD."""
    try:
        return loads(raw)
    except LoneSurrogateError:
        return replace_lone_surrogates(json.loads(raw.decode()))


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, non-ASCII kept as is (what Starlette's JSONResponse
    writes); a lone surrogate (which `json.loads` accepts) has no UTF-8 form,
    so a value holding one is written with escapes."""
    try:
        return orjson.dumps(value)
    except TypeError:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


class FastJSONResponse(JSONResponse):
    """Starlette's JSONResponse, serialised by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
