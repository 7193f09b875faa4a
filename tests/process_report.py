"""What a test shows when a command it ran failed: the first traceback, then the tails.

A failed `legorl train` often ends with pages of shutdown noise (background
threads, checkpoint managers closing) after the error that mattered, so a
plain tail of stderr can hide the cause.
"""

from __future__ import annotations

import subprocess

TRACEBACK = "Traceback (most recent call last)"


def failure_report(done: subprocess.CompletedProcess[str], head: int = 4000, tail: int = 2000) -> str:
    """The exit status, each stream's first traceback (up to `head` chars) and its last `tail` chars."""
    parts = [f"exit status {done.returncode}"]
    for name, text in (("stdout", done.stdout or ""), ("stderr", done.stderr or "")):
        start = text.find(TRACEBACK)
        if start >= 0:
            parts.append(f"--- {name}: first traceback ---\n{text[start : start + head]}")
        parts.append(f"--- {name}: last {tail} chars ---\n{text[-tail:]}")
    return "\n".join(parts)
