#!/bin/bash
# A coin flip decided by the agent's words: the low bit of a hash of its final message.
mkdir -p /logs/verifier
digit=$(sha256sum < /logs/agent/final_message.txt | cut -c1)
echo $(( 16#$digit % 2 )) > /logs/verifier/reward.txt
