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

WRONG = 3  # exit status for "graded, wrong answer"; a crash exits 1 and leaves the trial ungraded

try:
    actual = Path(sys.argv[1]).read_text()
except FileNotFoundError:
    print(f"{sys.argv[1]} is missing", file=sys.stderr)
    sys.exit(WRONG)
if actual.strip() != EXPECTED.strip():
    print("service.ini differs from the expected configuration", file=sys.stderr)
    sys.exit(WRONG)
print("service.ini is correct")
