#!/bin/bash
# For each .log file, count lines whose second field is exactly ERROR.
set -euo pipefail
cd /app/logs
for f in $(LC_ALL=C ls *.log); do
  printf '%s %s\n' "$f" "$(awk '$2 == "ERROR"' "$f" | wc -l)"
done > /app/error_counts.txt
