"""Seeded trials (`SamplingParams.seed`) on a rollout host with local sandboxes: each trial of a
group samples from a seed derived from the group's and its place, the proxy one per model call,
and a base seed of 0 sends none. Graded by `hashflip` (tests/loop/hashflip), whose reward is a
hash of the agent's final message, so the same seeds must give the same episodes and rewards."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from legorl_jax.core.config import Config
from legorl_jax.core.seeds import derive_seed
from legorl_jax.demo.demonstrations import tool_call_text
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.server import RolloutServer

from .stack import engine_on_host, lego, scripted_server_config, server_config

HASHFLIP = Path(__file__).resolve().parents[1] / "loop" / "hashflip"
LOCAL = {"sandbox.kind": "local", "tasks.demo": "false", "tasks.location_roots": f"[{HASHFLIP.parent}]"}


def group(seed: int, size: int) -> pb.RolloutRequest:
    """One group of `hashflip` trials under lego (bash only, short budget)."""
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=24, seed=seed)
    return pb.RolloutRequest(
        request_id=f"seed-{seed}",
        tasks=[pb.TaskRef(location=str(HASHFLIP))],
        harness_configs=[lego("bash_only")],
        group_size=size,
        sampling=sampling,
    )


async def trials(address: str, request: pb.RolloutRequest) -> list[pb.Trajectory]:
    """The group's trajectories in trial order (they stream back as they finish)."""
    async with grpc.aio.insecure_channel(address) as channel:
        out = [t async for t in pb_grpc.RolloutServiceStub(channel).Rollout(request)]
    return sorted(out, key=lambda t: t.trial_index)


def run(config: Config, model_dir: Path, *requests: pb.RolloutRequest) -> list[list[pb.Trajectory]]:
    """Each request in turn on one fresh host."""

    async def main() -> list[list[pb.Trajectory]]:
        server = RolloutServer(config, model_dir)
        address = await server.start()
        try:
            return [await trials(address, request) for request in requests]
        finally:
            await server.stop(grace_s=10)

    return asyncio.run(main())


def test_every_model_call_carries_its_trials_seed(model_dir: Path, tokenizer: Any) -> None:
    """Call k of trial i samples with derive_seed(derive_seed(base, task 0, harness 0, i), k): distinct
    per trial and per call; a base seed of 0 leaves the engine to draw its own, as before seeds."""
    with engine_on_host(tokenizer) as (engine, _, port):
        # Two model calls a trial: a bash call, then a reply that ends the episode.
        engine.respond = lambda p: (
            "Done." if p.count("<|im_start|>assistant") > 1 else tool_call_text("bash", {"command": "true"})
        )
        config = scripted_server_config(f"http://127.0.0.1:{port}", **LOCAL)
        seeded, unseeded = run(config, model_dir, group(5, 3), group(0, 2))
        bodies = engine.log.bodies
    assert [t.trial_index for t in seeded] == [0, 1, 2]
    assert all(t.status == pb.TRIAL_STATUS_OK and t.HasField("reward") for t in seeded + unseeded)
    expected = [derive_seed(derive_seed(5, 0, 0, i), k) for i in range(3) for k in range(2)]
    assert len(set(expected)) == 6
    assert sorted(b["seed"] for b in bodies[:6]) == sorted(expected)
    assert len(bodies) == 10 and not any("seed" in b for b in bodies[6:])  # none sent


def test_a_seeded_group_samples_and_grades_the_same_twice(model_dir: Path) -> None:
    """The embedded engine and a random model: the same seeded group asked twice gives the same token
    ids and rewards trial for trial, while its trials differ from one another (reward contrast)."""
    config = server_config(**LOCAL, **{"fleet.capacity_per_server": 8})
    first, again = run(config, model_dir, group(11, 8), group(11, 8))
    ids = [[list(s.token_ids) for s in t.sequences] for t in first]
    assert ids == [[list(s.token_ids) for s in t.sequences] for t in again]
    assert len({str(i) for i in ids}) == len(ids)
    assert all(t.HasField("reward") for t in first + again), [t.error for t in first + again]
    rewards = [t.reward for t in first]
    assert rewards == [t.reward for t in again]
    assert set(rewards) == {0.0, 1.0}, rewards
