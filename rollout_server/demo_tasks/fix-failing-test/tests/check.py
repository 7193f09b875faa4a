"""Prints reward.json from what cases.py observed of the agent's code (runs as root).

Each case must return the right number without changing its input, and an
empty list must raise ValueError, as the original API did.
"""

import json
import math
import sys

from cases import CASES


def expected(name, argument):
    if not argument:
        return {"raised": "ValueError"}
    ordered = sorted(argument)
    middle = len(ordered) // 2
    if name == "mean":
        value = sum(argument) / len(argument)
    elif len(ordered) % 2:
        value = ordered[middle]
    else:
        value = (ordered[middle - 1] + ordered[middle]) / 2
    return {"returned": value, "input_after": list(argument)}


def matches(seen, want):
    if not isinstance(seen, dict) or set(seen) != set(want):
        return False
    if "raised" in want:
        return seen["raised"] == want["raised"]
    value = seen["returned"]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isclose(value, want["returned"]) and seen["input_after"] == want["input_after"]


def observed(path):
    """The runner's last output line as a list, or None: output it never finished is no answer."""
    try:
        with open(path, "rb") as fh:
            lines = fh.read(100_000).decode("utf-8").strip().splitlines()
        seen = json.loads(lines[-1])
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return None
    return seen if isinstance(seen, list) and len(seen) == len(CASES) else None


seen = observed(sys.argv[1])
passed = 0 if seen is None else sum(matches(s, expected(n, a)) for s, (n, a) in zip(seen, CASES, strict=False))
print(json.dumps({"reward": 1.0 if passed == len(CASES) else 0.0, "cases_passed": passed}))
