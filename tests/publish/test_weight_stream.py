"""Weights streamed over a real grpc.aio server: the receiving servicer (a test
instrument standing in for the rollout server's) assembles the stream with
`receive_stream`; the result must load bit-identically and give the same
logits in our model and in transformers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

from legorl_jax.core.weight_layout import WeightTransferError
from legorl_jax.models import CausalLM, from_hf
from legorl_jax.train.publish import DirectoryPublisher, publish_weights
from legorl_jax.train.weight_stream import WeightStreamer, WeightStreamError, weight_chunks
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.weights import receive_stream


class ReceivingServicer(pb_grpc.RolloutServiceServicer):
    """Test instrument: StreamWeights → receive_stream into `root`; a malformed
    stream answers INVALID_ARGUMENT with the receiver's message."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.received: list[Path] = []

    async def StreamWeights(
        self, request_iterator: AsyncIterator[pb.WeightChunk], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        try:
            version, directory = await receive_stream(request_iterator, self.root)
        except WeightTransferError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.received.append(directory)
        return pb.UpdateWeightsResponse(loaded_version=version)


async def start_server(root: Path) -> tuple[grpc.aio.Server, str, ReceivingServicer]:
    servicer = ReceivingServicer(root)
    server = grpc.aio.server()  # default options: chunks must fit the 4 MiB message limit
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


def safetensors_dtypes(directory: Path) -> set[str]:
    dtypes = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "numpy") as f:
            dtypes.update(f.get_slice(n).get_dtype() for n in f.keys())
    return dtypes


@pytest.mark.parametrize("max_shard_bytes", [16 * 2**10, 2**30], ids=["sharded", "single-file"])
def test_streamed_bf16_weights_load_exactly_on_every_server(
    tmp_path: Path,
    model: CausalLM,
    hf_dir: Path,
    max_shard_bytes: int,
    assert_loads_identical: Callable[..., None],
) -> None:
    publisher = DirectoryPublisher(
        tmp_path / "learner", keep=2, tokenizer_from=hf_dir, dtype="bfloat16", max_shard_bytes=max_shard_bytes
    )

    async def main() -> tuple[dict[str, int], list[ReceivingServicer], list[str]]:
        servers = [await start_server(tmp_path / f"host{i}") for i in range(2)]
        try:
            addresses = [address for _, address, _ in servers]
            # Small chunks so every tensor crosses in several pieces.
            report = await publish_weights(publisher, WeightStreamer(addresses, chunk_bytes=1000), model, 0)
            return report.loaded, [s for _, _, s in servers], addresses
        finally:
            for server, _, _ in servers:
                await server.stop(None)

    loaded, servicers, addresses = asyncio.run(main())
    assert loaded == dict.fromkeys(addresses, 0)  # step 0 serves the learner's weights
    published = Path(publisher.latest() or "")
    bf16 = from_hf(published, dtype="bfloat16")
    for servicer in servicers:
        (received,) = servicer.received
        assert received.name == "v00000000"
        assert safetensors_dtypes(received) == {"BF16"}
        assert (received / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
        assert json.loads((received / "config.json").read_text()) == json.loads((published / "config.json").read_text())
        assert_loads_identical(received, bf16, dtype="bfloat16")

    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 12)).astype(np.int32)
    ours = np.asarray(from_hf(received)(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(received, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


def test_chunk_offsets_cover_each_tensor(tmp_path: Path, model: CausalLM) -> None:
    location = DirectoryPublisher(tmp_path / "w").publish(model, 3)
    embed = model.config.vocab_size * model.config.hidden_size * 4
    chunk = embed // 3 + 1
    messages = list(weight_chunks(Path(location), 3, chunk_bytes=chunk))
    assert messages[0].WhichOneof("payload") == "header" and messages[0].header.version == 3
    assert all(m.WhichOneof("payload") == "tensor" for m in messages[1:])
    pieces = [m.tensor for m in messages[1:] if m.tensor.name == "model.embed_tokens.weight"]
    assert [p.offset for p in pieces] == list(range(0, embed, chunk))
    assert b"".join(p.data for p in pieces) == np.asarray(model.embed_tokens.embedding.get_value()).tobytes()


def test_default_chunks_pass_grpc_default_message_limit(tmp_path: Path) -> None:
    """A tensor larger than gRPC's 4 MiB default message size streams whole."""
    source = tmp_path / "big"
    source.mkdir()
    (source / "config.json").write_text("{}")
    big = np.random.default_rng(0).standard_normal((1536, 1536)).astype(ml_dtypes.bfloat16)  # 4.5 MiB
    save_file({"w": big}, source / "model.safetensors")

    async def main() -> ReceivingServicer:
        server, address, servicer = await start_server(tmp_path / "host")
        try:
            assert await WeightStreamer([address]).update_weights(9, str(source)) == {address: 9}
        finally:
            await server.stop(None)
        return servicer

    (received,) = asyncio.run(main()).received
    with safe_open(received / "model.safetensors", "numpy") as f:
        assert f.get_slice("w").get_dtype() == "BF16"
        assert f.get_tensor("w").tobytes() == big.tobytes()


def test_streamer_skips_dead_servers_and_fails_when_none_load(tmp_path: Path, model: CausalLM) -> None:
    location = DirectoryPublisher(tmp_path / "w").publish(model, 5)

    async def main() -> None:
        server, address, servicer = await start_server(tmp_path / "host")
        dead = "127.0.0.1:1"  # nothing listens on port 1
        try:
            assert await WeightStreamer([address, dead], timeout_s=30).update_weights(5, location) == {address: 5}
            with pytest.raises(WeightStreamError, match="no server loaded policy version 5"):
                await WeightStreamer([dead], timeout_s=30).update_weights(5, location)
        finally:
            await server.stop(None)

    asyncio.run(main())
    with pytest.raises(WeightStreamError, match="only a local directory"):
        asyncio.run(WeightStreamer(["x:1"]).update_weights(1, "gs://bucket/v1"))
    with pytest.raises(WeightStreamError, match="neither config.json"):
        asyncio.run(WeightStreamer(["x:1"]).update_weights(1, str(tmp_path)))


def test_malformed_stream_over_grpc_is_invalid_argument(tmp_path: Path, model: CausalLM) -> None:
    location = DirectoryPublisher(tmp_path / "w").publish(model, 1)
    headless = list(weight_chunks(Path(location), 1))[1:]

    async def main() -> None:
        server, address, _ = await start_server(tmp_path / "host")
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.RolloutServiceStub(channel).StreamWeights(iter(headless))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "must start with a header" in (info.value.details() or "")
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert list((tmp_path / "host").iterdir()) == []
