"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`), as
Claude Code and OpenCode's anthropic provider speak it: `system` as a string
or blocks, a system message inside `messages`, tool results as user blocks,
thinking blocks coming back with signatures, `cache_control` anywhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from rollout_server.proxy import sse
from rollout_server.proxy.conversation import ChatRequest, Message, ToolCall, ToolSpec
from rollout_server.proxy.dialects.common import (
    each_object,
    model_name,
    new_id,
    optional_int,
    text_of,
    tool_spec,
    turns,
)
from rollout_server.proxy.errors import ProxyError, expect_type, invalid
from rollout_server.proxy.parsed_items import ItemMemo, parse_items
from rollout_server.proxy.turn import TurnResult

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "prompt_too_long": "invalid_request_error",
    "cap_exceeded": "invalid_request_error",
    "engine_unavailable": "overloaded_error",
}
# Blocks the model never sees: server-side tool traffic and redacted thoughts.
_SKIPPED_BLOCKS = ("redacted_thinking", "server_tool_use", "web_search_tool_result")


def _error(err: ProxyError) -> dict[str, Any]:
    message = err.message
    if err.kind == "prompt_too_long":  # the wording Claude Code looks for before compacting
        message = f"prompt is too long: {err.prompt_tokens} tokens > {err.max_context - 1} maximum"
    return {"type": "error", "error": {"type": _ERROR_TYPES[err.kind], "message": message}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    expect_type(content, list, where)
    for j, block in enumerate(content):
        expect_type(block, dict, f"{where}[{j}]")
    return content


# Claude Code opens `system` with this line; its hash suffixes change from request to request. It is
# client telemetry, not instructions: kept, it would change the prompt's first tokens on every call, so
# no two calls of a trial would share a prefix (no merged sequence, no prefix-cache hit, no shared
# prompt in training). Removed, as an Anthropic-compatible server removes it.
_BILLING_HEADER = "x-anthropic-billing-header:"


def _system(content: Any, where: str) -> str:
    """The system text without a leading billing-header line in any text block."""
    blocks = []
    for block in _blocks(content, where):
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and text.startswith(_BILLING_HEADER):
            rest = text.partition("\n")[2]
            if not rest:
                continue
            block = {**block, "text": rest}
        blocks.append(block)
    return text_of(blocks, where)


def _user(content: Any, where: str) -> list[Message]:
    """Tool results become tool messages (first, as the API orders them), the
    rest of the text one user message."""
    tools: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            expect_type(call_id, str, f"{where}[{j}].tool_use_id")
            tools.append(Message("tool", text_of(block.get("content"), f"{where}[{j}].content"), tool_call_id=call_id))
        elif kind not in _SKIPPED_BLOCKS:
            texts.append(text_of([block], where))
    return tools + ([Message("user", "".join(texts))] if texts or not tools else [])


def _message(m: Any, where: str) -> list[Message]:
    expect_type(m, dict, where)
    role = m.get("role")
    if role == "user":
        return _user(m.get("content"), f"{where}.content")
    if role == "assistant":
        return [_assistant(m.get("content"), f"{where}.content")]
    if role == "system":
        return [Message("system", text_of(_blocks(m.get("content"), where), f"{where}.content"))]
    raise invalid(f"{where}.role: unknown role {role!r}")


def _assistant(content: Any, where: str) -> Message:
    message = Message("assistant")
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "tool_use":
            name = expect_type(block.get("name"), str, f"{where}[{j}].name")
            call_id = expect_type(block.get("id"), str, f"{where}[{j}].id")
            args = expect_type(block.get("input", {}), dict, f"{where}[{j}].input")
            message.tool_calls.append(ToolCall(call_id, name, args))
        elif kind == "thinking":
            thought = block.get("thinking", "")
            expect_type(thought, str, f"{where}[{j}].thinking")
            message.reasoning = (message.reasoning or "") + thought
        elif kind not in _SKIPPED_BLOCKS:
            texts.append(text_of([block], where))
    message.content = "".join(texts)
    return message


def _tools(raw: Any) -> list[ToolSpec]:
    specs = []
    for at, tool in each_object(raw, "tools"):
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search, ...) runs at the provider; none here
        specs.append(tool_spec(tool.get("name"), tool.get("description"), tool.get("input_schema"), at))
    return specs


def _thinking(raw: Any) -> bool | None:
    kind = raw.get("type") if isinstance(raw, dict) else None
    return {"enabled": True, "adaptive": True, "disabled": False}.get(kind) if isinstance(kind, str) else None


def _content(result: TurnResult) -> list[dict[str, Any]]:
    out = result.output
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.tool_calls:
        blocks.append({"type": "text", "text": out.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in out.tool_calls]
    return blocks


def _stop_reason(result: TurnResult) -> str:
    if result.output.tool_calls:
        return "tool_use"
    return "max_tokens" if result.finish_reason == "length" else "end_turn"


def _block_events(index: int, block: dict[str, Any]) -> Iterator[bytes]:
    kind = block["type"]
    empty = {
        "text": {"type": "text", "text": ""},
        "thinking": {"type": "thinking", "thinking": "", "signature": ""},
        "tool_use": {**block, "input": {}},
    }[kind]
    yield sse.frame({"type": "content_block_start", "index": index, "content_block": empty}, "content_block_start")
    if kind == "text":
        delta = {"type": "text_delta", "text": block["text"]}
    elif kind == "thinking":
        delta = {"type": "thinking_delta", "thinking": block["thinking"]}
    else:
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    yield sse.frame({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
    yield sse.frame({"type": "content_block_stop", "index": index}, "content_block_stop")


class Anthropic:
    name = "anthropic"
    tool_id_prefix = "toolu_"

    def parse(self, body: Any, params: dict[str, str], memo: ItemMemo | None = None) -> ChatRequest:
        raw_messages = turns(body, "messages")
        messages: list[Message] = []
        if body.get("system") is not None:
            messages.append(Message("system", _system(body["system"], "system")))
        messages += parse_items(raw_messages, "messages", _message, memo)
        model = model_name(body)
        choice = body.get("tool_choice")
        no_tools = isinstance(choice, dict) and choice.get("type") == "none"
        return ChatRequest(
            messages=messages,
            tools=[] if no_tools else _tools(body.get("tools")),
            model=model,
            stream=bool(body.get("stream")),
            max_tokens=optional_int(body, "max_tokens"),
            enable_thinking=_thinking(body.get("thinking")),
            options={"id": new_id("msg_")},
        )

    def response(self, result: TurnResult, request: ChatRequest) -> dict[str, Any]:
        return {
            "id": request.options["id"],
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": _content(result),
            "stop_reason": _stop_reason(result),
            "stop_sequence": None,
            "usage": {
                "input_tokens": result.prompt_tokens,
                "output_tokens": result.completion_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def stream(self, result: TurnResult, request: ChatRequest) -> Iterator[bytes]:
        message = {**self.response(result, request), "content": [], "stop_reason": None}
        message["usage"] = {**message["usage"], "output_tokens": 0}
        yield sse.frame({"type": "message_start", "message": message}, "message_start")
        for index, block in enumerate(_content(result)):
            yield from _block_events(index, block)
        yield sse.frame(
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(result), "stop_sequence": None},
                "usage": {"output_tokens": result.completion_tokens},
            },
            "message_delta",
        )
        yield sse.frame({"type": "message_stop"}, "message_stop")

    def error(self, err: ProxyError) -> dict[str, Any]:
        return _error(err)

    def stream_error(self, err: ProxyError) -> bytes:
        return sse.frame(_error(err), "error")
