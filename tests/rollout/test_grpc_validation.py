"""Hostile or broken requests to a real `RolloutServer` over gRPC: each gets a
precise status code and message (never UNKNOWN), quickly, and the server keeps
serving. The server sits in front of the scripted engine with local sandboxes,
so nothing heavy starts; no request here runs a trial.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from proxy.scripted_engine import ScriptedEngine, ServerThread

from legorl_jax.core.config import load_config
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.server import RolloutServer
from rollout_server.tasks import DEMO_TASKS_DIR, TaskError

from .stack import lego

Body = Callable[[RolloutServer, pb_grpc.RolloutServiceStub], Awaitable[None]]


@pytest.fixture(scope="module")
def engine_url(tokenizer: Any) -> Any:
    # The server holds requests to the context the engine reports, here 512 tokens.
    with ServerThread(ScriptedEngine(tokenizer, max_model_len=512).app) as thread:
        yield thread.url


def serve(engine_url: str, model_dir: Path, body: Body, *overrides: str) -> None:
    """Runs `body` against a fresh server (capacity 2, 4 queued) and checks it still answers after."""
    config = load_config(
        None,
        [
            "engine.kind=external",
            f"engine.url={engine_url}",
            "sandbox.kind=local",
            "tasks.demo=false",
            "fleet.capacity_per_server=2",
            "fleet.max_queued_per_server=4",
            "fleet.max_trial_timeout_s=900",
            "proxy.max_model_calls=10",
            *overrides,
        ],
    )

    async def main() -> None:
        server = RolloutServer(config, model_dir)
        address = await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                await body(server, stub)
                status = await stub.GetStatus(pb.GetStatusRequest(), timeout=5)
                assert (status.in_flight_trials, status.queued_trials, status.draining) == (0, 0, False)
        finally:
            await server.stop(grace_s=5)

    asyncio.run(main())


async def rollout_error(stub: pb_grpc.RolloutServiceStub, request: pb.RolloutRequest) -> grpc.aio.AioRpcError:
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Rollout(request, timeout=20):
            pass
    # Refused before anything is expanded: a request for 4 billion trials costs no more than one for 1.
    assert time.monotonic() - started < 2.0, request
    return info.value


def request(**fields: Any) -> pb.RolloutRequest:
    base: dict[str, Any] = {
        "request_id": "r",
        "tasks": [pb.TaskRef(task_id="edit-config")],
        "harness_configs": [lego()],
        "group_size": 1,
    }
    return pb.RolloutRequest(**{**base, **fields})


INVALID = grpc.StatusCode.INVALID_ARGUMENT
# (request, code, words of the message)
BAD_ROLLOUTS: dict[str, tuple[pb.RolloutRequest, grpc.StatusCode, str]] = {
    "group_size 2^32-1": (request(group_size=2**32 - 1), INVALID, "asks for 4294967295 trials"),
    "group_size 400k": (request(group_size=400_000), INVALID, "split the request"),
    "group_size 0": (request(group_size=0), INVALID, "group_size must be at least 1"),
    "more trials than capacity and queue": (
        request(tasks=[pb.TaskRef(task_id="edit-config")] * 7),
        INVALID,
        "at most 6 at once",
    ),
    "no harness": (request(harness_configs=[]), INVALID, "at least one task and one harness"),
    "task without id or location": (request(tasks=[pb.TaskRef()]), INVALID, "set task_id or location"),
    "unknown task id": (request(tasks=[pb.TaskRef(task_id="nope")]), INVALID, "unknown task id"),
    "unknown harness": (request(harness_configs=[pb.HarnessConfig(name="nope")]), INVALID, "nope"),
    "options_json nested 50k deep": (
        request(harness_configs=[pb.HarnessConfig(name="lego", options_json="[" * 50_000)]),
        INVALID,
        "options_json nests too deeply",
    ),
    "options_json of 100 KB": (
        request(harness_configs=[pb.HarnessConfig(name="lego", options_json=json.dumps({"x": "y" * 100_000}))]),
        INVALID,
        "options_json is 100",
    ),
    "request of 2 MB": (request(labels={f"k{i}": "v" * 1000 for i in range(2000)}), INVALID, "bytes; at most"),
    "too many labels": (request(labels={f"k{i}": "v" for i in range(100)}), INVALID, "100 labels"),
    "request_id of 10k chars": (request(request_id="r" * 10_000), INVALID, "request_id is 10000 characters"),
    "location of 10k chars": (request(tasks=[pb.TaskRef(location="/x" * 5000)]), INVALID, "location is 10000"),
    "negative agent timeout": (
        request(limits=pb.TrialLimits(agent_timeout_s=-1)),
        INVALID,
        "limits.agent_timeout_s is -1",
    ),
    "NaN verifier timeout": (
        request(limits=pb.TrialLimits(verifier_timeout_s=float("nan"))),
        INVALID,
        "limits.verifier_timeout_s is nan",
    ),
    "agent timeout past the server's maximum": (
        request(limits=pb.TrialLimits(agent_timeout_s=1e9)),
        INVALID,
        "fleet.max_trial_timeout_s",
    ),
    "more model calls than the proxy's cap": (
        request(limits=pb.TrialLimits(max_model_calls=2**31)),
        INVALID,
        "proxy.max_model_calls",
    ),
    "negative temperature": (
        request(sampling=pb.SamplingParams(temperature=-1)),
        INVALID,
        "sampling.temperature",
    ),
    "infinite top_p": (request(sampling=pb.SamplingParams(top_p=float("inf"))), INVALID, "must be finite"),
    "top_k below -1": (request(sampling=pb.SamplingParams(top_k=-5)), INVALID, "sampling.top_k"),
    "max_tokens past the context": (
        request(sampling=pb.SamplingParams(max_tokens=2**31)),
        INVALID,
        "the engine's context is 512",
    ),
    "a future policy version": (request(policy_version=7), grpc.StatusCode.FAILED_PRECONDITION, "wants 7"),
}


def test_bad_rollout_requests_get_precise_codes(engine_url: str, tokenizer_dir: Path) -> None:
    async def body(server: RolloutServer, stub: pb_grpc.RolloutServiceStub) -> None:
        for case, (bad, code, words) in BAD_ROLLOUTS.items():
            error = await rollout_error(stub, bad)
            assert (error.code(), words in (error.details() or "")) == (code, True), (case, error.details())

    serve(engine_url, tokenizer_dir, body)


def test_task_locations_are_confined_to_the_task_roots(engine_url: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(DEMO_TASKS_DIR / "edit-config", root / "mine")
    shutil.copytree(DEMO_TASKS_DIR / "edit-config", outside / "theirs")
    os.symlink(outside / "theirs", root / "link")
    refused = {
        "a host directory": "/etc",
        "outside, by absolute path": str(outside / "theirs"),
        "outside, through ..": f"{root}/../outside/theirs",
        "outside, through a symlink in the root": str(root / "link"),
        "relative to the server's working directory": "rollout_server/demo_tasks/../../..",
    }

    async def body(server: RolloutServer, stub: pb_grpc.RolloutServiceStub) -> None:
        for case, location in refused.items():
            error = await rollout_error(stub, request(tasks=[pb.TaskRef(location=location)]))
            assert error.code() == INVALID, (case, error.details())
            assert "tasks.location_roots" in (error.details() or ""), case
        assert server.service is not None
        # Inside the roots: the configured one, the shipped demo tasks.
        allowed = [str(root / "mine"), f"{root}/mine/../mine", str(DEMO_TASKS_DIR / "edit-config")]
        tasks = server.service._resolve_tasks([pb.TaskRef(location=loc) for loc in allowed])
        assert [t.root for t in tasks] == [(root / "mine").resolve()] * 2 + [DEMO_TASKS_DIR / "edit-config"]
        with pytest.raises(TaskError, match="outside the task roots"):
            server.service._resolve_tasks([pb.TaskRef(location=str(root / "link"))])

    serve(engine_url, tokenizer_dir, body, f"tasks.location_roots=[{root}]")


def weights_header(total_size: int | None = 16) -> pb.WeightChunk:
    index: dict[str, Any] = {"weight_map": {"w": "model.safetensors"}}
    if total_size is not None:
        index["metadata"] = {"total_size": total_size}
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode()}
    return pb.WeightChunk(header=pb.WeightHeader(version=1, files=files))


async def stream_error(
    stub: pb_grpc.RolloutServiceStub, messages: AsyncIterator[pb.WeightChunk], timeout: float = 20
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StreamWeights(messages, timeout=timeout)
    return info.value


async def sent(*messages: pb.WeightChunk, then_stall: bool = False) -> AsyncIterator[pb.WeightChunk]:
    for message in messages:
        yield message
    if then_stall:
        await asyncio.Event().wait()  # the client stops sending but keeps the call open


def test_bad_weight_requests_get_precise_codes(engine_url: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    huge = pb.WeightChunk(tensor=pb.TensorChunk(name="w", dtype="F32", shape=[2**40], offset=0, data=bytes(4)))

    async def body(server: RolloutServer, stub: pb_grpc.RolloutServiceStub) -> None:
        for location, words in [
            ("http://127.0.0.1:1/weights/v1", "scheme http:// is not supported"),
            ("https://example.com/weights/v1", "scheme https:// is not supported"),
            (str(tmp_path), "no config.json there"),
            (str(tmp_path.parent), "allow its directory in fleet.weights_location_roots"),
            ("/tmp/nul\0byte", "not a usable path"),
            ("", "location is empty"),
            ("/x" * 5000, "location is 10000 characters"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, location=location), timeout=20)
            assert (info.value.code(), words in (info.value.details() or "")) == (INVALID, True), location

        for header in (weights_header(), weights_header(total_size=None)):
            error = await stream_error(stub, sent(header, huge))
            assert error.code() == INVALID and "F32[1099511627776] needs 4398046511104 bytes" in (error.details() or "")
        deep = {"config.json": b"{}", "model.safetensors.index.json": b"[" * 100_000}
        nested = pb.WeightChunk(header=pb.WeightHeader(files=deep))
        error = await stream_error(stub, sent(nested))
        assert error.code() == INVALID and "not a safetensors index" in (error.details() or "")

        # A sender that stalls mid-stream is dropped after the idle timeout (1 s here) and releases the
        # weights lock: the next stream is answered, not queued behind it. Nothing partial stays on disk.
        started = time.monotonic()
        stalled = asyncio.create_task(stream_error(stub, sent(weights_header(), then_stall=True), timeout=30))
        await asyncio.sleep(0.2)
        error = await stream_error(stub, sent(weights_header(), huge), timeout=10)
        assert error.code() == INVALID, error.details()
        error = await stalled
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "sent nothing for 1 s" in (error.details() or "")
        assert time.monotonic() - started < 5
        assert server.service is not None and list(server.service.weights_root.iterdir()) == []
        assert server.service.host.policy_version == 0

    serve(
        engine_url, tokenizer_dir, body, "fleet.weights_idle_timeout_s=1", f"fleet.weights_location_roots=[{tmp_path}]"
    )
