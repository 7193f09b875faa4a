"""Adapter versions served by name (vLLM's LoRA path, `--enable-lora`).

Each adapter version of a LoRA run is loaded under its own name, `v{version}`,
and new requests name the newest. A request is sampled from its first token
to its last by the adapter it named, so all its tokens carry that adapter's
version, whatever label the engine gives its base weights. An older adapter
is unloaded at a later update once no request in flight names it. A restarted
vLLM is launched with the current one (`--lora-modules`, `vllm_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from legorl_jax.core.weight_layout import read_manifest
from rollout_server.backends.client import EngineClient, EngineError

log = logging.getLogger(__name__)


def adapter_name(version: int) -> str:
    return f"v{version}"


def installed_adapter(weights_dir: str | Path | None) -> Adapter | None:
    """The adapter version in `weights_dir`, if it holds one (a LoRA run's published version)."""
    manifest = None if weights_dir is None else read_manifest(Path(weights_dir))
    if manifest is None or manifest.adapter_base is None:
        return None
    return Adapter(adapter_name(manifest.version), manifest.version)


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str
    version: int


class AdapterRoute:
    """Which adapter new requests name (None: the base), and which ones requests still use."""

    def __init__(self) -> None:
        self.current: Adapter | None = None
        self._loaded: set[str] = set()
        self._in_flight: Counter[str] = Counter()

    @contextmanager
    def use(self) -> Iterator[Adapter | None]:
        """The adapter a request names, held as in use until it is answered."""
        adapter = self.current
        if adapter is not None:
            self._in_flight[adapter.name] += 1
        try:
            yield adapter
        finally:
            if adapter is not None:
                self._in_flight[adapter.name] -= 1

    async def load(self, engine: EngineClient, version: int, directory: Path) -> Adapter:
        """Loads `directory` as version `version`'s adapter; requests name it only once `serve` says so."""
        adapter = Adapter(adapter_name(version), version)
        if adapter.name in self._loaded:  # a version published again (a resumed run): vLLM refuses a known name
            await engine.unload_adapter(adapter.name)
            self._loaded.discard(adapter.name)
        await engine.load_adapter(adapter.name, str(directory))
        self._loaded.add(adapter.name)
        return adapter

    async def serve(self, engine: EngineClient, adapter: Adapter) -> None:
        """New requests name `adapter`; the others no request uses any more are unloaded."""
        self.current = adapter
        for name in sorted(self._loaded - {adapter.name}):
            if self._in_flight[name] == 0:
                self._loaded.discard(name)
                try:
                    await engine.unload_adapter(name)
                except EngineError as exc:  # an engine restarted since has none of them: nothing to unload
                    log.warning("unloading adapter %s: %s", name, exc)
