"""Demonstrations recorded through the real harness CLIs, for the CLI demo's warm start.

The lego demonstrations (`demonstrations.py`) generalized to any harness: each
episode is a real trial (`rollout_server.trial.run_trial`) of an unmodified
CLI in a Docker sandbox, talking to the real token-capture proxy, graded by
the task's verifier. The engine behind the proxy is `CliOracle`, a scripted
stand-in that plays a plan (look around, run the task's solution as one shell
command, finish; or the weak teacher's `describe` habit, the command in prose
with no tool call). Like a model, it reads the tools it may call from its
prompt and calls the shell tool offered there; all it knows of a harness is
one small entry of `CLI_MOVES`: the name of that shell tool and how an episode
ends. Kept, as for lego: working plans that score 1 and habit episodes that
score 0.

Episodes run concurrently, a bounded number at once, behind one proxy: each
call reaches the oracle of its own episode (found by the session's trial
label), so an episode's tokens never depend on what else is running.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import docker
import uvicorn

from legorl_jax.core.aio import completion_order
from legorl_jax.core.config import REPO_ROOT, HarnessToolsConfig, cache_root
from legorl_jax.demo.demonstrations import (
    DESCRIBE_TEXT,
    EXPLORE_COMMAND,
    FAILING_PLANS,
    FINISH_TEXT,
    Demonstration,
    DemonstrationError,
    solution_command,
    tool_call_text,
)
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.harnesses import get_harness
from rollout_server.harnesses.base import CliHarness
from rollout_server.harnesses.tools import HarnessTools
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import CompletionParams, EngineCompletion
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import PreparedCall, ProxyCore, TurnResult
from rollout_server.proxy.session import SessionStore
from rollout_server.sandbox.factory import SandboxFactory
from rollout_server.server import _bind  # the rollout server's listening socket, shared by two addresses
from rollout_server.tasks import Task
from rollout_server.trial import TrialHost, TrialSpec, run_trial

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CliMoves:
    """What the oracle knows of one harness: the shell tool it offers, and how its episode ends."""

    shell: str  # the tool's name in the request's tool list
    # A command that ends the episode (run through the shell tool); None: a plain answer ends it.
    finish_command: str | None = None
    # Arguments of every shell call besides the command, where filling in `REQUIRED_TEXT` would not do.
    arguments: Mapping[str, Any] = field(default_factory=dict)


CLI_MOVES: dict[str, CliMoves] = {
    "claude-code": CliMoves("Bash"),
    "codex": CliMoves("exec_command"),
    "opencode": CliMoves("bash"),
    "gemini-cli": CliMoves("run_shell_command"),
    "qwen-code": CliMoves("run_shell_command"),
    # Its terminal tool requires a risk level (an enum) with every command.
    "openhands": CliMoves("terminal", arguments={"security_risk": "LOW"}),
    "mini-swe-agent": CliMoves("bash", finish_command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
}
# The plans a CLI episode can play (see demonstrations.PLANS). A harness may drop a turn without a
# tool call from its history (mini-swe-agent answers it with a format error): the habit then
# describes again, as a weak model would, until the harness gives up.
CLI_PLANS: dict[str, tuple[str, ...]] = {
    "direct": ("solve", "finish"),
    "explore": ("explore", "solve", "finish"),
    "describe": ("describe",),
}
# What a side call (OpenCode's title, Qwen Code's memory extraction) is answered with.
SIDE_TEXT = "Solving the task"
# The argument filled in for any other required string parameter of the shell tool.
REQUIRED_TEXT = "Run a shell command"
_COMMAND_ARGS = ("command", "cmd")
_MODEL_NAME = "demonstration-oracle"
# What fixes the CLIs' versions (and so their prompts): the npm lock and setup's pip pins.
CLI_PINS = (REPO_ROOT / "scripts" / "harness-cli" / "package-lock.json", REPO_ROOT / "scripts" / "setup")
# Episodes in flight at once by default: the fastest setting that kept every episode on a 2-core machine
# (scripts/bench_cli_record.py, docs/benchmarks.md); six at once starved OpenHands' start-up there.
RECORD_CONCURRENCY = 4
# The share of Docker's memory that the sandboxes in flight may hold at their limits; the rest is left
# to the host's own processes (this recorder, the CLIs' installs, other jobs).
DOCKER_MEMORY_SHARE = 0.5
_ASSISTANT = "<|im_start|>assistant\n"
_TOOLS_START, _TOOLS_END = "<tools>\n", "\n</tools>"


def harness_tools_config() -> HarnessToolsConfig:
    """Where scripts/setup installs the harness CLIs on this host."""
    cache = cache_root()
    # Set-up leaves OpenHands out without a Python >= 3.12; a trial of a CLI that is not there fails
    # its install check, which names it.
    venvs = [cache / name for name in ("mini-venv", "openhands-venv")]
    return HarnessToolsConfig(npm_dir=str(cache / "harness-cli"), pip_venvs=[str(v) for v in venvs if v.is_dir()])


def offered_tools(prompt: str) -> dict[str, dict[str, Any]]:
    """The tools a rendered prompt offers (the demo chat template: one JSON object a line in <tools>)."""
    start = prompt.find(_TOOLS_START)
    if start < 0:
        return {}
    end = prompt.find(_TOOLS_END, start)
    tools = {}
    for line in prompt[start + len(_TOOLS_START) : end].splitlines():
        spec = json.loads(line)
        fn = spec.get("function", spec)
        tools[fn["name"]] = fn
    return tools


def shell_call(tool: dict[str, Any], command: str, arguments: Mapping[str, Any] | None = None) -> str:
    """A call of `tool` running `command` with `arguments`, the rest read from the tool's JSON schema."""
    params = tool.get("parameters") or {}
    props = params.get("properties") or {}
    name = next((p for p in _COMMAND_ARGS if p in props), None)
    if name is None:
        raise DemonstrationError(f"shell tool {tool['name']!r} takes none of {_COMMAND_ARGS}: {sorted(props)}")
    args: dict[str, Any] = {name: command, **(arguments or {})}
    for required in params.get("required") or ():
        if required not in args:
            if (props.get(required) or {}).get("type") != "string":
                raise DemonstrationError(f"shell tool {tool['name']!r} requires {required!r}, not a string")
            args[required] = REQUIRED_TEXT
    return tool_call_text(tool["name"], args)


