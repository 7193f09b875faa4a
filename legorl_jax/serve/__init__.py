"""The embedded JAX inference engine behind vLLM's HTTP surface.

protocol (request/response bodies) → app (FastAPI routes) → completions (one
call's engine requests) → engine (continuous batching thread) → scheduling
(packing a step) → step (the jitted device program) → sampling (processed
logprobs, seeded sampling). output turns engine events into choices; loader
builds a running engine from an HF directory and reloads weights; server runs
it under uvicorn. `legorl serve` is legorl_jax.commands.serve_cmd.
"""
