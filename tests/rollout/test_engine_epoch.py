"""How the agent phase ended: a trial during which the engine restarted ends as ENGINE_ERROR (what it
sampled may come from two engine processes, so its labels cannot be trusted); a harness that gave up
on the policy's answer cut at its token limit is the policy's doing, CAP_EXCEEDED and graded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.proxy.trajectory import CallRecord, CapturedTrajectory
from rollout_server.trial import _GRADED, TrialHost, _agent_outcome


class _QuietSandbox:
    """TEST INSTRUMENT: a sandbox whose agent ran within its memory limit."""

    def oom_kill_count(self) -> int:
        return 0


def _outcome(
    host: TrialHost,
    started_epoch: int,
    status: pb.TrialStatus = pb.TRIAL_STATUS_OK,
    reason: str = "",
    captured: CapturedTrajectory | None = None,
) -> tuple[int, str]:
    sandbox: Any = _QuietSandbox()
    captured = captured or CapturedTrajectory()
    return asyncio.run(_agent_outcome(status, reason, sandbox, host, None, captured, started_epoch))  # type: ignore[arg-type]


def test_a_trial_spanning_an_engine_restart_is_an_engine_error() -> None:
    epoch = [0]
    host = TrialHost(None, None, 0, "policy", 3, engine_epoch=lambda: epoch[0])  # type: ignore[arg-type]
    assert _outcome(host, 0) == (pb.TRIAL_STATUS_OK, "")
    epoch[0] = 1  # the supervisor restarted the engine while the agent ran
    status, reason = _outcome(host, 0)
    assert status == pb.TRIAL_STATUS_ENGINE_ERROR and "restarted" in reason
    assert _outcome(host, 1)[0] == pb.TRIAL_STATUS_OK  # a trial started after the restart is fine


def _call(finish_reason: str) -> CallRecord:
    return CallRecord(
        index=0,
        dialect="anthropic",
        stream=True,
        sequence=0,
        merged=False,
        prompt_tokens=11000,
        completion_tokens=256,
        finish_reason=finish_reason,
        tool_calls=0,
        parse_error=None,
        reused_turns=0,
        unmatched_turns=0,
        sampling={"max_tokens": 256},
        policy_version=0,
        engine_latency_s=1.0,
    )


def test_a_harness_that_gives_up_on_a_cut_answer_is_graded_as_the_policys_cap() -> None:
    host = TrialHost(None, None, 0, "policy", 3)  # type: ignore[arg-type]
    error = "claude-code: API Error: Claude's response exceeded the 128000 output token maximum."
    cut = CapturedTrajectory(calls=[_call("stop"), _call("length")])
    status, reason = _outcome(host, 0, pb.TRIAL_STATUS_HARNESS_ERROR, error, cut)
    assert status == pb.TRIAL_STATUS_CAP_EXCEEDED and status in _GRADED
    assert reason.startswith("the last completion hit max_tokens (256)") and error in reason
    # A harness that failed after a whole answer, or before any call, failed on its own.
    whole = CapturedTrajectory(calls=[_call("length"), _call("stop")])
    assert _outcome(host, 0, pb.TRIAL_STATUS_HARNESS_ERROR, error, whole) == (pb.TRIAL_STATUS_HARNESS_ERROR, error)
    assert _outcome(host, 0, pb.TRIAL_STATUS_HARNESS_ERROR, error)[0] == pb.TRIAL_STATUS_HARNESS_ERROR
    # A cut answer the harness carried on from is an ordinary graded end.
    assert _outcome(host, 0, pb.TRIAL_STATUS_OK, "", cut) == (pb.TRIAL_STATUS_OK, "")


@pytest.mark.parametrize("status", [pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_HARNESS_ERROR])
def test_a_proxy_cap_is_the_policys_whether_or_not_the_harness_then_fails(status: pb.TrialStatus) -> None:
    host = TrialHost(None, None, 0, "policy", 3)  # type: ignore[arg-type]
    capped = CapturedTrajectory(calls=[_call("stop")], cap_hit="max_model_calls (8)")
    assert _outcome(host, 0, status, "API Error: 429 session limit reached", capped) == (
        pb.TRIAL_STATUS_CAP_EXCEEDED,
        "proxy cap: max_model_calls (8)",
    )
