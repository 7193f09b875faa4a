"""A cache directory built once, safely under concurrent builders.

Each builder fills a private temp directory beside the target and renames it
into place; the first rename wins and the others keep its result. A target
that is there but incomplete (a build interrupted by something outside this
protocol) is replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(target: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """`target`, first made by `build(tmp_dir)` unless `complete(target)` already holds."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another builder got there first, or a stale partial dir sits there
            if not complete(target):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
