"""What the learner and the rollout host share, importing neither side nor jax:
the run config, gRPC auth, the published-weights layout and delta format,
safetensors I/O, name registries, asyncio helpers, `build_once` and the version."""
