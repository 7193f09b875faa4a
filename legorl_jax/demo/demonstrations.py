"""Synthetic demonstrations for the embedded default's supervised warm start.

A demonstration is a real `lego` episode, captured by the real token-capture
proxy, in which the engine is replaced by `SolutionOracle`: a scripted
stand-in that answers each model call with the next move of a plan built from
the task's own `solution/solve.sh` (look around, run the solution as one shell
command, finish). Because the harness, the proxy's rendering and its
trajectory assembly are the ones RL runs through, the captured token ids and
loss masks are exactly what the policy will later be asked to produce, in the
harness configurations it will be trained in. Every episode is graded by the
task's verifier in a fresh local sandbox; only episodes that score 1 are kept.

Nothing here is task-specific: any Harbor task with a `solution/solve.sh`
(including generated variants) yields demonstrations.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from legorl_jax.core.config import SamplingConfig
from legorl_jax.serve.server import BackgroundServer
from rollout_server.harnesses import HarnessContext
from rollout_server.harnesses.lego import Lego, LegoOptions, LegoResult, config_id
from rollout_server.harnesses.lego.tools import SUBMIT, TOOL_SETS
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import CompletionParams, EngineCompletion
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionSpec, SessionStore
from rollout_server.sandbox.base import SandboxError
from rollout_server.sandbox.factory import spec_for_task
from rollout_server.sandbox.local import LocalSandbox
from rollout_server.tasks import Task
from rollout_server.verifier import Verdict, verify

log = logging.getLogger(__name__)

# Plans: the moves of one episode. "describe" is the habit of a weak teacher:
# it answers with the right command in prose instead of running it, so the
# episode fails. A warm start that imitates it as often as the working plans
# is an agent that often talks instead of acting: RL has to find out, from
# the verifier's reward alone, that acting is what pays.
PLANS: dict[str, tuple[str, ...]] = {
    "direct": ("solve", "finish"),
    "explore": ("explore", "solve", "finish"),
    "describe": ("describe",),
}
FAILING_PLANS = frozenset({"describe"})
EXPLORE_COMMAND = "ls -la"
FINISH_TEXT = "Done."
DESCRIBE_TEXT = "To do this, run:\n{command}"
PLAN_TEXT = "1. Look at the files.\n2. Make the change.\n3. Check it and finish."
_MODEL_NAME = "demonstration-oracle"


class DemonstrationError(RuntimeError):
    """A task or configuration that cannot be demonstrated; the message says which and why."""


def solution_command(task: Task) -> str:
    """The task's solve.sh as one bash command: shebang and comment-only lines dropped."""
    if task.solution_dir is None:
        raise DemonstrationError(f"task {task.name}: no solution/solve.sh to demonstrate")
    text = (task.solution_dir / "solve.sh").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    command = "\n".join(lines).strip()
    if not command:
        raise DemonstrationError(f"task {task.name}: solution/solve.sh has no commands")
    return command


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One tool call as the model writes it: Qwen3's Hermes format, which the proxy parses."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def plan_texts(plan: Sequence[str], options: LegoOptions, command: str) -> list[str]:
    """The completion text of every model call the episode will make, in order."""
    tools = TOOL_SETS[options.tools]
    shell = "bash" if "bash" in tools else "run"
    if shell not in tools:
        raise DemonstrationError(f"lego tool set {options.tools!r} has no shell tool to run a solution with")
    moves = {
        "explore": tool_call_text(shell, {"command": EXPLORE_COMMAND}),
        "solve": tool_call_text(shell, {"command": command}),
        "finish": tool_call_text(SUBMIT, {"summary": FINISH_TEXT}) if SUBMIT in tools else FINISH_TEXT,
        "describe": DESCRIBE_TEXT.format(command=command),
    }
    unknown = [move for move in plan if move not in moves]
    if unknown:
        raise DemonstrationError(f"unknown plan moves {unknown}; known: {sorted(moves)}")
    # plan_first asks once, without tools, for a plan before the agent turns.
    head = [PLAN_TEXT] if options.prompt == "plan_first" else []
    return head + [moves[move] for move in plan]


class SolutionOracle:
    """The demonstration generator's engine: answers the proxy's calls with scripted text.

    Implements the one method the proxy's core calls on an engine. Episodes
    run one at a time; `begin` loads the next episode's completions.
    """

    def __init__(self, template: ChatTemplate) -> None:
        self._template = template
        self._pending: list[str] = []
        self.unanswered = 0

    def begin(self, texts: Iterable[str]) -> None:
        self._pending = list(texts)
        self.unanswered = 0

    @property
    def done(self) -> bool:
        return not self._pending

    async def complete(self, prompt_ids: list[int], sampling: CompletionParams) -> EngineCompletion:
        if not self._pending:
            # The harness asked for more than the plan holds: answer with the end of turn, and report it.
            self.unanswered += 1
            return EngineCompletion((self._template.turn_end_id,), (0.0,), "stop")
        ids = [*self._template.encode(self._pending.pop(0)), self._template.turn_end_id]
        if len(ids) > sampling.max_tokens:
            raise DemonstrationError(
                f"a scripted completion has {len(ids)} tokens, over max_tokens={sampling.max_tokens}"
            )
        return EngineCompletion(tuple(ids), (0.0,) * len(ids), "stop")


