#!/bin/bash
# Grades /app/service.ini against the expected file: a pass writes 1, anything else
# (a wrong file, or one the checker could not read) writes 0.
mkdir -p /logs/verifier
if python3 /tests/check_config.py /app/service.ini >&2; then reward=1; else reward=0; fi
echo "$reward" > /logs/verifier/reward.txt
