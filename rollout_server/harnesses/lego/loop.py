"""The lego agent loop: model call, tool calls in the sandbox, repeat until done or out of budget."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

from rollout_server.sandbox.base import Sandbox

from ..base import HarnessContext, HarnessStatus
from .context import Message, head_length, history_chars, restart_from_summary, window
from .model_client import ChatModel, ModelCallError, ModelReply, ModelToolCall
from .observation import format_observation
from .options import LegoOptions, config_id
from .prompts import PLAN_GO, PLAN_REQUEST, SUMMARY_REQUEST, system_prompt
from .tools import SUBMIT, TOOL_SETS, SubmitArgs, ToolError, ToolRunner, parse_arguments, tool_schemas

StopReason = Literal[
    "submitted",  # called the submit tool
    "answered",  # replied without a tool call
    "turn_budget",  # used every turn of its budget
    "context_exhausted",  # the proxy said the prompt no longer fits
    "cap_exceeded",
    "proxy_error",
    "timeout",
]


@dataclass(frozen=True)
class LegoResult:
    status: HarnessStatus
    stop_reason: StopReason
    config_id: str
    turns: int  # agent model calls, the ones that may call tools (what turn_budget limits)
    model_calls: int  # every call to the proxy: turns plus plan and summary calls
    tool_calls: int  # including malformed ones and submit
    tool_errors: int  # calls the loop could not carry out: unknown tool, bad arguments, failed file op
    compactions: int
    wall_s: float
    final_message: str = ""
    reason: str = ""

    def metrics(self) -> dict[str, float]:
        return {
            "turns": self.turns,
            "model_calls": self.model_calls,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "compactions": self.compactions,
            "wall_s": self.wall_s,
        }


class _Episode:
    def __init__(self, sandbox: Sandbox, ctx: HarnessContext, options: LegoOptions) -> None:
        self.options = options
        self.model = ChatModel(
            base_url=ctx.openai_base_url,
            api_key=ctx.api_key,
            model=ctx.model,
            stream=options.stream,
            timeout_s=options.request_timeout_s,
            max_retries=options.max_retries,
        )
        self.runner = ToolRunner(sandbox, ctx.workdir, options.tool_timeout_s)
        self.schemas = tool_schemas(options.tools)
        has_submit = SUBMIT in TOOL_SETS[options.tools]
        self.messages: list[Message] = [
            {"role": "system", "content": system_prompt(options.prompt, ctx.workdir, has_submit)},
            {"role": "user", "content": ctx.instruction},
        ]
        self.turns = self.tool_calls = self.tool_errors = self.compactions = 0
        self.last_content = ""

    async def run(self) -> tuple[StopReason, str]:
        if self.options.prompt == "plan_first":
            self.messages.append({"role": "user", "content": PLAN_REQUEST})
            plan = await self.model.complete(self.messages, None)
            self.messages += [{"role": "assistant", "content": plan.content}, {"role": "user", "content": PLAN_GO}]
        for _ in range(self.options.max_turns):
            completion = await self._next()
            self.turns += 1
            self.last_content = completion.content
            self.messages.append(completion.as_message())
            if not completion.tool_calls:
                return "answered", completion.content
            for call in completion.tool_calls:
                summary = await self._handle(call)
                if summary is not None:
                    return "submitted", summary or completion.content
        return "turn_budget", self.last_content

    async def _next(self) -> ModelReply:
        if self._over_budget():
            await self._compact()
        try:
            return await self.model.complete(self._view(), self.schemas)
        except ModelCallError as exc:
            if exc.kind != "prompt_too_long" or self.options.context != "summarize":
                raise
        # The proxy counts tokens exactly; its verdict overrides our character estimate.
        await self._compact()
        return await self.model.complete(self._view(), self.schemas)

    def _view(self) -> list[Message]:
        if self.options.context == "window":
            return window(self.messages, self.options.window_turns)
        return self.messages

    def _over_budget(self) -> bool:
        # Only after at least one turn since the last restart, so a huge task cannot loop on compaction.
        return (
            self.options.context == "summarize"
            and len(self.messages) > head_length(self.messages) + 1
            and history_chars(self.messages) > self.options.context_budget_chars
        )

    async def _compact(self) -> None:
        summary = await self.model.complete([*self.messages, {"role": "user", "content": SUMMARY_REQUEST}], None)
        self.messages = restart_from_summary(self.messages, summary.content)
        self.compactions += 1

    async def _handle(self, call: ModelToolCall) -> str | None:
        """Run one tool call and append its result; the submit summary when the call ends the episode."""
        self.tool_calls += 1
        try:
            args = parse_arguments(self.options.tools, call.name, call.arguments)
            if isinstance(args, SubmitArgs):
                self._tool_result(call, "submitted")
                return args.summary
            result = await self.runner.run(call.name, args)
            text = format_observation(
                self.options.observation,
                result,
                truncate_chars=self.options.truncate_chars,
                max_chars=self.options.max_observation_chars,
            )
        except ToolError as exc:
            self.tool_errors += 1
            text = f"error: {exc}"
        self._tool_result(call, text)
        return None

    def _tool_result(self, call: ModelToolCall, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call.id, "content": text})


async def run_lego(
    sandbox: Sandbox, ctx: HarnessContext, options: LegoOptions, *, deadline_s: float | None = None
) -> LegoResult:
    """Run one lego episode. Sandbox failures (`SandboxError`) propagate: the environment broke, not the agent."""
    started = time.monotonic()
    episode = _Episode(sandbox, ctx, options)
    status: HarnessStatus = "ok"
    reason = ""
    final = ""
    try:
        async with asyncio.timeout(deadline_s):
            stop, final = await episode.run()
    except TimeoutError:
        status, stop, reason = "timeout", "timeout", f"no finish within {deadline_s} s"
    except ModelCallError as exc:
        reason = exc.message
        if exc.kind == "cap_exceeded":
            status, stop = "cap_exceeded", "cap_exceeded"
        elif exc.kind == "prompt_too_long":
            # The policy filled its context: its own outcome, graded as the sandbox stands.
            stop = "context_exhausted"
        else:
            status, stop = "harness_error", "proxy_error"
    finally:
        episode.runner.close()
        await episode.model.aclose()
    return LegoResult(
        status=status,
        stop_reason=stop,
        config_id=config_id(options),
        turns=episode.turns,
        model_calls=episode.model.calls,
        tool_calls=episode.tool_calls,
        tool_errors=episode.tool_errors,
        compactions=episode.compactions,
        wall_s=time.monotonic() - started,
        final_message=final or episode.last_content,
        reason=reason,
    )
