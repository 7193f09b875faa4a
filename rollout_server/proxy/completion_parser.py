"""Completion text -> reasoning, content and tool calls, in the model's own format.

Each format is named after the vLLM tool parser that reads the same output:
`hermes` (Qwen3, Hermes: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`),
`qwen3_coder` (`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`)
and `llama3_json` (Llama 3.x: `{"name": .., "parameters": {..}}` objects, several
separated by `;`, optionally after `<|python_tag|>`).
The harness must see what vLLM's parser would show it, since that is where the
policy is deployed: a last `<tool_call>` the model never closed is still read,
the content is the text before the first call, and a `llama3_json` call is any
JSON call object in the text. `tests/proxy/test_parsers_match_vllm.py` holds each
format to vLLM's own parser and lists where this one differs on purpose.
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

ToolCallFormat = Literal["hermes", "qwen3_coder", "llama3_json"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# A closed block, or an unclosed one running to the end of the text.
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class ToolCallParseError(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise ToolCallParseError(f"{name} is not JSON")


# Standard JSON only: Python's NaN / Infinity would not survive the trip back to the harness.
_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def _loads(text: str) -> Any:
    """Standard JSON only. Nesting too deep to parse is no JSON here either: a
    policy that emits it gets a parse error, and its turn is still captured."""
    try:
        return _DECODER.decode(text)
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
        body = stripped[len(THINK_OPEN) :]
        if THINK_CLOSE not in body:
            return body.strip(), ""
        reasoning, _, rest = body.partition(THINK_CLOSE)
        return reasoning.strip(), rest.lstrip()
    if THINK_CLOSE in text and THINK_OPEN not in text:
        reasoning, _, rest = text.partition(THINK_CLOSE)
        return reasoning.strip(), rest.lstrip()
    return None, text


Call = tuple[str, dict[str, Any]]


def _json_call(obj: Any, args_keys: tuple[str, ...]) -> Call:
    """A call from its JSON object: a string `name` and the arguments under
    the first of `args_keys` it has (it must have one, as vLLM requires)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallParseError("tool call JSON lacks a string 'name'")
    key = next((key for key in args_keys if key in obj), None)
    if key is None:
        raise ToolCallParseError(f"tool call JSON lacks {' or '.join(repr(k) for k in args_keys)}")
    args: Any = obj[key]
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


def _xml_call(block: str, tools: dict[str, ToolSpec]) -> Call:
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


def _tagged_calls(rest: str, read: Callable[[str], Call]) -> tuple[str, list[Call]] | None:
    """`hermes` and `qwen3_coder`: every `<tool_call>` block read by `read` (the last
    may be unclosed), the text before the first the content."""
    if CALL_OPEN not in rest:
        return None
    content = rest[: rest.index(CALL_OPEN)].strip()
    return content, [read(block) for block in _CALL_BLOCK.findall(rest)]


def _llama3_json_calls(rest: str, offered: bool) -> tuple[str, list[Call]] | None:
    """`llama3_json`: every top-level JSON object in the text is a call (the text
    around them is dropped, as vLLM drops it), whether after `<|python_tag|>` or
    not. Only where tools were offered or the tag was sampled: a JSON answer to a
    request without tools is an answer. Each object is read as JSON, not split at
    `;` first: a shell command in the arguments holds semicolons. Text that does
    not open as a call (`{` in prose) is content, no parse error."""
    tagged = PYTHON_TAG in rest
    if not (tagged or (offered and "{" in rest)):
        return None
    looks_like_call = tagged or rest.lstrip().startswith("{")
    calls: list[Call] = []
    at = rest.find("{")
    while at != -1:
        try:
            obj, end = _DECODER.raw_decode(rest, at)
            calls.append(_json_call(obj, ("arguments", "parameters")))  # as vLLM reads them
        except RecursionError:
            raise ToolCallParseError("tool call is not JSON: JSON nested too deeply") from None
        except ToolCallParseError:
            if not looks_like_call:
                return None
            raise
        except ValueError as exc:
            if not looks_like_call:
                return None
            raise ToolCallParseError(f"tool call is not JSON: {exc}") from exc
        at = rest.find("{", end)
    if not calls:
        raise ToolCallParseError(f"no tool call after {PYTHON_TAG}")
    return "", calls


def parse_completion(
    text: str,
    fmt: ToolCallFormat,
    tools: list[ToolSpec],
    new_call_id: Callable[[], str],
) -> AssistantOutput:
    reasoning, rest = split_reasoning(text)
    try:
        if fmt == "llama3_json":
            parsed = _llama3_json_calls(rest, bool(tools))
        elif fmt == "hermes":
            parsed = _tagged_calls(rest, lambda block: _json_call(_tool_json(block, "tool call"), ("arguments",)))
        else:
            by_name = {t.name: t for t in tools}
            parsed = _tagged_calls(rest, lambda block: _xml_call(block, by_name))
    except ToolCallParseError as exc:
        return AssistantOutput(rest.strip(), reasoning, (), parse_error=str(exc))
    if parsed is None:
        return AssistantOutput(rest.strip(), reasoning, ())
    content, calls = parsed
    return AssistantOutput(content, reasoning, tuple(ToolCall(new_call_id(), name, args) for name, args in calls))
