#!/bin/bash
# Grades /app/service.ini against the expected file. The checker exits 3 for a wrong
# answer; any other failure means the checker itself broke, so no reward is written.
mkdir -p /logs/verifier
python3 /tests/check_config.py /app/service.ini
case $? in
  0) echo 1 > /logs/verifier/reward.txt ;;
  3) echo 0 > /logs/verifier/reward.txt ;;
  *) echo "checker crashed: leaving the trial ungraded" >&2 ;;
esac
