"""Prints reward.json: reward 1 when the report matches the pristine logs exactly."""
import json
import sys
from pathlib import Path

pristine, report = Path(sys.argv[1]), Path(sys.argv[2])
expected = [
    f"{log.name} {sum(1 for line in log.read_text().splitlines() if line.split(' ', 2)[1:2] == ['ERROR'])}"
    for log in sorted(pristine.glob("*.log"))
]
try:
    actual = report.read_text().strip().splitlines()
except OSError:
    actual = None
matched = actual is not None and [line.strip() for line in actual] == expected
print(json.dumps({"reward": 1.0 if matched else 0.0, "report_found": actual is not None}))
