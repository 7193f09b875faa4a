#!/bin/bash
# Checks the sorted tree against the verifier's own manifest of the original inbox. The
# checker exits 3 for a wrong answer; any other failure leaves the trial ungraded.
mkdir -p /logs/verifier
python3 /tests/check_sorted.py /tests/manifest.json /app
case $? in
  0) echo 1 > /logs/verifier/reward.txt ;;
  3) echo 0 > /logs/verifier/reward.txt ;;
  *) echo "checker crashed: leaving the trial ungraded" >&2 ;;
esac
