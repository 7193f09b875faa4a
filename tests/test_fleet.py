"""The fleet client against real gRPC servers on localhost.

The servicers here are test instruments: they answer Rollout with canned
trajectories (and can be told to die mid-stream) so the client's spreading,
re-issue and failure handling can be observed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from legorl_jax.core.grpc_auth import Keepalive
from legorl_jax.core.seeds import derive_seed
from legorl_jax.fleet import Fleet, FleetError, GroupResult, GroupSpec
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc


class CannedServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, name: str, capacity: int, die_after: int | None = None, backwards: bool = False) -> None:
        self.name = name
        self.backwards = backwards  # trials end last-asked first, numbered as a rollout server numbers them
        self.seeds: list[int] = []  # each request's base seed
        self.capacity = capacity
        self.die_after = die_after  # trajectories sent before the server stops itself
        self.sent = 0
        self.server: grpc.aio.Server | None = None
        self.stopping: asyncio.Future[None] | None = None
        self.version = 0

    async def Rollout(self, request, context):
        self.seeds.append(request.sampling.seed)
        order = range(request.group_size)
        for index in reversed(order) if self.backwards else order:
            if self.die_after is not None and self.sent >= self.die_after:
                # Stopped from outside this handler: the stop cancels the handler itself.
                self.stopping = asyncio.ensure_future(self.server.stop(grace=None))
                await asyncio.sleep(30)
            await asyncio.sleep(0.01)
            self.sent += 1
            yield pb.Trajectory(
                request_id=request.request_id,
                task_id=request.tasks[0].task_id,
                harness=request.harness_configs[0],
                reward=1.0,
                status=pb.TRIAL_STATUS_OK,
                labels={"server": self.name, "asked": str(index)},
                trial_index=index if self.backwards else 0,
                sequences=[pb.TokenSequence(token_ids=[1, 2], loss_mask=[0, 1], policy_version=request.policy_version)],
            )

    async def UpdateWeights(self, request, context):
        self.version = request.version
        return pb.UpdateWeightsResponse(loaded_version=request.version)

    async def GetStatus(self, request, context):
        return pb.ServerStatus(capacity=self.capacity, loaded_policy_version=self.version, engine_healthy=True)


async def start(servicer: CannedServicer) -> str:
    server = grpc.aio.server()
    _running.append(servicer)
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servicer.server = server
    return f"127.0.0.1:{port}"


_running: list[CannedServicer] = []


def run(main) -> None:
    """Runs a test body, then stops its servers inside the same event loop."""

    async def wrapped() -> None:
        try:
            await main()
        finally:
            while _running:
                servicer = _running.pop()
                await (servicer.stopping or servicer.server.stop(grace=None))

    asyncio.run(wrapped())


def spec(task: str, size: int = 2, version: int = 3, seed: int = 0) -> GroupSpec:
    return GroupSpec(
        task=pb.TaskRef(task_id=task),
        harness=pb.HarnessConfig(name="lego", config_id="c0"),
        group_size=size,
        sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, seed=seed),
        policy_version=version,
    )


def test_groups_spread_over_servers_and_complete() -> None:
    async def main() -> None:
        a, b = CannedServicer("a", capacity=2), CannedServicer("b", capacity=4)
        addresses = [await start(a), await start(b)]
        async with Fleet(addresses) as fleet:
            assert await fleet.update_weights(3, "/tmp/w") == {addresses[0]: 3, addresses[1]: 3}
            results = [r async for r in fleet.rollout(spec(f"t{i}") for i in range(6))]
        assert sorted(r.spec.task.task_id for r in results) == [f"t{i}" for i in range(6)]
        for r in results:
            assert len(r.trajectories) == 2
            assert {t.group_id for t in r.trajectories} == {r.group_id}
            assert [t.trial_index for t in r.trajectories] == [0, 1]
            assert all(t.sequences[0].policy_version == 3 for t in r.trajectories)
        used = Counter(t.labels["server"] for r in results for t in r.trajectories)
        assert used["a"] > 0 and used["b"] > 0

    run(main)


def test_trials_of_a_dead_server_are_reissued_elsewhere() -> None:
    async def main() -> None:
        dying, healthy = CannedServicer("dying", capacity=8, die_after=1), CannedServicer("healthy", capacity=1)
        addresses = [await start(dying), await start(healthy)]
        async with Fleet(addresses, probe_interval_s=0.2) as fleet:
            results = [r async for r in fleet.rollout([spec("t0", size=3)])]
            assert fleet.statuses()[addresses[0]]["alive"] is False
        (result,) = results
        assert result.reissues == 1
        assert [t.labels["server"] for t in result.trajectories] == ["dying", "healthy", "healthy"]
        assert all(t.status == pb.TRIAL_STATUS_OK for t in result.trajectories)

    run(main)


# A rollout server in its own process that takes a Rollout and never answers it: SIGSTOPped, it is a
# stalled host (the kernel keeps its connections open; nothing in it answers a ping).
_STALLING_SERVER = """
import asyncio, sys
import grpc
from legorl_jax.core.grpc_auth import SERVER_KEEPALIVE_OPTIONS
from protos.legorl.v1 import rollout_pb2 as pb, rollout_pb2_grpc as pb_grpc

class Stalling(pb_grpc.RolloutServiceServicer):
    async def Rollout(self, request, context):
        print("rollout", flush=True)
        await asyncio.sleep(3600)
        yield pb.Trajectory()

    async def GetStatus(self, request, context):
        return pb.ServerStatus(capacity=16, engine_healthy=True)

