"""One trial: sandbox + harness + verifier, with the proxy session in between.

The trial never raises for trouble of its own: every way it can end becomes a
`Trajectory` with a status and, only when the verifier graded it, a reward.
What the agent did cannot change the reward: the verifier copies the tests in
after the agent phase and reads the reward itself (see `verifier.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import posixpath
import shlex
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from legorl_jax.core.config import SamplingConfig
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.harnesses import HarnessContext, get_harness
from rollout_server.harnesses.base import CliHarness, Harness, HarnessOptions, InProcessHarness
from rollout_server.harnesses.tools import HarnessTools
from rollout_server.proxy.session import Session, SessionSpec, SessionStore
from rollout_server.proxy.trajectory import CapturedTrajectory
from rollout_server.sandbox.base import AGENT_LOGS_DIR, AGENT_USER, ROOT_USER, Sandbox, SandboxError, SandboxSpec
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task
from rollout_server.tasks import Task
from rollout_server.verifier import Verdict, verify

log = logging.getLogger(__name__)

_HARNESS_STATUS = {
    "ok": pb.TRIAL_STATUS_OK,
    "timeout": pb.TRIAL_STATUS_TIMEOUT,
    "cap_exceeded": pb.TRIAL_STATUS_CAP_EXCEEDED,
    "harness_error": pb.TRIAL_STATUS_HARNESS_ERROR,
}
# A CLI's `--version` is a Python or Node start-up: seconds alone, but it has run past a minute on
# two cores busy with seven CLIs and the engine. Only a missing install should fail the check.
_INSTALL_CHECK_S = 180.0
# Ends the verifier still grades: the policy ran out of time or budget, which is its own doing.
_GRADED = {pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_TIMEOUT, pb.TRIAL_STATUS_CAP_EXCEEDED}
# Once the proxy refuses a CLI's call for a cap, the episode is over, but a CLI may retry the refusal
# for minutes (mini-swe-agent's litellm client: 10 tries, backoff up to 60 s, ~4 min a trial in the
# seven-CLI run). It gets this long to quit by itself; then its processes are ended.
_CAP_GRACE_S = 10.0
_CAP_POLL_S = 0.5


@dataclasses.dataclass
class TrialHost:
    """What every trial on this host shares; `policy_version` moves with UpdateWeights."""

    sandboxes: SandboxFactory
    sessions: SessionStore
    proxy_port: int
    model_name: str
    policy_version: int
    # Asked when a harness fails, to tell a dead engine from a broken harness.
    engine_healthy: Callable[[], Awaitable[bool]] | None = None
    # Bumped by each engine restart: a trial that spans one ends as ENGINE_ERROR.
    engine_epoch: Callable[[], int] | None = None
    # The host's harness CLIs, mounted read-only into CLI-harness sandboxes; None: the image must carry them.
    harness_tools: HarnessTools | None = None


@dataclasses.dataclass(frozen=True)
class TrialSpec:
    trial_id: str
    task: Task
    harness: pb.HarnessConfig
    options: HarnessOptions
    sampling: pb.SamplingParams
    limits: pb.TrialLimits
    labels: Mapping[str, str]
    agent_timeout_s: float
    verifier_timeout_s: float
    index: int = 0  # its place in its group of the request
    seed: int | None = None  # the trial's own (`core.seeds.derive_seed` of its group's); None: unseeded


def sampling_config(params: pb.SamplingParams, default_max_tokens: int) -> SamplingConfig:
    return SamplingConfig(
        temperature=params.temperature or 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k if params.top_k else -1,
        max_tokens=params.max_tokens or default_max_tokens,
    )


async def run_trial(host: TrialHost, spec: TrialSpec) -> pb.Trajectory:
    harness = get_harness(spec.harness.name)
    times = pb.PhaseTimes()
    limits = {"max_model_calls": spec.limits.max_model_calls, "max_total_tokens": spec.limits.max_total_tokens}
    caps = host.sessions.default_caps.model_copy(update={k: v for k, v in limits.items() if v})
    session = host.sessions.create(
        SessionSpec(
            sampling=sampling_config(spec.sampling, 1024),
            caps=caps,
            labels={"trial": spec.trial_id, "task": spec.task.name, **spec.labels},
            policy_version=host.policy_version,
            seed=spec.seed,
        )
    )
    out = pb.Trajectory(task_id=spec.task.name, harness=spec.harness, sampling=spec.sampling, labels=spec.labels)
    epoch = host.engine_epoch() if host.engine_epoch is not None else 0
    sandbox: Sandbox | None = None
    started = time.monotonic()
    try:
        sandbox_spec = _sandbox_spec(host, harness, spec)
        sandbox = host.sandboxes.create(sandbox_spec)
        await asyncio.to_thread(sandbox.start)
        times.setup_s = time.monotonic() - started

        phase = time.monotonic()
        status, reason, harness_metrics = await _run_agent(harness, sandbox, host, spec, session)
        times.agent_s = time.monotonic() - phase
        status, reason = await _agent_outcome(
            status, reason, sandbox, host, sandbox_spec.memory_mb, session.trajectory, epoch
        )

        phase = time.monotonic()
        verdict = await asyncio.to_thread(verify, sandbox, spec.task, spec.verifier_timeout_s)
        times.verify_s = time.monotonic() - phase
        out.status, out.error = _resolve(status, reason, verdict)
        if out.status in _GRADED and verdict.reward is not None:
            out.reward = verdict.reward
            out.metrics.verifier_no_reward = verdict.status == "no_reward"
    except SandboxError as exc:
        out.status, out.error = pb.TRIAL_STATUS_ENV_FAILURE, f"sandbox: {exc}"
        harness_metrics = {}
    except asyncio.CancelledError:
        out.status, out.error = pb.TRIAL_STATUS_CANCELLED, "cancelled before the trial finished"
        harness_metrics = {}
        raise
    except Exception as exc:  # a fault of this server's own: report the trial, keep serving
        log.exception("trial %s failed inside the rollout server", spec.trial_id)
        out.status, out.error = pb.TRIAL_STATUS_ENV_FAILURE, f"rollout server fault: {exc!r}"
        out.ClearField("reward")
        harness_metrics = {}
    finally:
        phase = time.monotonic()
        if sandbox is not None:
            await asyncio.shield(asyncio.to_thread(_stop_quietly, sandbox))
        times.teardown_s = time.monotonic() - phase
        host.sessions.delete(session.key)
        try:
            _fill_capture(out, session.trajectory)
        except Exception as exc:  # same: a fault here must not end the stream
            log.exception("trial %s: capture could not be read", spec.trial_id)
            out.status, out.error = pb.TRIAL_STATUS_ENV_FAILURE, f"rollout server fault reading the capture: {exc!r}"
            out.ClearField("reward")
            del out.sequences[:]
        out.metrics.phase_times.CopyFrom(times)
        out.metrics.tool_calls = max(out.metrics.tool_calls, int(harness_metrics.get("tool_calls", 0)))
    return out


async def _agent_outcome(
    status: pb.TrialStatus,
    reason: str,
    sandbox: Sandbox,
    host: TrialHost,
    memory_mb: int,
    captured: CapturedTrajectory,
    epoch: int,
) -> tuple[pb.TrialStatus, str]:
    """How the agent phase really ended, once the proxy, the sandbox and the engine have had their say."""
    if host.engine_epoch is not None and host.engine_epoch() != epoch:
        # The engine crashed under the agent: what it sampled may come from two processes and versions.
        return pb.TRIAL_STATUS_ENGINE_ERROR, f"inference engine restarted during the trial ({reason or 'no error'})"
    if status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_HARNESS_ERROR) and captured.cap_hit:
        # A CLI told "session limit reached" may exit with an error: the policy spent the budget all the same.
        return pb.TRIAL_STATUS_CAP_EXCEEDED, f"proxy cap: {captured.cap_hit}"
    if status == pb.TRIAL_STATUS_HARNESS_ERROR and captured.calls and captured.calls[-1].finish_reason == "length":
        # The policy's last answer ran into the per-call token limit and the harness gave up on it (Claude
        # Code stops with an API error): the policy's own doing, graded, or RL could never learn to stop
        # rambling from the reward.
        limit = captured.calls[-1].sampling.get("max_tokens", "?")
        return pb.TRIAL_STATUS_CAP_EXCEEDED, f"the last completion hit max_tokens ({limit}), then: {reason}"[:1000]
    if status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_HARNESS_ERROR) and (
        killed := await asyncio.to_thread(sandbox.oom_kill_count)
    ):
        oom = f"out of memory: {killed} process(es) killed at the {memory_mb} MB limit"
        if status == pb.TRIAL_STATUS_OK:
            # The agent's own commands outgrew the memory limit: a cap it hit, graded as the sandbox stands.
            return pb.TRIAL_STATUS_CAP_EXCEEDED, oom
        # The harness died (a CLI killed has exit code 137 and nothing else to say): it may be what outgrew
        # the limit, so the trial stays ungraded, but the reason names the cause.
        return status, f"{reason} ({oom})"[:1000]
    if status == pb.TRIAL_STATUS_HARNESS_ERROR and host.engine_healthy is not None and not await host.engine_healthy():
        # The harness failed because the engine behind the proxy did: not the harness's fault.
        return pb.TRIAL_STATUS_ENGINE_ERROR, f"inference engine is down: {reason}"
    return status, reason


def _wall(spec: TrialSpec) -> float:
    return spec.agent_timeout_s + spec.verifier_timeout_s + 120.0


def _sandbox_spec(host: TrialHost, harness: Harness, spec: TrialSpec) -> SandboxSpec:
    sandbox_spec = spec_for_task(spec.task, spec.trial_id, wall_clock_s=_wall(spec))
    if isinstance(harness, CliHarness) and harness.runtime_memory_mb:
        # The CLI runs inside the task's sandbox: its runtime's memory comes on top of the task's own.
        memory_mb = sandbox_spec.memory_mb + harness.runtime_memory_mb
        sandbox_spec = dataclasses.replace(sandbox_spec, memory_mb=memory_mb)
    # Only a container can mount; the local sandbox shares the host's files, where the CLIs are on PATH.
    if not isinstance(harness, CliHarness) or host.harness_tools is None or host.sandboxes.kind != "docker":
        return sandbox_spec
    tools = host.harness_tools.provision(harness.install_spec(spec.options))
    return dataclasses.replace(sandbox_spec, tool_mounts=tools.mounts, path_prefix=tools.path)


async def _run_agent(
    harness: Harness, sandbox: Sandbox, host: TrialHost, spec: TrialSpec, session: Session
) -> tuple[pb.TrialStatus, str, dict[str, float]]:
    try:
        return await _drive(harness, sandbox, host, spec, session)
    except SandboxError:
        raise  # the environment broke under the harness: ungraded, not the harness's fault
    except Exception as exc:  # a bug in the harness's own code is a harness error, not a server fault
        log.warning("trial %s: harness %s raised", spec.trial_id, harness.name, exc_info=True)
        return pb.TRIAL_STATUS_HARNESS_ERROR, f"{harness.name} raised {exc!r}"[:1000], {}


async def _drive(
    harness: Harness, sandbox: Sandbox, host: TrialHost, spec: TrialSpec, session: Session
) -> tuple[pb.TrialStatus, str, dict[str, float]]:
    key = session.key
    if isinstance(harness, InProcessHarness):
        ctx = HarnessContext(
            session_url=f"http://127.0.0.1:{host.proxy_port}/s/{key}",
            api_key=key,
            model=host.model_name,
            instruction=spec.task.instruction,
        )
        try:
            result = await asyncio.wait_for(
                harness.run(sandbox, ctx, spec.options, deadline_s=spec.agent_timeout_s),
                spec.agent_timeout_s + 30.0,
            )
        except TimeoutError:
            return pb.TRIAL_STATUS_TIMEOUT, f"agent ran past {spec.agent_timeout_s:.0f}s", {}
        await asyncio.to_thread(_leave_final_message, sandbox, result.final_message)
        return _HARNESS_STATUS[result.status], result.reason, result.metrics()
    if isinstance(harness, CliHarness):
        cli = asyncio.ensure_future(_in_own_thread(f"cli-{spec.trial_id}", _run_cli, harness, sandbox, host, spec, key))
        return await _ended_after_cap(cli, sandbox, session.trajectory, spec.trial_id)
    raise SandboxError(f"harness {harness.name} is neither in-process nor a CLI")


async def _ended_after_cap(
    cli: asyncio.Future[tuple[pb.TrialStatus, str, dict[str, float]]],
    sandbox: Sandbox,
    captured: CapturedTrajectory,
    trial_id: str,
) -> tuple[pb.TrialStatus, str, dict[str, float]]:
    """The CLI's outcome; once the proxy has refused it a call for a cap, it has `_CAP_GRACE_S` to
    quit, then the sandbox's processes are ended (`_agent_outcome` reports the cap)."""
    try:
        while not cli.done() and not captured.cap_hit:
            await asyncio.wait({cli}, timeout=_CAP_POLL_S)
        if not cli.done() and not (await asyncio.wait({cli}, timeout=_CAP_GRACE_S))[0]:
            log.info("trial %s: the CLI still runs %.0f s after the proxy's %s: ending it", trial_id,
                     _CAP_GRACE_S, captured.cap_hit)  # fmt: skip
            await asyncio.to_thread(sandbox.kill_all_processes)
        return await cli
    finally:
        cli.cancel()  # only when this wait itself is cancelled: the thread's result is then nobody's


