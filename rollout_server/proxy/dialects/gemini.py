"""Gemini `models/<m>:generateContent` and `:streamGenerateContent?alt=sse`,
as Gemini CLI speaks it: `contents` with user/model roles, `functionCall`
and `functionResponse` parts, thought parts (dropped by the CLI on the way
back), OpenAPI-style upper-case schema types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from rollout_server.proxy import sse
from rollout_server.proxy.conversation import ChatRequest, Message, ToolCall, ToolSpec
from rollout_server.proxy.dialects.common import (
    each_object,
    new_id,
    optional_int,
    text_of,
    tool_spec,
    turns,
)
from rollout_server.proxy.errors import ProxyError, expect_type, invalid
from rollout_server.proxy.parsed_items import ItemMemo, parse_items
from rollout_server.proxy.turn import TurnResult

_STATUS = {
    "invalid_request": "INVALID_ARGUMENT",
    "authentication": "UNAUTHENTICATED",
    "not_found": "NOT_FOUND",
    "prompt_too_long": "INVALID_ARGUMENT",
    "cap_exceeded": "INVALID_ARGUMENT",
    "engine_unavailable": "UNAVAILABLE",
}


def _error(err: ProxyError) -> dict[str, Any]:
    message = err.message
    if err.kind == "prompt_too_long":
        message = (
            f"The input token count ({err.prompt_tokens}) exceeds the maximum number of tokens "
            f"allowed ({err.max_context - 1})."
        )
    return {"error": {"code": err.status, "message": message, "status": _STATUS[err.kind]}}


def _lower_types(schema: Any) -> Any:
    """Gemini's OpenAPI subset spells types `STRING`, `OBJECT`; JSON Schema (and
    the chat template's tool list) uses lower case."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def _tool_output(response: Any) -> str:
    if isinstance(response, dict) and len(response) == 1:
        (only,) = response.values()
        if isinstance(only, str):  # {"output": "..."}: the CLI's usual wrapping
            return only
    return json.dumps(response, ensure_ascii=False)


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    expect_type(content, dict, where)
    parts = content.get("parts", [])
    expect_type(parts, list, f"{where}.parts")
    for j, part in enumerate(parts):
        expect_type(part, dict, f"{where}.parts[{j}]")
    return parts


def _content(content: Any, where: str) -> list[Message]:
    role = content.get("role", "user") if isinstance(content, dict) else None
    parts = _parts(content, where)
    if role == "model":
        message = Message("assistant")
        for j, part in enumerate(parts):
            at = f"{where}.parts[{j}]"
            if "functionCall" in part:
                call = part["functionCall"]
                expect_type(call, dict, f"{at}.functionCall")
                expect_type(call.get("name"), str, f"{at}.functionCall.name")
                args = call.get("args", {})
                expect_type(args, dict, f"{at}.functionCall.args")
                message.tool_calls.append(ToolCall(str(call.get("id") or ""), call["name"], args))
            elif "text" in part:
                expect_type(part["text"], str, f"{at}.text")
                if part.get("thought"):
                    message.reasoning = (message.reasoning or "") + part["text"]
                else:
                    message.content += part["text"]
        return [message]
    if role not in ("user", "function"):
        raise invalid(f"{where}.role: unknown role {role!r}")
    tools: list[Message] = []
    texts: list[str] = []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if "functionResponse" in part:
            resp = part["functionResponse"]
            expect_type(resp, dict, f"{at}.functionResponse")
            name = resp.get("name")
            expect_type(name, str, f"{at}.functionResponse.name")
            tools.append(
                Message("tool", _tool_output(resp.get("response")), tool_call_id=str(resp.get("id") or name), name=name)
            )
        elif "text" in part:
            expect_type(part["text"], str, f"{at}.text")
            texts.append(part["text"])
        elif "inlineData" in part or "fileData" in part:
            raise invalid(f"{at}: inline and file data are not supported; this model reads text only")
    return tools + ([Message("user", "".join(texts))] if texts or not tools else [])


def _tools(raw: Any) -> list[ToolSpec]:
    specs = []
    for where, tool in each_object(raw, "tools"):
        declarations = tool.get("functionDeclarations") or []  # other entries are Google-side tools
        for at, decl in each_object(declarations, f"{where}.functionDeclarations"):
            schema = decl.get("parametersJsonSchema", _lower_types(decl.get("parameters")))
            specs.append(tool_spec(decl.get("name"), decl.get("description"), schema, at))
    return specs


def _thinking(config: dict[str, Any]) -> bool | None:
    thinking = config.get("thinkingConfig")
    if isinstance(thinking, dict) and thinking.get("thinkingBudget") == 0:
        return False
    return None


class Gemini:
    name = "gemini"
    tool_id_prefix = "fc_"

    def parse(self, body: Any, params: dict[str, str], memo: ItemMemo | None = None) -> ChatRequest:
        contents = turns(body, "contents")
        messages: list[Message] = []
        system = body.get("systemInstruction")
        if system is not None:
            parts = [{"type": "text", "text": p.get("text", "")} for p in _parts(system, "systemInstruction")]
            messages.append(Message("system", text_of(parts, "systemInstruction.parts")))
        messages += parse_items(contents, "contents", _content, memo)
        config = body.get("generationConfig") or {}
        expect_type(config, dict, "generationConfig")
        limit = optional_int(config, "maxOutputTokens", within="generationConfig.")
        return ChatRequest(
            messages=messages,
            tools=_tools(body.get("tools")),
            model=params.get("model", ""),
            stream=params.get("action") == "streamGenerateContent",
            max_tokens=limit,
            enable_thinking=_thinking(config),
            options={"id": new_id("")},
        )

    def response(self, result: TurnResult, request: ChatRequest) -> dict[str, Any]:
        out = result.output
        parts: list[dict[str, Any]] = []
        if out.reasoning:
            parts.append({"text": out.reasoning, "thought": True})
        if out.content or not out.tool_calls:
            parts.append({"text": out.content})
        parts += [{"functionCall": {"id": c.id, "name": c.name, "args": c.arguments}} for c in out.tool_calls]
        return {
            "candidates": [
                {
                    "content": {"role": "model", "parts": parts},
                    "index": 0,
                    "finishReason": "MAX_TOKENS" if result.finish_reason == "length" else "STOP",
                }
            ],
            "usageMetadata": {
                "promptTokenCount": result.prompt_tokens,
                "candidatesTokenCount": result.completion_tokens,
                "totalTokenCount": result.prompt_tokens + result.completion_tokens,
            },
            "modelVersion": request.model,
            "responseId": request.options["id"],
        }

    def stream(self, result: TurnResult, request: ChatRequest) -> Iterator[bytes]:
        # One GenerateContentResponse per event; the stream has no end marker.
        yield sse.frame(self.response(result, request))

    def error(self, err: ProxyError) -> dict[str, Any]:
        return _error(err)

    def stream_error(self, err: ProxyError) -> bytes:
        return sse.frame(_error(err))