@dataclass
class EpisodeLog:
    """What the oracle saw of one episode: every prompt's length, side calls apart."""

    prompt_tokens: list[int] = field(default_factory=list)
    sampled: list[tuple[int, ...]] = field(default_factory=list)  # the ids answered to each call with tools
    side_prompt_tokens: list[int] = field(default_factory=list)
    unanswered: int = 0  # calls beyond the plan


class CliOracle:
    """The engine behind the proxy while recording: answers each call with the plan's next move.

    The move is found from the prompt alone (the sampled turns already in it),
    so a harness that retries a call gets the same move again. The episode's
    main conversation is the first call with tools; a call without tools, or
    with another system prompt or tool set (Qwen Code's memory extraction), is
    a side call and gets `SIDE_TEXT`, as the proxy tells them apart
    (`ChatRequest.root_key`). One oracle per episode.
    """

    def __init__(self, template: ChatTemplate, moves: CliMoves, plan: tuple[str, ...], command: str) -> None:
        self._template = template
        self._moves, self._plan, self._command = moves, plan, command
        self._main: tuple[str, tuple[str, ...]] | None = None  # the main conversation's root
        self._seeded = 0  # assistant turns the harness wrote itself before the first move
        self.log = EpisodeLog()

    def _main_turns(self, prompt: str, tools: dict[str, dict[str, Any]]) -> int | None:
        """The assistant turns already in a main-conversation prompt; None for a side call."""
        if not tools:
            return None
        root = (prompt[: prompt.find(_TOOLS_START)], tuple(sorted(tools)))
        turns = prompt.count(_ASSISTANT) - 1  # the last header is the turn being asked for
        if self._main is None:
            # Harnesses may open with a scripted exchange (Qwen Code answers its own context message
            # "Got it. Thanks for the context!"): those turns are no moves of the plan.
            self._main, self._seeded = root, turns
        return turns if root == self._main else None

    def _move(self, done: int, tools: dict[str, dict[str, Any]]) -> str | None:
        """The plan's next move as completion text, `done` moves in; None past the plan's end."""
        if done >= len(self._plan):
            self.log.unanswered += 1
            return None
        move = self._plan[done]
        if move == "describe":
            return DESCRIBE_TEXT.format(command=self._command)
        if move == "finish" and self._moves.finish_command is None:
            return FINISH_TEXT
        shell = tools.get(self._moves.shell)
        if shell is None:
            raise DemonstrationError(f"the request offers no {self._moves.shell!r} tool, only {sorted(tools)}")
        command = {"explore": EXPLORE_COMMAND, "solve": self._command}.get(move, self._moves.finish_command)
        assert command is not None  # finish without a finish command answered above
        return shell_call(shell, command, self._moves.arguments)

    async def complete(self, prompt_ids: list[int], sampling: CompletionParams) -> EngineCompletion:
        prompt = self._template.decode(prompt_ids)
        tools = offered_tools(prompt)
        turns = self._main_turns(prompt, tools)
        text = SIDE_TEXT if turns is None else self._move(turns - self._seeded, tools)
        # Nothing left to say: the end of turn alone (and the episode is reported, see `unanswered`).
        ids = (*self._template.encode(text or ""), self._template.turn_end_id)
        if len(ids) > sampling.max_tokens:
            raise DemonstrationError(
                f"a scripted completion has {len(ids)} tokens, over max_tokens={sampling.max_tokens}"
            )
        if turns is None:
            self.log.side_prompt_tokens.append(len(prompt_ids))
        else:
            self.log.prompt_tokens.append(len(prompt_ids))
            self.log.sampled.append(ids)
        return EngineCompletion(ids, (0.0,) * len(ids), "stop")


