"""Prints reward.json: reward 1 when the report matches the pristine logs exactly."""

import json
import sys
from pathlib import Path

pristine, report = Path(sys.argv[1]), Path(sys.argv[2])
expected = [
    f"{log.name} {sum(1 for line in log.read_text().splitlines() if line.split(' ', 2)[1:2] == ['ERROR'])}"
    for log in sorted(pristine.glob("*.log"))
]
# Only a small regular UTF-8 file is a report: a FIFO, device, directory or huge file is none.
actual = None
if report.is_file():  # checked before open(): opening a FIFO would hang
    try:
        with report.open("rb") as fh:
            data = fh.read(65537)
        actual = data.decode("utf-8").strip().splitlines() if len(data) <= 65536 else None
    except (OSError, UnicodeDecodeError):
        actual = None
matched = actual is not None and [line.strip() for line in actual] == expected
print(json.dumps({"reward": 1.0 if matched else 0.0, "report_found": actual is not None}))
