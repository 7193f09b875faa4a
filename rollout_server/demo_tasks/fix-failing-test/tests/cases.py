"""Held-out cases for /app/stats.py, and the runner that calls the agent's code on them.

`python3 cases.py APP_DIR` runs as the unprivileged agent user (see test.sh) and
prints one JSON line: what each call returned or raised, and whether it changed
its input. Nothing here decides the reward: check.py compares that output with
its own answers, so agent code that exits early, fakes an exit status or
prints garbage simply fails the comparison.
"""

import json
import sys

# (function, argument): more cases than the visible suite, and the original API intact.
CASES = [
    ("median", [4, 1, 3, 2]),
    ("median", [10, 0]),
    ("median", [1.5, 2.5, 3.5, 4.5, 5.5, 6.5]),
    ("median", [5]),
    ("median", [9, 7, 8, 1, 2]),
    ("median", [3, 1, 2, 4]),
    ("median", []),
    ("mean", [1, 2, 3, 4]),
    ("mean", []),
]


def observe(module, name, argument):
    values = list(argument)
    try:
        result = getattr(module, name)(values)
    except Exception as exc:  # the agent's code may raise anything; the name is what is compared
        return {"raised": type(exc).__name__}
    return {"returned": result, "input_after": values}


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    import stats

    print(json.dumps([observe(stats, name, argument) for name, argument in CASES], default=repr))
