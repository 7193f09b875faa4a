"""Grading a trial after its agent has finished: the reward only the verifier decides.

Order matters, each step closing one way an agent could pick its own reward:
1. every process left in the sandbox is killed (a background loop rewriting
   the reward file dies here);
2. `/logs/verifier` and `/tests` are wiped as root (a pre-written reward file
   or planted test is gone);
3. the task's tests are copied in fresh from the host (the agent never saw them)
   and made root's alone, so agent code a test runs as the `agent` user can
   neither read the expected answers nor change the checker;
4. `tests/test.sh` runs as root with the task's timeout;
5. every process grading started is killed, then the reward is read from
   `/logs/verifier/reward.txt` or `reward.json`.
Agents run as the unprivileged `agent` user, so they cannot replace the
interpreters test.sh uses; an agent run as root could, and no verifier inside
the same container can defend against that.

Who is to blame when no reward comes out decides the status. The sandbox
breaking (container gone, Docker errors, copies failing) is the environment's
fault: `env_failure`, ungraded. Tests that ran in a healthy sandbox and wrote
no valid reward (they crashed, hung or wrote garbage) were broken by what the
agent left behind (a FIFO where a report should be, a directory, a file too big
to read): `no_reward`, graded 0 with the reason kept. A task whose tests are
broken for every output shows up as its reference solution scoring 0.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout_server.sandbox.base import (
    AGENT_USER,
    ROOT_USER,
    SOLUTION_DIR,
    TESTS_DIR,
    VERIFIER_LOGS_DIR,
    ExecResult,
    Sandbox,
    SandboxError,
)
from rollout_server.tasks import Task

# ok: the tests wrote a reward; no_reward: they ran but wrote none (graded 0); env_failure: ungraded.
VerifierStatus = Literal["ok", "no_reward", "env_failure"]
_TAIL = 4000


@dataclass(frozen=True)
class Verdict:
    status: VerifierStatus
    reward: float | None
    reason: str
    metrics: dict[str, float] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0


def _as_reward(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def parse_reward(log_dir: Path) -> tuple[float, dict[str, float]]:
    """Read reward.json (preferred, may carry extra metrics) or reward.txt; ValueError says what is wrong."""
    json_path, txt_path = log_dir / "reward.json", log_dir / "reward.txt"
    if json_path.is_file():
        try:
            data = json.loads(json_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"reward.json is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("reward.json must be a JSON object")
        numbers = {k: r for k, v in data.items() if (r := _as_reward(v)) is not None}
        if "reward" in data:
            reward = _as_reward(data["reward"])
            if reward is None:
                raise ValueError(f"reward.json: 'reward' is {data['reward']!r}, not a finite number")
        elif len(numbers) == 1:
            reward = next(iter(numbers.values()))
        else:
            raise ValueError("reward.json has no 'reward' key and not exactly one numeric value")
        return reward, numbers
    if txt_path.is_file():
        text = txt_path.read_text(encoding="utf-8", errors="replace").strip()
        try:
            reward = float(text)
        except ValueError as exc:
            raise ValueError(f"reward.txt holds {text[:80]!r}, not a number") from exc
        if not math.isfinite(reward):
            raise ValueError(f"reward.txt holds {text!r}, not a finite number")
        return reward, {"reward": reward}
    raise ValueError("neither reward.txt nor reward.json was written")


def _env_failure(reason: str, result: ExecResult | None = None, started: float | None = None) -> Verdict:
    return Verdict(
        status="env_failure",
        reward=None,
        reason=reason,
        stdout=result.stdout[-_TAIL:] if result else "",
        stderr=result.stderr[-_TAIL:] if result else "",
        wall_s=time.monotonic() - started if started is not None else 0.0,
    )


def _no_reward(reason: str, result: ExecResult, started: float) -> Verdict:
    return Verdict(
        status="no_reward",
        reward=0.0,
        reason=f"graded 0: {reason}",
        stdout=result.stdout[-_TAIL:],
        stderr=result.stderr[-_TAIL:],
        wall_s=time.monotonic() - started,
    )


# Wipe what the agent could have planted, then hand the fresh tests to root alone.
_RESET = 'rm -rf -- "$1" "$2" && mkdir -p -- "$1"'
# (A local sandbox run by an ordinary user cannot chown; it isolates nothing anyway.)
_SEAL = 'if [ "$(id -u)" = 0 ]; then chown -R 0:0 -- "$1"; fi && chmod -R go-rwx -- "$1"'


def _root(sandbox: Sandbox, script: str, *args: str) -> ExecResult:
    return sandbox.exec(["sh", "-c", script, "sh", *args], timeout=30, user=ROOT_USER)


def verify(sandbox: Sandbox, task: Task, timeout_s: float | None = None) -> Verdict:
    """Grade the sandbox's current state with the task's tests. Never raises for sandbox trouble."""
    started = time.monotonic()
    timeout_s = timeout_s if timeout_s is not None else task.config.verifier.timeout_sec
    try:
        if (reason := sandbox.failure_reason()) is not None:
            return _env_failure(f"sandbox unusable before verification: {reason}", started=started)
        sandbox.kill_all_processes()
        reset = _root(sandbox, _RESET, VERIFIER_LOGS_DIR, TESTS_DIR)
        if not reset.ok:
            return _env_failure(f"could not reset {VERIFIER_LOGS_DIR} and {TESTS_DIR}", reset, started)
        sandbox.copy_in(task.tests_dir, TESTS_DIR)
        sealed = _root(sandbox, _SEAL, TESTS_DIR)
        if not sealed.ok:
            return _env_failure(f"could not make {TESTS_DIR} root's alone", sealed, started)
        result = sandbox.exec(
            ["bash", f"{TESTS_DIR}/test.sh"], timeout=timeout_s, env=task.config.verifier.env, user=ROOT_USER
        )
        # Agent code a test started (as the agent user) must not outlive grading into the reward read.
        sandbox.kill_all_processes()
        if (reason := sandbox.failure_reason()) is not None:
            return _env_failure(f"sandbox failed during verification: {reason}", result, started)
        if result.timed_out:
            return _no_reward(f"tests/test.sh ran past {timeout_s:.0f}s", result, started)
        with tempfile.TemporaryDirectory(prefix="legorl-verdict-") as tmp:
            logs = Path(tmp) / "verifier"
            sandbox.copy_out(VERIFIER_LOGS_DIR, logs)
            try:
                reward, metrics = parse_reward(logs)
            except ValueError as exc:
                return _no_reward(f"tests/test.sh exited {result.exit_code}: {exc}", result, started)
    except SandboxError as exc:
        return _env_failure(f"sandbox error during verification: {exc}", started=started)
    return Verdict(
        "ok",
        reward,
        f"graded (test.sh exit {result.exit_code})",
        metrics,
        result.stdout[-_TAIL:],
        result.stderr[-_TAIL:],
        time.monotonic() - started,
    )


def run_solution(sandbox: Sandbox, task: Task, timeout_s: float | None = None) -> ExecResult:
    """Run the task's reference solution/solve.sh as the agent would (to check that the verifier can score 1)."""
    if task.solution_dir is None:
        raise SandboxError(f"task {task.name} has no solution/solve.sh")
    sandbox.copy_in(task.solution_dir, SOLUTION_DIR)
    return sandbox.exec(
        ["bash", f"{SOLUTION_DIR}/solve.sh"],
        timeout=timeout_s if timeout_s is not None else task.config.agent.timeout_sec,
        env=task.config.solution.env,
        user=AGENT_USER,
    )
