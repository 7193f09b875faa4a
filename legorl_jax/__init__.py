"""legorl-jax: the learner side of RL for coding agents in real harnesses."""

__version__ = "0.1.0"
