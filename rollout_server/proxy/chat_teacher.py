"""A chat teacher: the proxy's engine when it is a server with a chat API
(OpenAI Chat Completions or Anthropic Messages) given by URL and key, called
through the providers' own SDKs.

Such a server gives messages, not the student's token ids: the proxy answers
the harness with the teacher's message as it came, and records the turn as
the student's chat template writes it (`ChatTemplate.written_turn`), marked
re-rendered. Token exactness holds only where teacher and student share a
tokenizer and template; the logprobs are not the student's, so such episodes
are for supervised fine-tuning, never RL. Every failure of the teacher (a
refused key, a connection, a malformed answer) is the proxy's
`engine_unavailable`, with the teacher's own words.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

import anthropic
import openai

from legorl_jax.core import log_redaction
from legorl_jax.core.config import ConfigError, EngineConfig
from rollout_server.backends.client import EngineError
from rollout_server.proxy.conversation import (
    AssistantOutput,
    ChatRequest,
    Message,
    ToolCall,
    arguments_json,
    parse_arguments,
)
from rollout_server.proxy.engine_client import CompletionParams
from rollout_server.proxy.errors import ProxyError, invalid

TeacherApi = Literal["openai_chat", "anthropic"]
# What a server that takes no key is sent (the SDKs insist on one): vLLM's convention.
_NO_KEY = "EMPTY"


@dataclass(frozen=True)
class TeacherAnswer:
    output: AssistantOutput
    finish_reason: str  # "stop" or "length"


class ChatTeacher:
    """The proxy's client of one chat teacher, shared by all sessions. `model`
    is the name its API is asked for (and harnesses see)."""

    def __init__(
        self,
        api: TeacherApi,
        base_url: str,
        model: str,
        api_key: str | None,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 2,
    ) -> None:
        if api not in get_args(TeacherApi):
            raise ValueError(f"chat teacher API must be one of {get_args(TeacherApi)}, got {api!r}")
        self.api, self.model = api, model
        self.base_url = base_url.rstrip("/")
        self.failure: str | None = None  # the last call's failure, None once a call succeeds
        log_redaction.add_secret(api_key)
        self._api_key = api_key
        key = api_key or _NO_KEY
        # The SDKs' own retries (429s, 5xx, dropped connections, with backoff); a refused key is not retried.
        self._openai = (
            openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=key, timeout=timeout_s, max_retries=max_retries)
            if api == "openai_chat"
            else None
        )
        self._anthropic = (
            anthropic.AsyncAnthropic(base_url=self.base_url, api_key=key, timeout=timeout_s, max_retries=max_retries)
            if api == "anthropic"
            else None
        )

    def check_recompute(self, temperature: float) -> None:
        """Refuses (400) sessions that want prompt logprobs: a chat API gives none."""
        raise invalid(f"recompute_logprobs: the engine is a chat teacher ({self.api}), which gives no logprobs")

    async def answer(self, request: ChatRequest, sampling: CompletionParams) -> TeacherAnswer:
        try:
            if self._openai is not None:
                answer = await self._openai_answer(self._openai, request, sampling)
            else:
                assert self._anthropic is not None
                answer = await self._anthropic_answer(self._anthropic, request, sampling)
        except (openai.APIError, anthropic.APIError) as exc:
            raise self._failed(f"failed: {exc}") from exc
        except (AttributeError, IndexError, TypeError, ValueError) as exc:  # an answer outside the API's shape
            raise self._failed(f"sent a malformed answer: {exc!r}") from exc
        self.failure = None
        return answer

    def _failed(self, what: str) -> ProxyError:
        # The failure reaches the harness and the trial's record: a server that echoes the key gets it cut out.
        if self._api_key:
            what = what.replace(self._api_key, "<redacted>")
        self.failure = f"chat teacher ({self.api} at {self.base_url}) {what}"
        return ProxyError("engine_unavailable", self.failure)

    async def _openai_answer(
        self, client: openai.AsyncOpenAI, request: ChatRequest, sampling: CompletionParams
    ) -> TeacherAnswer:
        tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in request.tools
        ]
        reply = await client.chat.completions.create(
            model=self.model,
            messages=[_openai_message(m) for m in request.messages],  # type: ignore[misc]
            tools=tools or openai.omit,  # type: ignore[arg-type]
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_completion_tokens=sampling.max_tokens,
            seed=sampling.seed if sampling.seed is not None else openai.omit,
            # top_k is no OpenAI parameter; servers that sample with it (vLLM, our proxy) read it from the body.
            extra_body={"top_k": sampling.top_k} if sampling.top_k > 0 else None,
        )
        choice = reply.choices[0]
        message = choice.message
        extra = message.model_extra or {}
        reasoning = extra.get("reasoning_content") or extra.get("reasoning")  # vLLM has used both names
        calls = tuple(
            ToolCall(c.id, c.function.name, parse_arguments(c.function.arguments))
            for c in message.tool_calls or ()
            if c.type == "function"
        )
        output = AssistantOutput(message.content or "", reasoning if isinstance(reasoning, str) else None, calls)
        return TeacherAnswer(output, "length" if choice.finish_reason == "length" else "stop")

    async def _anthropic_answer(
        self, client: anthropic.AsyncAnthropic, request: ChatRequest, sampling: CompletionParams
    ) -> TeacherAnswer:
        system = "\n\n".join(m.content for m in request.messages if m.role == "system")
        tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in request.tools]
        # The Messages API of the pinned SDK takes no sampling parameters: the teacher samples as it is set up to.
        reply = await client.messages.create(
            model=self.model,
            max_tokens=sampling.max_tokens,
            messages=_anthropic_messages(request.messages),  # type: ignore[arg-type]
            system=system or anthropic.omit,
            tools=tools or anthropic.omit,  # type: ignore[arg-type]
        )
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        for block in reply.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "thinking":
                thoughts.append(block.thinking)
            elif block.type == "tool_use":
                calls.append(ToolCall(block.id, block.name, parse_arguments(block.input)))
        output = AssistantOutput("".join(texts), "".join(thoughts) or None, tuple(calls))
        return TeacherAnswer(output, "length" if reply.stop_reason == "max_tokens" else "stop")

    async def aclose(self) -> None:
        if self._openai is not None:
            await self._openai.close()
        if self._anthropic is not None:
            await self._anthropic.close()


def _openai_message(m: Message) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.content}
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_json(c.arguments)}}
            for c in m.tool_calls
        ]
    return out


def _anthropic_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as Messages API turns: the system text goes apart, tool
    results are user blocks, and neighbouring blocks of one role share a turn
    (the API wants the roles to alternate)."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "system":
            continue
        role = "assistant" if m.role == "assistant" else "user"
        blocks = _anthropic_blocks(m)
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += blocks
        else:
            turns.append({"role": role, "content": blocks})
    return turns


def _anthropic_blocks(m: Message) -> list[dict[str, Any]]:
    if m.role == "tool":
        return [{"type": "tool_result", "tool_use_id": m.tool_call_id or "", "content": m.content}]
    blocks: list[dict[str, Any]] = [{"type": "text", "text": m.content}] if m.content else []
    for c in m.tool_calls:
        # `input` must be an object: arguments a harness sent back unparsed are kept whole under one key.
        args = c.arguments if isinstance(c.arguments, dict) else {"arguments": c.arguments}
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
    return blocks


def chat_teacher(engine: EngineConfig, *, timeout_s: float = 600.0) -> ChatTeacher:
    """The chat teacher `engine` (kind openai_chat or anthropic) names, its key
    read from `engine.api_key_env`: a variable named but unset fails here."""
    if engine.kind not in get_args(TeacherApi) or not engine.url or not engine.teacher_model:
        raise ConfigError(f"engine.kind {engine.kind!r}: not a chat teacher with url and teacher_model")
    key = None
    if engine.api_key_env:
        key = os.environ.get(engine.api_key_env, "").strip()
        if not key:
            raise ConfigError(f"engine.api_key_env: environment variable {engine.api_key_env} is unset or empty")
    return ChatTeacher(engine.kind, engine.url, engine.teacher_model, key, timeout_s=timeout_s)  # type: ignore[arg-type]


def teacher_context(engine: EngineConfig, model_dir: Path) -> int:
    """The proxy's bound on a prompt in the student's tokens: engine.max_context,
    else the student checkpoint's own context (config.json's max_position_embeddings)."""
    if engine.max_context is not None:
        return engine.max_context
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"engine.max_context: unset, and {model_dir}/config.json cannot be read: {exc}") from None
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"engine.max_context: unset, and {model_dir}/config.json has no max_position_embeddings")
    return value


class TeacherEngine:
    """What a rollout server's service holds as its engine when the engine is a
    chat teacher: healthy unless its last call failed (so a harness that broke
    on a refusing teacher is an engine error, as on an engine that is down), and
    with no policy weights: an UpdateWeights or StreamWeights is refused naming
    the teacher."""

    # What the proxy's build reads off an engine client; the proxy calls the teacher, never token routes.
    unit_temperature_prompt_logprobs = False
    token_route = "completions"

    def __init__(self, teacher: ChatTeacher) -> None:
        self.teacher = teacher
        self.base_url = teacher.base_url

    async def healthy(self) -> bool:
        return self.teacher.failure is None

    async def update_weights(self, weights_path: str, mode: str = "keep", version: str | None = None) -> NoReturn:
        raise EngineError(
            0,
            f"the engine is a chat teacher ({self.teacher.api} {self.teacher.model} at {self.base_url}): it serves "
            "no policy weights to update",
            "Unsupported",
        )
