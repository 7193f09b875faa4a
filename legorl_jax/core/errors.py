"""What `legorl` reports as a message alone (exit 1), not a traceback: `InputError`, what the user
fixes, and a full disk (`disk_full`), which every writer meets in its own words."""

from __future__ import annotations

import errno
import re

# How a full disk reads once it has passed through a library: the OS's words (Python, tensorstore and
# orbax quote them), and numpy's `tofile`, which reports a short write without an errno.
_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|\d+ requested and \d+ written")


class InputError(Exception):
    """A model directory, task, config of a model or checkpoint, or engine that cannot be used or started;
    the message says which and why. Each error class keeps its own builtin base as well (ValueError,
    RuntimeError), which is what callers catch."""


def disk_full(exc: BaseException) -> str | None:
    """The error in `exc`'s chain (causes and contexts) that says a disk filled up, shortened; else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        full = isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT)
        text = " ".join(str(current).split())
        words = _DISK_FULL.search(text)
        if full or words:
            if len(text) <= 400:
                return text
            # A library's message can run to kilobytes (tensorstore quotes its whole spec): keep its
            # start, which names the file, and the words that say the disk is full, wherever they are.
            if words is None or words.end() <= 300:
                return f"{text[:300]} ... {text[-100:]}"
            return f"{text[:200]} ... {text[max(200, words.start() - 100) : words.end() + 100]} ..."
        current = current.__cause__ or current.__context__
    return None
