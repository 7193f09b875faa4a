"""A trial during which the engine restarted ends as ENGINE_ERROR: what it sampled
may come from two engine processes, so its labels cannot be trusted."""

from __future__ import annotations

import asyncio
from typing import Any

from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.trial import TrialHost, _agent_outcome


class _QuietSandbox:
    """TEST INSTRUMENT: a sandbox whose agent ran within its memory limit."""

    def oom_kill_count(self) -> int:
        return 0


def _outcome(host: TrialHost, started_epoch: int) -> tuple[int, str]:
    sandbox: Any = _QuietSandbox()
    return asyncio.run(_agent_outcome(pb.TRIAL_STATUS_OK, "", sandbox, host, None, None, started_epoch))  # type: ignore[arg-type]


def test_a_trial_spanning_an_engine_restart_is_an_engine_error() -> None:
    epoch = [0]
    host = TrialHost(None, None, 0, "policy", 3, engine_epoch=lambda: epoch[0])  # type: ignore[arg-type]
    assert _outcome(host, 0) == (pb.TRIAL_STATUS_OK, "")
    epoch[0] = 1  # the supervisor restarted the engine while the agent ran
    status, reason = _outcome(host, 0)
    assert status == pb.TRIAL_STATUS_ENGINE_ERROR and "restarted" in reason
    assert _outcome(host, 1)[0] == pb.TRIAL_STATUS_OK  # a trial started after the restart is fine
