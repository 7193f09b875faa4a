"""An exception raised by a harness's own code ends its trial as harness_error with the
exception as the reason; an environment failure under it stays env_failure.

The real `lego` harness runs through the real trial runner (local sandbox, real
verifier); only its `run` is replaced, by a function that raises the way a bug
or a broken sandbox would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator

import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.harnesses import get_harness
from rollout_server.proxy.session import SessionStore
from rollout_server.sandbox.base import SandboxError
from rollout_server.sandbox.factory import SandboxFactory
from rollout_server.tasks import DEMO_TASKS_DIR, load_task
from rollout_server.trial import TrialHost, TrialSpec, run_trial

TASK = DEMO_TASKS_DIR / "edit-config"


@pytest.fixture
def host() -> Iterator[TrialHost]:
    factory = SandboxFactory(kind="local")
    # The replaced harness never calls the proxy, so nothing listens on its port.
    yield TrialHost(factory, SessionStore(), proxy_port=9, model_name="policy", policy_version=3)
    factory.close()


def trial(name: str) -> TrialSpec:
    lego = get_harness("lego")
    return TrialSpec(
        trial_id=name,
        task=load_task(TASK),
        harness=pb.HarnessConfig(name="lego"),
        options=lego.parse_options({}),
        sampling=pb.SamplingParams(),
        limits=pb.TrialLimits(),
        labels={},
        agent_timeout_s=30.0,
        verifier_timeout_s=30.0,
    )


def raising(exc: BaseException) -> Callable[..., Coroutine[None, None, None]]:
    """A stand-in for `InProcessHarness.run` that fails on its first step."""

    async def run(self: object, *args: object, **kwargs: object) -> None:
        raise exc

    return run


@pytest.mark.parametrize(
    ("exc", "status", "reason"),
    [
        (KeyError("turn_budget"), pb.TRIAL_STATUS_HARNESS_ERROR, "lego raised KeyError('turn_budget')"),
        (ZeroDivisionError("division by zero"), pb.TRIAL_STATUS_HARNESS_ERROR, "lego raised ZeroDivisionError"),
        (SandboxError("container vanished"), pb.TRIAL_STATUS_ENV_FAILURE, "sandbox: container vanished"),
    ],
)
def test_harness_exception_is_a_harness_error(
    host: TrialHost, monkeypatch: pytest.MonkeyPatch, exc: BaseException, status: int, reason: str
) -> None:
    monkeypatch.setattr(type(get_harness("lego")), "run", raising(exc))
    out = asyncio.run(run_trial(host, trial(f"raises-{type(exc).__name__}")))
    assert out.status == status, out.error
    assert out.error.startswith(reason), out.error
    assert not out.HasField("reward")  # neither end is graded
    assert len(host.sessions) == 0  # the session went with the trial
