#!/bin/bash
# Checks the sorted tree against the verifier's own manifest of the original inbox: a
# pass writes 1, anything else (a wrong tree, or one the checker could not read) writes 0.
mkdir -p /logs/verifier
if python3 /tests/check_sorted.py /tests/manifest.json /app >&2; then reward=1; else reward=0; fi
echo "$reward" > /logs/verifier/reward.txt
