"""Exact expected content: only [server] port and debug change; [storage] debug stays true."""

import sys
from pathlib import Path

EXPECTED = """# Service settings; read at start-up.
[server]
host = 0.0.0.0
port = 9090
debug = false
workers = 4

[storage]
path = /var/lib/service
debug = true
"""

WRONG = 3  # exit status for a wrong answer

# Only a small regular UTF-8 file can be right: a FIFO, device, directory or huge file is wrong.
path = Path(sys.argv[1])
if not path.is_file():
    print(f"{path} is missing or not a regular file", file=sys.stderr)
    sys.exit(WRONG)
with path.open("rb") as fh:
    actual = fh.read(len(EXPECTED.encode()) + 64).decode("utf-8", errors="replace")
if actual.strip() != EXPECTED.strip():
    print("service.ini differs from the expected configuration", file=sys.stderr)
    sys.exit(WRONG)
print("service.ini is correct")
