"""legorl-jax: the learner side of RL for coding agents in real harnesses.

Layers (enforced by the import-linter contracts in pyproject.toml):
`legorl_jax.core` (config, gRPC auth, the weights layout; no jax) is imported by
both the learner (`models`, `rl`, `train`, `serve`, `fleet`) and `rollout_server`;
`cli`, `commands` and `demo` sit on top and may import both sides.
"""
