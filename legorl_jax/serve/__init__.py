"""The embedded JAX inference engine behind vLLM's HTTP surface.

protocol (request/response bodies) → app (FastAPI routes) → completions (one
call's engine requests) → engine (continuous batching thread) → scheduling
(packing a step) → step (the jitted device program) → sampling (processed
logprobs, seeded sampling). output turns engine events into choices; loader
builds a running engine from an HF directory and reloads weights; server runs
it under uvicorn on a thread. drain runs any ASGI app under uvicorn with a
bounded drain on SIGTERM (`legorl serve`, `legorl proxy`). `legorl serve` is
legorl_jax.commands.serve_cmd.
"""
