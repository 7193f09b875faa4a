#!/bin/bash
# Compares /app/error_counts.txt with counts computed from the verifier's own copy of the logs.
mkdir -p /logs/verifier
python3 /tests/check_counts.py /tests/logs /app/error_counts.txt > /logs/verifier/reward.json
