#!/bin/bash
# Runs held-out tests against /app/stats.py; the agent never saw them.
mkdir -p /logs/verifier
if python3 /tests/test_stats_hidden.py > /logs/verifier/unittest.log 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
