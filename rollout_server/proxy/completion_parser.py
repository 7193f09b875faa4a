"""Completion text -> reasoning, content and tool calls, in the model's own format.

Formats: `hermes` (Qwen3, Hermes: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`)
and `qwen3_coder` (`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`).
A malformed tool call is the policy's mistake, not the environment's: the
whole text goes back as plain content and `parse_error` says what was wrong,
so the trajectory still trains on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from rollout_server.proxy.conversation import AssistantOutput, ToolCall, ToolSpec

ToolCallFormat = Literal["hermes", "qwen3_coder"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class ToolCallParseError(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise ToolCallParseError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Standard JSON only: Python's NaN / Infinity would not survive the trip
    back to the harness. Nesting too deep to parse is no JSON here either: a
    policy that emits it gets a parse error, and its turn is still captured."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _tool_json(text: str, what: str) -> Any:
    """`_loads`, with any failure a `ToolCallParseError` that names `what` was being read."""
    try:
        return _loads(text)
    except ToolCallParseError:
        raise
    except ValueError as exc:
        raise ToolCallParseError(f"{what} is not JSON: {exc}") from exc


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest). Handles templates that put `<think>` in the prompt
    (only `</think>` is sampled) and completions cut off inside the thought."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        body = stripped[len(THINK_OPEN):]
        if THINK_CLOSE not in body:
            return body.strip(), ""
        reasoning, _, rest = body.partition(THINK_CLOSE)
        return reasoning.strip(), rest.lstrip()
    if THINK_CLOSE in text and THINK_OPEN not in text:
        reasoning, _, rest = text.partition(THINK_CLOSE)
        return reasoning.strip(), rest.lstrip()
    return None, text


def _hermes_call(block: str) -> tuple[str, dict[str, Any]]:
    obj = _tool_json(block, "tool call")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallParseError("tool call JSON lacks a string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        args = _tool_json(args, "tool call arguments")
    if not isinstance(args, dict):
        raise ToolCallParseError("tool call arguments are not a JSON object")
    return obj["name"], args


def _coerce(value: str, schema: dict[str, Any]) -> Any:
    """XML parameters arrive as text; the tool's schema says what they were meant to be."""
    kind = schema.get("type")
    if kind == "string" or (kind is None and not value.strip()):
        return value
    try:
        return _loads(value)
    except ValueError:
        return value


def _xml_call(block: str, tools: dict[str, ToolSpec]) -> tuple[str, dict[str, Any]]:
    match = _FUNCTION.match(block)
    if match is None:
        raise ToolCallParseError("tool call lacks <function=NAME>...</function>")
    name = match.group(1).strip()
    spec = tools.get(name)
    props = (spec.parameters.get("properties") or {}) if spec else {}
    args: dict[str, Any] = {}
    for pname, raw in _PARAMETER.findall(match.group(2)):
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        args[pname.strip()] = _coerce(value, props.get(pname.strip(), {}) if isinstance(props, dict) else {})
    return name, args


def parse_completion(
    text: str,
    fmt: ToolCallFormat,
    tools: list[ToolSpec],
    new_call_id: Callable[[], str],
) -> AssistantOutput:
    reasoning, rest = split_reasoning(text)
    if CALL_OPEN not in rest:
        return AssistantOutput(rest.strip(), reasoning, ())
    by_name = {t.name: t for t in tools}
    calls: list[ToolCall] = []
    try:
        if rest.count(CALL_OPEN) != len(_CALL_BLOCK.findall(rest)):
            raise ToolCallParseError("unterminated <tool_call>")
        for block in _CALL_BLOCK.findall(rest):
            name, args = _hermes_call(block) if fmt == "hermes" else _xml_call(block, by_name)
            calls.append(ToolCall(new_call_id(), name, args))
    except ToolCallParseError as exc:
        return AssistantOutput(rest.strip(), reasoning, (), parse_error=str(exc))
    content = _CALL_BLOCK.sub("", rest).strip()
    return AssistantOutput(content, reasoning, tuple(calls))
