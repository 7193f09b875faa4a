"""A weights-only rollout host: the real `RolloutService` weight handlers
(UpdateWeights, StreamWeights with relays, GetStatus) over an engine that
holds the weights in host memory (and so computes no probe logprobs: the
served-weights check is off). Tests and `scripts/bench_weight_sync.py`
run fleets of these as processes, without GPUs, sandboxes or tasks; they
run no trials (a Rollout call fails with INTERNAL).

    python -m rollout_server.weight_host --root DIR [--weights-root DIR ...] [--address 127.0.0.1:0]

prints the address it listens on, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np

from legorl_jax.core.grpc_auth import SERVER_KEEPALIVE_OPTIONS
from legorl_jax.core.weight_layout import read_tensors
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.client import EngineClient
from rollout_server.service import RolloutService, ServiceLimits
from rollout_server.trial import TrialHost


class MemoryEngine:
    """Stands in for an engine: a reload reads every tensor of the directory
    into host memory, as a real engine reads them into its device."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.loaded: Path | None = None

    async def update_weights(self, weights_path: str, mode: str = "keep", version: str | None = None) -> dict[str, Any]:
        self.tensors = await asyncio.to_thread(read_tensors, Path(weights_path))
        self.loaded = Path(weights_path)
        return {}

    async def healthy(self) -> bool:
        return True


async def start(
    root: Path, address: str = "127.0.0.1:0", weights_roots: Iterable[Path] = (), base: Path | None = None
) -> tuple[grpc.aio.Server, str, RolloutService]:
    """A started weights-only server keeping weights under `root`, taking UpdateWeights
    local locations inside `weights_roots`, adapter versions on `base`: (server, address, service)."""
    # Trials never run here (no tasks, no sandboxes): only the policy version of the host is used.
    host = TrialHost(
        sandboxes=None,  # type: ignore[arg-type]
        sessions=None,  # type: ignore[arg-type]
        proxy_port=0,
        model_name="weights-only",
        policy_version=0,
    )
    # Its engine computes nothing, so it has no logprobs for the served-weights probe.
    service = RolloutService(
        host,
        cast(EngineClient, MemoryEngine()),
        {},
        root,
        ServiceLimits(capacity=1, weights_idle_timeout_s=30.0),
        weights_roots=weights_roots,
        check_probe=False,
        base_weights=base,
    )
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20), *SERVER_KEEPALIVE_OPTIONS])
    pb_grpc.add_RolloutServiceServicer_to_server(service, server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, f"{address.rsplit(':', 1)[0]}:{port}", service


async def _serve(root: Path, address: str, weights_roots: list[Path]) -> None:
    server, bound, _ = await start(root, address, weights_roots)
    print(bound, flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="where received weights are kept")
    parser.add_argument(
        "--weights-root", type=Path, action="append", default=[], help="where UpdateWeights locations may point"
    )
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(_serve(args.root, args.address, args.weights_root))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
