"""The lego harness's only way to the model: the proxy's chat-completions route, via the `openai` SDK.

Proxy failures become a `ModelCallError` whose kind decides the trial status:
a cap or a rejected session key ends the episode as `cap_exceeded`; a context
overflow is the policy's own doing; anything else (5xx, connection, garbage)
is a harness-side failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import openai
from openai.types.chat import ChatCompletion

ErrorKind = Literal["cap_exceeded", "prompt_too_long", "proxy_error"]


class ModelCallError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message


@dataclass(frozen=True)
class ModelToolCall:
    id: str
    name: str
    arguments: str  # as the model wrote it: possibly not JSON, which the loop reports back


@dataclass(frozen=True)
class ModelReply:
    content: str
    tool_calls: list[ModelToolCall] = field(default_factory=list)
    finish_reason: str | None = None

    def as_message(self) -> dict[str, Any]:
        """The assistant message to append, keeping the arguments byte-exact for the proxy's prefix match."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return message


def classify_api_error(exc: openai.OpenAIError) -> ModelCallError:
    if isinstance(exc, openai.APIStatusError):
        code = f"{exc.code or ''} {exc.type or ''}"
        if exc.status_code in (401, 403, 429) or "cap_exceeded" in code:
            return ModelCallError("cap_exceeded", f"proxy refused the call ({exc.status_code}): {exc.message}")
        if "prompt_too_long" in code or "context_length_exceeded" in code:
            return ModelCallError("prompt_too_long", exc.message)
        return ModelCallError("proxy_error", f"proxy answered {exc.status_code}: {exc.message}")
    if isinstance(exc, openai.APIConnectionError):
        return ModelCallError("proxy_error", f"cannot reach the proxy: {exc}")
    return ModelCallError("proxy_error", f"unusable proxy answer: {exc}")


def _completion(raw: ChatCompletion) -> ModelReply:
    if not raw.choices:
        raise ModelCallError("proxy_error", "proxy answer has no choices")
    choice = raw.choices[0]
    calls = [
        ModelToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments or "")
        for c in choice.message.tool_calls or []
        if c.type == "function"
    ]
    return ModelReply(content=choice.message.content or "", tool_calls=calls, finish_reason=choice.finish_reason)


class ChatModel:
    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str,
        stream: bool,
        timeout_s: float,
        max_retries: int,
    ) -> None:
        self.model = model
        self.stream = stream
        self.calls = 0
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries
        )

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ModelReply:
        self.calls += 1
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            kwargs["tools"] = tools
        try:
            if self.stream:
                # The SDK's stream manager accumulates content and tool-call deltas into one completion.
                async with self._client.chat.completions.stream(**kwargs) as stream:
                    raw: ChatCompletion = await stream.get_final_completion()
            else:
                raw = await self._client.chat.completions.create(**kwargs)
        except openai.OpenAIError as exc:
            raise classify_api_error(exc) from exc
        try:
            return _completion(raw)
        except (AttributeError, TypeError, ValueError) as exc:
            # The SDK builds response objects without validating them; a malformed answer surfaces here.
            raise ModelCallError("proxy_error", f"malformed proxy answer: {exc}") from exc

    async def aclose(self) -> None:
        await self._client.close()
