"""Exit 0 when every original file sits, unchanged, in sorted/<ext>/ and the inbox is empty; 3 otherwise."""

import json
import sys
from pathlib import Path

manifest = json.loads(Path(sys.argv[1]).read_text())
app = Path(sys.argv[2])
problems = []
for name, content in manifest.items():
    ext = name.rsplit(".", 1)[1].lower() if "." in name else "none"
    target = app / "sorted" / ext / name
    # is_file() first: a FIFO or device there must not hang or flood the read.
    if not target.is_file() or target.open("rb").read(len(content) + 1) != content.encode():
        problems.append(f"{name} not found unchanged at {target}")
inbox = app / "inbox"
if inbox.exists() and any(inbox.iterdir()):
    problems.append("inbox is not empty")
present = {p.name for p in (app / "sorted").rglob("*") if p.is_file()} if (app / "sorted").is_dir() else set()
if present - set(manifest):
    problems.append(f"unexpected files in sorted/: {sorted(present - set(manifest))}")
print("\n".join(problems) or "all files sorted")
sys.exit(3 if problems else 0)