@dataclass(frozen=True)
class CliEpisode:
    """One recorded trial: the demonstration (None when dropped) and what it cost."""

    harness: str
    task: str
    plan: str
    status: str
    reward: float | None
    demonstration: Demonstration | None
    model_calls: int
    side_calls: int
    first_prompt_tokens: int
    total_tokens: int  # every sequence's length, side calls included
    wall_s: float
    calls: EpisodeLog
    problems: tuple[str, ...] = ()


# The oracle of the episode whose call the proxy is executing (set by `_EpisodeCore.execute`).
_ORACLE: contextvars.ContextVar[CliOracle] = contextvars.ContextVar("cli_oracle")


class _CallsOracle:
    """The proxy's engine: hands each call to its episode's oracle. Duck-typed: the one method the core
    calls on its engine client."""

    async def complete(self, prompt_ids: list[int], sampling: CompletionParams) -> EngineCompletion:
        return await _ORACLE.get().complete(prompt_ids, sampling)


class _EpisodeCore(ProxyCore):
    """The proxy core, each call's engine the oracle of its session's trial: the engine is given only
    the prompt, and concurrent episodes share one proxy."""

    def __init__(self, template: ChatTemplate, store: SessionStore, oracles: dict[str, CliOracle], **kw: Any) -> None:
        super().__init__(template, _CallsOracle(), store, **kw)  # type: ignore[arg-type]
        self._oracles = oracles

    async def execute(self, call: PreparedCall) -> TurnResult:
        token = _ORACLE.set(self._oracles[call.session.spec.labels["trial"]])
        try:
            return await super().execute(call)
        finally:
            _ORACLE.reset(token)


