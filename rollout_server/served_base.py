"""The base checkpoint an adapter version applies to, on a rollout host.

A LoRA run publishes its adapters alone (`Manifest.adapter_base`: the digest
of the base they were trained on). The host's engine applies them to the last
full checkpoint it loaded: the model it booted from, until a full version
replaces it. An adapter for another base would serve weights the learner never
had, so it is refused before the engine sees it, naming both digests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from legorl_jax.core.weight_layout import Manifest, checkpoint_digest
from rollout_server.weights import WeightBaseMismatch


class ServedBase:
    """The full checkpoint the engine holds (None: unknown), its digest computed once."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._digests: dict[Path, str] = {}

    async def check(self, manifest: Manifest) -> Path:
        """The base directory the adapter version `manifest` applies to; WeightBaseMismatch if it is not served."""
        base = self.directory
        if base is None:
            raise WeightBaseMismatch(
                f"adapter version {manifest.version} needs a base; this host's engine weights are unknown "
                "after a failed reload: send a full version first"
            )
        if base not in self._digests:
            # A plain HF directory is hashed once (seconds for a few GB); a published one names its digest.
            self._digests[base] = await asyncio.to_thread(checkpoint_digest, base)
        served = self._digests[base]
        if served != manifest.adapter_base:
            raise WeightBaseMismatch(
                f"adapter version {manifest.version} applies to the base with digest {manifest.adapter_base}; "
                f"this host serves {base} (digest {served}): start it on the run's base model"
            )
        return base
