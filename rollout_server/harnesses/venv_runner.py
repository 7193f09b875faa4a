"""Runs one console script of a read-only virtualenv mounted into a sandbox.

Copied next to the launchers that rollout_server/harnesses/tools.py writes and
run by the venv's own (mounted) interpreter as `python -I -S venv_runner.py LIB
SITE MODULE:ATTR NAME ARGS...`. A venv's `bin/` scripts cannot be used there:
their shebangs name the host interpreter's path. `-I -S` keep the sandbox's
PYTHON* variables and site-packages out, so a task cannot change the harness.
Standard library only: it runs on whatever Python the venv was made with.
"""

from __future__ import annotations

import importlib
import os
import site
import sys
from typing import Any


def main(argv: list[str]) -> int | str | None:
    lib, site_dir, entry, name, *args = argv
    # Only the interpreter needed it to find libpython; the agent's commands must not inherit it.
    if os.environ.get("LD_LIBRARY_PATH") == lib:
        del os.environ["LD_LIBRARY_PATH"]
    site.addsitedir(site_dir)  # with its .pth files, as the venv's own python would
    module, _, attr = entry.partition(":")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    sys.argv = [name, *args]
    return target()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