class CliRecorder:
    """The proxy (with each episode's oracle as its engine) on loopback and the Docker proxy network,
    and trials run by the rollout server's own trial runner, any number at once. Use
    `async with CliRecorder.running(...)`."""

    def __init__(self, tokenizer: Any, *, max_context: int, max_tokens: int, agent_timeout_s: float) -> None:
        self.template = ChatTemplate(tokenizer)
        self.oracles: dict[str, CliOracle] = {}  # by trial id, while the trial runs
        self.store = SessionStore()
        self.core = _EpisodeCore(self.template, self.store, self.oracles, max_context=max_context)
        self.max_tokens = max_tokens
        self.agent_timeout_s = agent_timeout_s
        self.host: TrialHost | None = None
        self.docker_memory_mb = 0

    @classmethod
    @asynccontextmanager
    async def running(
        cls, tokenizer: Any, *, max_context: int, max_tokens: int = 1024, agent_timeout_s: float = 240.0
    ) -> AsyncIterator[CliRecorder]:
        recorder = cls(tokenizer, max_context=max_context, max_tokens=max_tokens, agent_timeout_s=agent_timeout_s)
        loopback = _bind("127.0.0.1", 0)
        port = loopback.getsockname()[1]
        factory = await asyncio.to_thread(SandboxFactory, "docker", "proxy_only", proxy_port=port)
        tools = HarnessTools.from_config(harness_tools_config())
        sockets = [loopback]
        if factory.network is not None:
            sockets.append(_bind(factory.network.gateway, port))
        server = uvicorn.Server(uvicorn.Config(build_app(recorder.core), log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=sockets))
        recorder.host = TrialHost(factory, recorder.store, port, _MODEL_NAME, 0, harness_tools=tools)
        recorder.docker_memory_mb = await asyncio.to_thread(_docker_memory_mb)
        try:
            yield recorder
        finally:
            server.should_exit = True
            await serving
            factory.close()
            tools.close()

    def memory_bound(self, jobs: Sequence[tuple[Task, str, str]]) -> int:
        """Episodes that fit at once in Docker's memory share, each sandbox at its limit (the task's memory
        and the CLI runtime's, as the trial runner sets it: Qwen Code's JS heap)."""
        sizes = [task.config.environment.memory_mb + _runtime_memory_mb(harness) for task, harness, _ in jobs]
        worst = max(sizes, default=1)
        return max(1, int(self.docker_memory_mb * DOCKER_MEMORY_SHARE) // worst)

    async def record(self, jobs: Sequence[tuple[Task, str, str]], concurrency: int) -> list[CliEpisode]:
        """Each (task, harness, plan) as `episode`, up to `concurrency` at once (fewer when Docker's
        memory share would not hold them), in the order of `jobs` whatever order they finish in."""
        if concurrency < 1:
            raise DemonstrationError(f"concurrency must be at least 1, got {concurrency}")
        bound = min(concurrency, self.memory_bound(jobs))
        if bound < concurrency:
            log.warning(
                "recording %d episodes at once, not %d: Docker has %d MB", bound, concurrency, self.docker_memory_mb
            )
        log.info("recording %d CLI episodes, %d at once", len(jobs), bound)
        slots = asyncio.Semaphore(bound)  # wakes waiters first come, first served: episodes start in order

        async def one(index: int, job: tuple[Task, str, str]) -> tuple[int, CliEpisode]:
            async with slots:
                return index, await self.episode(*job)

        started = time.monotonic()
        episodes: dict[int, CliEpisode] = {}
        tasks = [asyncio.create_task(one(i, job)) for i, job in enumerate(jobs)]
        async with completion_order(tasks) as finished:
            for future in finished:
                index, episode = await future
                episodes[index] = episode
                log.info(
                    "%d/%d CLI episodes recorded in %.0f s (%s / %s / %s: %s)",
                    len(episodes),
                    len(jobs),
                    time.monotonic() - started,
                    episode.task,
                    episode.harness,
                    episode.plan,
                    "dropped" if episode.problems else "kept",
                )
        return [episodes[i] for i in range(len(jobs))]

    async def episode(self, task: Task, harness: str, plan: str, options: dict[str, Any] | None = None) -> CliEpisode:
        """One trial of `harness` on `task` playing `plan`, graded; its demonstration when it scored as it should."""
        assert self.host is not None, "use CliRecorder.running()"
        if harness not in CLI_MOVES:
            raise DemonstrationError(f"no oracle moves for harness {harness!r}; known: {sorted(CLI_MOVES)}")
        moves = CLI_MOVES[harness]
        if plan not in CLI_PLANS:
            raise DemonstrationError(f"unknown plan {plan!r}; known: {sorted(CLI_PLANS)}")
        oracle = CliOracle(self.template, moves, CLI_PLANS[plan], solution_command(task))
        impl = get_harness(harness)
        parsed = impl.parse_options(options or {})
        config_id = impl.config_id(parsed)
        spec = TrialSpec(
            trial_id=f"demo-{harness}-{task.name}-{plan}-{secrets.token_hex(3)}",
            task=task,
            harness=pb.HarnessConfig(name=harness, options_json=json.dumps(options or {}), config_id=config_id),
            options=parsed,
            sampling=pb.SamplingParams(max_tokens=self.max_tokens),
            limits=pb.TrialLimits(max_model_calls=12, max_total_tokens=10_000_000),
            labels={},
            agent_timeout_s=self.agent_timeout_s,
            verifier_timeout_s=task.config.verifier.timeout_sec,
        )
        started = time.monotonic()
        self.oracles[spec.trial_id] = oracle
        try:
            trajectory = await run_trial(self.host, spec)
        finally:
            del self.oracles[spec.trial_id]
        wall = time.monotonic() - started
        expected = 0.0 if plan in FAILING_PLANS else 1.0
        reward = trajectory.reward if trajectory.HasField("reward") else None
        problems = _problems(trajectory, reward, expected, oracle.log)
        sequences = tuple((tuple(s.token_ids), tuple(s.loss_mask)) for s in trajectory.sequences)
        demo = None if problems else Demonstration(task.name, config_id, plan, sequences, expected)
        if problems:
            log.warning("demonstration dropped (%s / %s / %s): %s", task.name, harness, plan, "; ".join(problems))
        return CliEpisode(
            harness=harness,
            task=task.name,
            plan=plan,
            status=pb.TrialStatus.Name(trajectory.status),
            reward=reward,
            demonstration=demo,
            model_calls=trajectory.metrics.model_calls,
            side_calls=len(oracle.log.side_prompt_tokens),
            first_prompt_tokens=oracle.log.prompt_tokens[0] if oracle.log.prompt_tokens else 0,
            total_tokens=sum(len(s.token_ids) for s in trajectory.sequences),
            wall_s=wall,
            calls=oracle.log,
            problems=tuple(problems),
        )


def _docker_memory_mb() -> int:
    client = docker.from_env()
    try:
        return int(client.info()["MemTotal"]) >> 20
    finally:
        client.close()


def _runtime_memory_mb(harness: str) -> int:
    impl = get_harness(harness)
    return impl.runtime_memory_mb if isinstance(impl, CliHarness) else 0


def _problems(trajectory: pb.Trajectory, reward: float | None, expected: float, seen: EpisodeLog) -> list[str]:
    """Why a trial is not a clean demonstration of its plan; empty when it is."""
    problems = []
    if trajectory.status != pb.TRIAL_STATUS_OK:
        problems.append(f"trial ended {pb.TrialStatus.Name(trajectory.status)}: {trajectory.error}")
    if seen.unanswered:
        problems.append(f"{seen.unanswered} calls beyond the plan")
    if reward != expected:
        problems.append(f"reward {reward}, expected {expected}")
    if not trajectory.sequences:
        problems.append("nothing captured")
    return problems


def record_cli_demonstrations(
    tokenizer: Any,
    tasks: Sequence[Task],
    harnesses: Sequence[str],
    *,
    plans: Sequence[str] = ("direct", "describe"),
    max_context: int = 131072,
    max_tokens: int = 1024,
    concurrency: int = RECORD_CONCURRENCY,
) -> list[CliEpisode]:
    """Every task x harness x plan, up to `concurrency` trials at once, in that order: the same episodes
    at any concurrency, as the oracle's answers depend on its own episode's prompts alone (some CLIs
    write a date or an id of their own into the prompts, which differs between any two recordings).

    `max_context` and `max_tokens` are the limits RL will sample under: an episode that does not fit them is dropped.
    """
    if not tasks or not harnesses:
        raise DemonstrationError("need at least one task and one harness")
    unknown = sorted({h for h in harnesses if h not in CLI_MOVES} | {p for p in plans if p not in CLI_PLANS})
    if unknown:
        raise DemonstrationError(
            f"unknown harnesses or plans {unknown}; known: {sorted(CLI_MOVES)}, {sorted(CLI_PLANS)}"
        )
    for task in tasks:
        solution_command(task)  # fail early, naming the task

    async def main() -> list[CliEpisode]:
        async with CliRecorder.running(tokenizer, max_context=max_context, max_tokens=max_tokens) as recorder:
            jobs = [(t, harness, plan) for t in tasks for harness in harnesses for plan in plans]
            return await recorder.record(jobs, concurrency)

    return asyncio.run(main())


def working_demonstrations(episodes: Sequence[CliEpisode]) -> list[Demonstration]:
    """The kept demonstrations; an error when some task x harness has no working one (RL would never see it solved)."""
    demos = [e.demonstration for e in episodes if e.demonstration is not None]
    solved = {(d.task, e.harness) for e in episodes if (d := e.demonstration) is not None and d.reward == 1.0}
    missing = sorted({(e.task, e.harness) for e in episodes} - solved)
    if missing:
        raise DemonstrationError(f"no demonstration of {missing} scored 1; see the warnings above")
    return demos
