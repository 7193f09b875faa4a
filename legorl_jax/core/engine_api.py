"""Names of the engine's HTTP control surface (vLLM's, which the embedded
engine serves too), shared by the engine and its clients on rollout hosts."""

from typing import Literal

# How POST /pause treats requests in flight: abort them, let them finish, or hold them until /resume.
PauseMode = Literal["abort", "wait", "keep"]
