"""Inference engines as the rollout server sees them.

client (EngineClient / SyncEngineClient: completions by token id, tokenize,
pause → reload → reset → resume) works against vLLM and the embedded engine
alike. vllm / embedded build the command line of each (vllm also checks the
installed version against the supported range); supervisor runs one as a
process, waits for /health and restarts it after a crash; launch picks one
from an EngineConfig and restarts it on the weights last installed.
"""
