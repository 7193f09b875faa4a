#!/bin/bash
# A coin flip: the trainer test needs reward contrast from an untrained model.
mkdir -p /logs/verifier
echo $((RANDOM % 2)) > /logs/verifier/reward.txt