@dataclass(frozen=True)
class Demonstration:
    """One verified episode: its captured token sequences (ids + loss masks) and its reward."""

    task: str
    config_id: str
    plan: str
    sequences: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (token_ids, loss_mask) per sequence
    reward: float = 1.0  # what the verifier gave: 0 for the failing plans

    @property
    def group(self) -> tuple[str, str]:
        """Episodes of one (task, configuration) differ only in their plan."""
        return self.task, self.config_id


class _Recorder:
    def __init__(self, tokenizer: Any, workdir: str, max_context: int, max_tokens: int) -> None:
        template = ChatTemplate(tokenizer)
        self.oracle = SolutionOracle(template)
        self.store = SessionStore()
        # Duck-typed: the oracle has the one method the core calls on its engine client.
        self.core = ProxyCore(template, self.oracle, self.store, max_context=max_context)  # type: ignore[arg-type]
        self.workdir = workdir
        self.max_tokens = max_tokens

    async def episode(self, proxy_url: str, task: Task, options: LegoOptions, plan: str) -> Demonstration | None:
        self.oracle.begin(plan_texts(PLANS[plan], options, solution_command(task)))
        trial = f"demo-{task.name}-{secrets.token_hex(4)}"
        session = self.store.create(SessionSpec(sampling=SamplingConfig(max_tokens=self.max_tokens)))
        # RLIMIT_NPROC counts every process of the (shared) user id, so the cap is generous.
        sandbox = LocalSandbox(spec_for_task(task, trial, pids_limit=4096))
        try:
            await asyncio.to_thread(sandbox.start)
            ctx = HarnessContext(
                session_url=f"{proxy_url}/s/{session.key}",
                api_key=session.key,
                model=_MODEL_NAME,
                instruction=task.instruction,
                workdir=self.workdir,
            )
            result = await Lego().run(sandbox, ctx, options, deadline_s=task.config.agent.timeout_sec)
            verdict = await asyncio.to_thread(verify, sandbox, task)
        finally:
            await asyncio.to_thread(sandbox.stop)
            self.store.delete(session.key)
        expected = 0.0 if plan in FAILING_PLANS else 1.0
        problems = _problems(result, verdict, self.oracle, expected)
        if problems:
            label = f"{task.name} / {config_id(options)} / {plan}"
            log.warning("demonstration dropped (%s): %s", label, "; ".join(problems))
            return None
        sequences = tuple((tuple(s.token_ids), tuple(s.loss_mask)) for s in session.trajectory.sequences)
        return Demonstration(task.name, config_id(options), plan, sequences, expected)


def _problems(result: LegoResult, verdict: Verdict, oracle: SolutionOracle, expected: float) -> list[str]:
    """Why an episode is not a clean demonstration of its plan; empty when it is."""
    problems = []
    if result.status != "ok" or result.stop_reason not in ("submitted", "answered"):
        problems.append(f"harness ended {result.status}/{result.stop_reason} {result.reason}".strip())
    if not oracle.done:
        problems.append("the plan was not used up")
    if oracle.unanswered:
        problems.append(f"{oracle.unanswered} calls beyond the plan")
    if result.tool_errors:
        problems.append(f"{result.tool_errors} tool errors")
    if verdict.reward != expected:
        problems.append(f"verifier: {verdict.status}, reward {verdict.reward} ({verdict.reason})")
    return problems


async def _record_all(
    recorder: _Recorder, tasks: Sequence[Task], options: Sequence[LegoOptions], plans: Sequence[str]
) -> list[Demonstration]:
    server = await asyncio.to_thread(BackgroundServer(build_app(recorder.core)).start)
    try:
        kept = []
        for task in tasks:
            for opts in options:
                for plan in plans:
                    demo = await recorder.episode(server.url, task, opts, plan)
                    if demo is not None:
                        kept.append(demo)
        return kept
    finally:
        await asyncio.to_thread(server.stop)


def record_demonstrations(
    tokenizer: Any,
    tasks: Sequence[Task],
    options: Sequence[LegoOptions],
    *,
    plans: Sequence[str] = tuple(PLANS),
    workdir: str = "/app",
    max_context: int = 2048,
    max_tokens: int = 256,
) -> list[Demonstration]:
    """Run and verify one oracle episode per task x lego configuration x plan.

    Working plans must score 1 and the failing ones (`FAILING_PLANS`) 0.

    `tokenizer` is the policy's HF tokenizer (its chat template renders the
    prompts). `max_context` and `max_tokens` are the limits RL will sample
    under, so a demonstration the policy could not reproduce there is dropped.
    Episodes that do not score as their plan should are dropped with a warning; a
    task without a single working demonstration is an error, since training would
    then never see it solved.
    Uses the local sandbox (bubblewrap when installed), so Harbor paths like
    /app work without Docker.
    """
    if not tasks or not options:
        raise DemonstrationError("need at least one task and one lego configuration")
    unknown = [plan for plan in plans if plan not in PLANS]
    if unknown or not plans:
        raise DemonstrationError(f"plans must be a non-empty subset of {sorted(PLANS)}, got {list(plans)}")
    for task in tasks:
        solution_command(task)  # fail early, naming the task
    try:
        demos = asyncio.run(_record_all(_Recorder(tokenizer, workdir, max_context, max_tokens), tasks, options, plans))
    except SandboxError as exc:
        raise DemonstrationError(f"the local sandbox failed while recording demonstrations: {exc}") from exc
    missing = sorted({t.name for t in tasks} - {d.task for d in demos if d.reward == 1.0})
    if missing:
        raise DemonstrationError(f"no demonstration of {missing} scored 1; see the warnings above")
    return demos