_T = TypeVar("_T")


async def _in_own_thread(name: str, fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)` on a thread of its own. A CLI holds its thread for minutes: in the loop's
    default pool (6 threads on 2 cores) a host's 7th and 8th CLIs waited for a free thread, and
    every trial's sandbox start, verification, teardown and cap kill queued behind the
    running CLIs. Capacity bounds the trials, so it bounds these threads too."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, contextvars.copy_context().run, fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with `fn`; a cancelled wait does not wait for it


def _run_cli(
    harness: CliHarness, sandbox: Sandbox, host: TrialHost, spec: TrialSpec, key: str
) -> tuple[pb.TrialStatus, str, dict[str, float]]:
    install = harness.install_spec(spec.options)
    check = sandbox.exec(install.check_argv(), timeout=_INSTALL_CHECK_S, user=AGENT_USER)
    if check.timed_out:
        command = shlex.join(install.check_argv())
        raise SandboxError(f"{install.requirement()}: the install check `{command}` {check.failure(_INSTALL_CHECK_S)}")
    if not check.ok:
        # Sandboxes reach nothing but the proxy, so a harness cannot be installed at trial time.
        raise SandboxError(
            f"{install.requirement()} does not run in the sandbox ({check.failure(_INSTALL_CHECK_S)}); bake it into "
            "the task image or mount the host's install (sandbox.harness_tools)"
        )
    ctx = HarnessContext(
        session_url=f"http://{sandbox.proxy_host}:{host.proxy_port}/s/{key}",
        api_key=key,
        model=host.model_name,
        instruction=spec.task.instruction,
    )
    launch = harness.launch_spec(ctx, spec.options)
    home = sandbox.exec(
        ["sh", "-c", 'mkdir -p "$1" && chown -R "$2" "$1"', "sh", ctx.home, AGENT_USER], timeout=30, user=ROOT_USER
    )
    if not home.ok:
        raise SandboxError(f"could not create {ctx.home}: {home.failure(30)}")
    for file in launch.files:
        _write_file(sandbox, file.path, file.content, file.mode)
    result = sandbox.exec(
        list(launch.argv), timeout=spec.agent_timeout_s, env=dict(launch.env), workdir=launch.workdir, user=AGENT_USER
    )
    outcome = harness.classify(result.exit_code, result.stdout, result.stderr, result.timed_out)
    return _HARNESS_STATUS[outcome.status], outcome.reason, {}


FINAL_MESSAGE_PATH = f"{AGENT_LOGS_DIR}/final_message.txt"


def _leave_final_message(sandbox: Sandbox, text: str) -> None:
    """The in-process agent's last words where Harbor agents leave their logs, for a verifier that grades
    an answer. Written after the episode, over whatever the agent left at that path: `copy_in` replaces
    a file or link there, never writes through it."""
    with tempfile.TemporaryDirectory(prefix="legorl-final-") as tmp:
        local = Path(tmp) / "final_message.txt"
        local.write_text(text)
        sandbox.copy_in(local, FINAL_MESSAGE_PATH)


def _write_file(sandbox: Sandbox, path: str, content: str, mode: int) -> None:
    """Places a harness config file, owned by the agent user (the CLIs rewrite their own state)."""
    with tempfile.TemporaryDirectory(prefix="legorl-file-") as tmp:
        local = Path(tmp) / "content"
        local.write_text(content)
        # As the agent: a directory made by root (~/.qwen, say) would keep the CLI from writing its own state beside it.
        parent = sandbox.exec(["mkdir", "-p", posixpath.dirname(path)], timeout=30, user=AGENT_USER)
        if not parent.ok:
            raise SandboxError(f"could not create the directory of {path}: {parent.failure(30)}")
        sandbox.copy_in(local, path)
    fix = sandbox.exec(
        ["sh", "-c", 'chown "$1" "$2" && chmod "$3" "$2"', "sh", AGENT_USER, path, f"{mode:o}"],
        timeout=30,
        user=ROOT_USER,
    )
    if not fix.ok:
        raise SandboxError(f"could not hand {path} to {AGENT_USER}: {fix.failure(30)}")


def _resolve(status: pb.TrialStatus, reason: str, verdict: Verdict) -> tuple[pb.TrialStatus, str]:
    if status not in _GRADED:
        return status, reason
    if verdict.status == "env_failure":
        return pb.TRIAL_STATUS_ENV_FAILURE, f"verifier: {verdict.reason}"
    # A graded 0 for want of a reward keeps its reason, so a task that always breaks can be found.
    notes = [reason] if status != pb.TRIAL_STATUS_OK else []
    if verdict.status == "no_reward":
        notes.append(f"verifier: {verdict.reason}")
    return status, "; ".join(notes)


def version_runs(versions: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """The trained tokens' versions as (runs, lengths): the proto's run-length form."""
    runs: list[int] = []
    lengths: list[int] = []
    for version, trained in zip(versions, mask, strict=True):
        if not trained:
            continue
        if runs and runs[-1] == version:
            lengths[-1] += 1
        else:
            runs.append(version)
            lengths.append(1)
    return runs, lengths


def _fill_capture(out: pb.Trajectory, capture: CapturedTrajectory) -> None:
    metrics = capture.metrics()
    for seq in capture.sequences:
        runs, lengths = version_runs(seq.token_versions, seq.loss_mask)
        out.sequences.append(
            pb.TokenSequence(
                token_ids=seq.token_ids,
                loss_mask=seq.loss_mask,
                behavior_logprobs=seq.behavior_logprobs,
                # The oldest version that sampled into it; the session's when no token says.
                policy_version=min(runs, default=seq.policy_version),
                side_call=capture.is_side(seq),
                num_model_calls=len(seq.calls),
                root_reason=capture.root_reason(seq),
                recomputed_tokens=sum(capture.calls[i].recomputed_tokens for i in seq.calls),
                version_runs=runs,
                version_run_lengths=lengths,
                unreported_version_tokens=seq.unreported_versions,
                rerendered=any(capture.calls[i].rerendered for i in seq.calls),
            )
        )
    out.metrics.model_calls = metrics["model_calls"]
    out.metrics.tool_calls = metrics["tool_calls"]
    out.metrics.prompt_tokens = metrics["prompt_tokens"]
    out.metrics.completion_tokens = metrics["completion_tokens"]
    out.metrics.history_rewrites = metrics["new_roots"].get("history_rewritten", 0)
    out.metrics.tool_parse_errors = metrics["parse_errors"]


def _stop_quietly(sandbox: Sandbox) -> None:
    try:
        sandbox.stop()
    except SandboxError as exc:  # the reaper removes what stop() could not
        log.warning("sandbox stop failed: %s", exc)
