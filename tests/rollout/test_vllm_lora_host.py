"""A rollout host on the real vLLM (set-up's CPU build, `--enable-lora`) applying a LoRA
run's adapter versions in turn: each published as the adapter alone, loaded under its own
name (`rollout_server.backends.adapters`), probed through it, and named by the proxy's
requests, whose tokens carry its version and the learner's logprobs (JAX, float32, base +
adapter); the adapter before is unloaded once no request uses it. A vLLM the host restarts
comes back serving the current adapter. No Docker: the proxy's engine client is called directly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.proxy.engine_client import CompletionParams, ProxyEngineClient

from .stack import running_server, server_config
from .test_vllm_lora import CONTEXT, FIXED_TEXT, RANK, TOLERANCE, adapted_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_host_serves_adapter_versions_in_turn(tmp_path: Path) -> None:
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from legorl_jax.models import token_logprobs
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.publish import DirectoryPublisher

    # head_dim 32: the smallest vLLM's CPU attention takes.
    base = build_tiny_hf_model(tmp_path / "base", seed=0, head_dim=32, max_position_embeddings=CONTEXT)
    publisher = DirectoryPublisher(tmp_path / "weights", adapter_base=base)
    models = {version: adapted_model(base, seed=version) for version in (1, 2)}
    published = {version: publisher.publish(model, version) for version, model in models.items()}
    prompt = list(AutoTokenizer.from_pretrained(base)(FIXED_TEXT)["input_ids"])
    config = server_config(**{
        "engine.kind": "vllm",
        "engine.dtype": "float32",  # else the CPU build serves the float32 checkpoint as bfloat16
        "engine.max_context": CONTEXT,
        "engine.extra_args": f"[--enable-lora, --max-lora-rank, '{RANK}', --max-loras, '1']",
        "sandbox.kind": "local",
        "tasks.demo": "false",
    })  # fmt: skip
    sampling = CompletionParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, stop_token_ids=(), seed=7)

    Result = tuple[pb.UpdateWeightsResponse | None, list[int], list[float], list[int], list[str]]

    async def main() -> list[tuple[int, Result]]:
        out = []
        async with running_server(config, base) as server:
            engine = server.engine
            assert engine is not None
            proxy = next(c for c in server._clients if isinstance(c, ProxyEngineClient))
            async with grpc.aio.insecure_channel(server.address) as channel, httpx.AsyncClient() as http:

                async def sample(version: int, reply: pb.UpdateWeightsResponse | None) -> tuple[int, Result]:
                    done = await proxy.complete(prompt, sampling)
                    served = (await http.get(f"{engine.url}/v1/models")).json()["data"]
                    assert done.versions is not None
                    return version, (reply, list(done.token_ids), list(done.logprobs), list(done.versions),
                                     sorted(m["id"] for m in served))  # fmt: skip

                stub = pb_grpc.RolloutServiceStub(channel)
                for version, location in published.items():
                    reply = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, location=location))
                    out.append(await sample(version, reply))
                epoch = engine.epoch()
                engine.restart("a test kills it")
                async with engine.client() as client:
                    await client.wait_for_restart(epoch, 300)  # its own probe, through the adapter, passed
                out.append(await sample(2, None))
        return out

    results = asyncio.run(main())
    assert [version for version, _ in results] == [1, 2, 2]
    for version, (reply, tokens, logprobs, versions, served) in results:
        if reply is not None:
            assert reply.loaded_version == version and reply.update_path == "adapter"
            assert 0 <= reply.probe_max_abs_diff < TOLERANCE
        assert versions == [version] * len(tokens)
        ours = np.asarray(token_logprobs(models[version], jnp.asarray([prompt + tokens])))[0, len(prompt) - 1 :]
        assert np.max(np.abs(ours - np.asarray(logprobs))) < TOLERANCE
        # The adapter before is gone once no request named it; the base stays served.
        assert [name for name in served if name.startswith("v")] == [f"v{version}"]