async def main():
    server = grpc.aio.server(options=SERVER_KEEPALIVE_OPTIONS)
    pb_grpc.add_RolloutServiceServicer_to_server(Stalling(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_trials_of_a_stalled_server_are_reissued_within_the_keepalive() -> None:
    """A stopped host holds its connection open and answers nothing: HTTP/2 pings find it, and its
    trials are re-issued after about time_s + timeout_s, not after the call's hour-long deadline."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", _STALLING_SERVER], stdout=subprocess.PIPE, cwd=root, text=True)

    async def main() -> None:
        assert proc.stdout is not None
        stalled = f"127.0.0.1:{proc.stdout.readline().strip()}"
        healthy = CannedServicer("healthy", capacity=4)
        addresses = [stalled, await start(healthy)]
        keepalive = Keepalive(time_s=1.0, timeout_s=1.0)
        async with Fleet(addresses, probe_interval_s=0.2, keepalive=keepalive, rpc_timeout_s=120.0) as fleet:
            rollout = asyncio.ensure_future(_collect(fleet.rollout([spec("t0", size=3)])))
            assert await asyncio.to_thread(proc.stdout.readline) == "rollout\n"  # the group went to it first
            os.kill(proc.pid, signal.SIGSTOP)
            (result,) = await asyncio.wait_for(rollout, 20.0)
        assert result.reissues == 1
        assert [t.labels["server"] for t in result.trajectories] == ["healthy"] * 3

    try:
        run(main)
    finally:
        proc.kill()
        proc.wait()


async def _collect(results: AsyncIterator[GroupResult]) -> list[GroupResult]:
    return [r async for r in results]


def test_a_group_comes_back_in_the_order_asked_and_reissues_sample_anew() -> None:
    """Trials end in any order; the group lists them as asked (the server numbers them), so the same
    seeds give the same group. Trials re-issued after a server died get a new base seed: the ones
    that came back already used the group's."""

    async def main() -> None:
        server = CannedServicer("backwards", capacity=4, backwards=True)
        async with Fleet([await start(server)]) as fleet:
            (result,) = [r async for r in fleet.rollout([spec("t0", size=3, seed=77)])]
        assert [t.labels["asked"] for t in result.trajectories] == ["0", "1", "2"]
        assert [t.trial_index for t in result.trajectories] == [0, 1, 2]
        assert server.seeds == [77]

        dying, healthy = CannedServicer("dying", capacity=8, die_after=1), CannedServicer("healthy", capacity=1)
        addresses = [await start(dying), await start(healthy)]
        async with Fleet(addresses, probe_interval_s=0.2) as fleet:
            (result,) = [r async for r in fleet.rollout([spec("t0", size=3, seed=77)])]
        assert result.reissues == 1
        assert dying.seeds == [77] and healthy.seeds == [derive_seed(77, "reissue", 1)]

    run(main)


def test_trials_come_back_as_env_failures_when_retries_run_out() -> None:
    async def main() -> None:
        one, two = CannedServicer("one", 4, die_after=1), CannedServicer("two", 4, die_after=0)
        addresses = [await start(one), await start(two)]
        async with Fleet(addresses, max_retries=1, probe_interval_s=0.1, wait_for_servers_s=0.5) as fleet:
            (result,) = [r async for r in fleet.rollout([spec("t0", size=3)])]
        statuses = [t.status for t in result.trajectories]
        assert statuses[0] == pb.TRIAL_STATUS_OK
        assert statuses[1:] == [pb.TRIAL_STATUS_ENV_FAILURE] * 2
        assert not result.trajectories[1].HasField("reward")  # ungraded, not zero
        assert "lost after" in result.trajectories[1].error

    run(main)


def test_unreachable_fleet_is_a_clear_error() -> None:
    async def main() -> None:
        with pytest.raises(FleetError, match="no rollout server answered"):
            async with Fleet(["127.0.0.1:1"]):
                pass

    run(main)
    with pytest.raises(FleetError, match="no rollout server addresses"):
        Fleet([])


def test_hosts_load_published_deltas_by_location_and_catch_up(tmp_path) -> None:
    """Shared storage: every host rebuilds each delta version bit-exactly from the
    one it serves; a host that restarted empty rebuilds it from the last full one."""
    from legorl_jax.core.weight_layout import read_tensors
    from legorl_jax.models import from_hf
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.publish import DirectoryPublisher
    from rollout_server.weight_host import start
    from tests.publish.test_weight_delta import nudged, same_bits

    models = [from_hf(build_tiny_hf_model(tmp_path / "tiny", hidden_size=32, head_dim=8, intermediate_size=64))]
    models += [nudged(models[0], 1), nudged(nudged(models[0], 1), 2)]
    publisher = DirectoryPublisher(tmp_path / "pub", keep=1, dtype="bfloat16", full_every=3)
    reference = DirectoryPublisher(tmp_path / "ref", keep=3, dtype="bfloat16")

    async def main() -> None:
        hosts = [await start(tmp_path / f"host{i}", weights_roots=[tmp_path / "pub"]) for i in range(2)]
        try:
            async with Fleet([address for _, address, _ in hosts], wait_for_servers_s=5) as fleet:
                for version, model in enumerate(models):
                    if version == 2:  # host 1 restarts with nothing served
                        server, address, _ = hosts[1]
                        await server.stop(None)
                        hosts[1] = await start(tmp_path / "host1-new", address, [tmp_path / "pub"])
                    location = publisher.publish(model, version)
                    reference.publish(model, version)
                    assert set((await fleet.update_weights(version, location)).values()) == {version}
                    expected = read_tensors(tmp_path / "ref" / f"v{version:08d}")
                    for _, _, service in hosts:
                        assert same_bits(service.engine.tensors, expected)
        finally:
            for server, _, _ in hosts:
                await server.stop(None)

    asyncio.run(main())
