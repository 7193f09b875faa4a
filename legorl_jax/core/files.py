"""`replace_text`: a file's new contents in place of its old all at once, or not at all."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write `text` to a sibling temp file and rename it over `path`: a write that fails half-way
    (a full disk, a kill) leaves the old contents, where writing in place would have cut them."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
