"""The gRPC contract: generated modules are current, and messages cross a real
gRPC channel intact, including fields the receiver does not know."""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent


def test_generated_modules_are_current(tmp_path: Path) -> None:
    env_python = sys.executable
    subprocess.run(
        [str(REPO / "scripts" / "gen_protos"), str(tmp_path)],
        check=True,
        cwd=REPO,
        env={"PYTHON": env_python, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        assert filecmp.cmp(tmp_path / rel, REPO / rel, shallow=False), (
            f"{rel} is stale: run ./scripts/gen_protos and commit the result"
        )


FIELD = re.compile(r"^\s*(optional |repeated )?[\w.<>, ]+ \w+ = \d+( \[.*\])?;")


def test_every_field_is_commented_and_messages_reserve_numbers() -> None:
    lines = (REPO / "protos/legorl/v1/rollout.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        if FIELD.match(line) and "TRIAL_STATUS" not in line:
            assert lines[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {line.strip()}"
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    for message in proto.message_type:
        if message.field:
            assert message.reserved_range, f"{message.name} reserves no field numbers"


class EchoServicer(pb_grpc.RolloutServiceServicer):
    """Test instrument: answers from the request so the channel round trip can be checked."""

    def Rollout(self, request: pb.RolloutRequest, context: grpc.ServicerContext) -> Iterator[pb.Trajectory]:
        for task in request.tasks:
            for harness in request.harness_configs:
                for index in range(request.group_size):
                    graded = index % 2 == 0
                    yield pb.Trajectory(
                        request_id=request.request_id,
                        task_id=task.task_id,
                        group_id=f"{task.task_id}/{harness.config_id}",
                        trial_index=index,
                        harness=harness,
                        sequences=[
                            pb.TokenSequence(
                                token_ids=[1, 2, 3],
                                loss_mask=[0, 1, 1],
                                behavior_logprobs=[0.0, -0.5, -1.25],
                                policy_version=request.policy_version,
                            )
                        ],
                        reward=1.0 if graded else None,
                        status=pb.TRIAL_STATUS_OK if graded else pb.TRIAL_STATUS_ENV_FAILURE,
                        sampling=request.sampling,
                    )

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.ServerStatus:
        return pb.ServerStatus(capacity=4, loaded_policy_version=7, engine_healthy=True)


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.RolloutServiceStub]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RolloutServiceServicer_to_server(EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.RolloutServiceStub(channel)
    server.stop(grace=None)


def test_rollout_streams_groups_with_optional_reward(stub: pb_grpc.RolloutServiceStub) -> None:
    request = pb.RolloutRequest(
        request_id="r1",
        tasks=[pb.TaskRef(task_id="t1"), pb.TaskRef(task_id="t2")],
        harness_configs=[pb.HarnessConfig(name="lego", options_json='{"tools": "bash_only"}', config_id="a")],
        group_size=3,
        sampling=pb.SamplingParams(temperature=0.7, top_p=1.0, top_k=-1, max_tokens=64),
        policy_version=5,
    )
    trajectories = list(stub.Rollout(request))
    assert len(trajectories) == 6
    assert {t.group_id for t in trajectories} == {"t1/a", "t2/a"}
    for t in trajectories:
        assert t.sequences[0].policy_version == 5
        assert list(t.sequences[0].behavior_logprobs) == [0.0, -0.5, -1.25]
        assert t.sampling.top_k == -1
        # presence, not value, tells graded from ungraded
        assert t.HasField("reward") == (t.status == pb.TRIAL_STATUS_OK)


def test_unknown_fields_are_tolerated(stub: pb_grpc.RolloutServiceStub) -> None:
    """A newer peer's extra field survives parsing by this version."""
    known = pb.GetStatusRequest().SerializeToString()
    # field 99, varint 1: a field this version has never heard of
    from_the_future = known + bytes([0x98, 0x06, 0x01])
    parsed = pb.GetStatusRequest.FromString(from_the_future)
    assert parsed.SerializeToString() == from_the_future  # kept as an unknown field
    status = stub.GetStatus(parsed)
    assert status.loaded_policy_version == 7
