"""The package version, reported by `legorl --version` and by rollout servers in `Health`."""

__version__ = "0.1.0"
