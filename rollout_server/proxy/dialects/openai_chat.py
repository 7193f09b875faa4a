"""OpenAI Chat Completions (`POST /v1/chat/completions`), as mini-swe-agent
(litellm), OpenCode's openai-compatible provider and Qwen Code speak it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rollout_server.proxy import sse
from rollout_server.proxy.conversation import ChatRequest, Message, ToolCall, ToolSpec, arguments_json, parse_arguments
from rollout_server.proxy.dialects.common import (
    each_object,
    model_name,
    new_id,
    now,
    optional_int,
    text_of,
    tool_spec,
    turns,
)
from rollout_server.proxy.errors import ProxyError, expect_type, invalid
from rollout_server.proxy.parsed_items import ItemMemo, parse_items
from rollout_server.proxy.turn import TurnResult

_ERROR_CODES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "prompt_too_long": ("invalid_request_error", "context_length_exceeded"),
    "cap_exceeded": ("invalid_request_error", "session_cap_exceeded"),
    "engine_unavailable": ("server_error", "engine_unavailable"),
}


def openai_error(err: ProxyError) -> dict[str, Any]:
    """The error body OpenAI's APIs (chat and responses) share."""
    kind, code = _ERROR_CODES[err.kind]
    message = err.message
    if err.kind == "prompt_too_long":
        message = (
            f"This model's maximum context length is {err.max_context} tokens. However, your messages "
            f"resulted in {err.prompt_tokens} tokens. Please reduce the length of the messages."
        )
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _tool_calls(raw: Any, where: str) -> list[ToolCall]:
    if raw is None:
        return []
    expect_type(raw, list, where)
    calls = []
    for k, call in enumerate(raw):
        expect_type(call, dict, f"{where}[{k}]")
        fn = call.get("function")
        expect_type(fn, dict, f"{where}[{k}].function")
        expect_type(fn.get("name"), str, f"{where}[{k}].function.name")
        call_id = call.get("id") or ""
        expect_type(call_id, str, f"{where}[{k}].id")
        calls.append(ToolCall(call_id, fn["name"], parse_arguments(fn.get("arguments", "{}"))))
    return calls


def _message(m: Any, where: str) -> Message:
    expect_type(m, dict, where)
    role = m.get("role")
    content = text_of(m.get("content"), f"{where}.content")
    if role in ("system", "developer"):
        return Message("system", content)
    if role == "user":
        return Message("user", content)
    if role == "assistant":
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        return Message(
            "assistant",
            content,
            reasoning if isinstance(reasoning, str) else None,
            _tool_calls(m.get("tool_calls"), f"{where}.tool_calls"),
        )
    if role == "tool":
        call_id = m.get("tool_call_id")
        expect_type(call_id, str, f"{where}.tool_call_id")
        name = m.get("name")
        return Message("tool", content, tool_call_id=call_id, name=name if isinstance(name, str) else None)
    raise invalid(f"{where}.role: unknown role {role!r}")


def _tools(raw: Any) -> list[ToolSpec]:
    specs = []
    for at, tool in each_object(raw, "tools"):
        if tool.get("type", "function") != "function":
            raise invalid(f"{at}.type: only function tools are supported, got {tool.get('type')!r}")
        fn = expect_type(tool.get("function"), dict, f"{at}.function")
        specs.append(tool_spec(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{at}.function"))
    return specs


def _finish(result: TurnResult) -> str:
    if result.output.tool_calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def _usage(result: TurnResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _wire_calls(result: TurnResult) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_json(c.arguments)}}
        for c in result.output.tool_calls
    ]


class OpenAIChat:
    name = "openai_chat"
    tool_id_prefix = "call_"

    def parse(self, body: Any, params: dict[str, str], memo: ItemMemo | None = None) -> ChatRequest:
        messages = turns(body, "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        expect_type(kwargs, dict, "chat_template_kwargs")
        thinking = kwargs.get("enable_thinking")
        stream_options = body.get("stream_options") or {}
        expect_type(stream_options, dict, "stream_options")
        model = model_name(body)
        return ChatRequest(
            messages=parse_items(messages, "messages", lambda m, where: [_message(m, where)], memo),
            tools=[] if body.get("tool_choice") == "none" else _tools(body.get("tools")),
            model=model,
            stream=bool(body.get("stream")),
            max_tokens=optional_int(body, "max_completion_tokens", "max_tokens"),
            enable_thinking=thinking if isinstance(thinking, bool) else None,
            options={"include_usage": bool(stream_options.get("include_usage")), "id": new_id("chatcmpl-")},
        )

    def response(self, result: TurnResult, request: ChatRequest) -> dict[str, Any]:
        out = result.output
        message: dict[str, Any] = {"role": "assistant", "content": out.content or (None if out.tool_calls else "")}
        if out.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.tool_calls:
            message["tool_calls"] = _wire_calls(result)
        return {
            "id": request.options["id"],
            "object": "chat.completion",
            "created": now(),
            "model": request.model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(result), "logprobs": None}],
            "usage": _usage(result),
        }

    def stream(self, result: TurnResult, request: ChatRequest) -> Iterator[bytes]:
        created = now()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse.frame(
                {
                    "id": request.options["id"],
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": request.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                }
            )

        out = result.output
        yield chunk({"role": "assistant", "content": ""})
        if out.reasoning:
            yield chunk({"reasoning_content": out.reasoning})
        if out.content:
            yield chunk({"content": out.content})
        for k, call in enumerate(_wire_calls(result)):
            yield chunk({"tool_calls": [{"index": k, **call}]})
        yield chunk({}, _finish(result))
        if request.options.get("include_usage"):
            yield sse.frame(
                {
                    "id": request.options["id"],
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": request.model,
                    "choices": [],
                    "usage": _usage(result),
                }
            )
        yield sse.DONE

    def error(self, err: ProxyError) -> dict[str, Any]:
        return openai_error(err)

    def stream_error(self, err: ProxyError) -> bytes:
        return sse.frame(openai_error(err))
