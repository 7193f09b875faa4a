"""OpenAI Responses (`POST /v1/responses`), stateless as Codex uses it: no
`previous_response_id`, the system prompt as developer messages, reasoning
items whose `encrypted_content` comes back next turn, function and custom
(freeform) tools, tools grouped in namespaces (calls to them name the
namespace, as Codex requires)."""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from rollout_server.proxy import sse
from rollout_server.proxy.conversation import ChatRequest, Message, ToolCall, ToolSpec, arguments_json, parse_arguments
from rollout_server.proxy.dialects.common import each_object, model_name, new_id, now, optional_int, text_of, tool_spec
from rollout_server.proxy.dialects.openai_chat import openai_error
from rollout_server.proxy.errors import ProxyError, expect_type, invalid
from rollout_server.proxy.parsed_items import ItemMemo
from rollout_server.proxy.turn import TurnResult

# Provider-side items and tools: nothing for the model here to see or call.
_SKIPPED_ITEMS = ("web_search_call", "item_reference", "image_generation_call")
_SKIPPED_TOOLS = ("web_search", "web_search_preview", "local_shell", "image_generation", "file_search")
_FREEFORM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def _encode_reasoning(text: str) -> str:
    # Nothing is secret here; the field only has to carry the thought back.
    return base64.b64encode(text.encode()).decode()


def _decode_reasoning(item: dict[str, Any]) -> str | None:
    blob = item.get("encrypted_content")
    if isinstance(blob, str):
        try:
            return base64.b64decode(blob, validate=True).decode()
        except ValueError:  # another provider's blob (binascii.Error, non-ASCII, not UTF-8): use the summary
            pass
    summary = item.get("summary")
    parts = summary if isinstance(summary, list) else []  # anything else carries no text
    texts = [s["text"] for s in parts if isinstance(s, dict) and isinstance(s.get("text"), str)]
    return "".join(texts) or None


@dataclass
class _ToolSet:
    """The tools as the model sees them. A `namespace` tool groups functions
    that Codex dispatches only when a call names the namespace too (observed:
    a bare call is answered "unsupported call"). The model sees each inner
    tool by its own name, qualified as `namespace.name` only where two tools
    would share a name."""

    specs: list[ToolSpec] = field(default_factory=list)
    custom: set[str] = field(default_factory=set)  # freeform tools: calls carry one string `input`
    wire: dict[str, tuple[str, str]] = field(default_factory=dict)  # model's name -> (namespace, name)

    def model_name(self, name: str, namespace: str | None) -> str:
        """The model's name for a call the harness sends back."""
        if namespace is None:
            return name
        return next((shown for shown, key in self.wire.items() if key == (namespace, name)), name)


def _tool_set(raw: Any) -> _ToolSet:
    found: list[tuple[str | None, ToolSpec, bool]] = []  # (namespace, spec, freeform)

    def collect(items: Any, where: str, namespace: str | None) -> None:
        for at, tool in each_object(items, where):
            kind = tool.get("type")
            if kind == "function":
                found.append(
                    (namespace, tool_spec(tool.get("name"), tool.get("description"), tool.get("parameters"), at), False)
                )
            elif kind == "custom":
                found.append(
                    (namespace, tool_spec(tool.get("name"), tool.get("description"), _FREEFORM_INPUT, at), True)
                )
            elif kind == "namespace" and namespace is None:
                expect_type(tool.get("name"), str, f"{at}.name")
                collect(tool.get("tools"), f"{at}.tools", tool["name"])
            elif kind not in _SKIPPED_TOOLS or namespace is not None:
                raise invalid(f"{at}.type: unsupported tool type {kind!r}")

    collect(raw, "tools", None)
    names = Counter(spec.name for _, spec, _ in found)
    tools = _ToolSet()
    for namespace, spec, freeform in found:
        shown = spec.name if namespace is None or names[spec.name] == 1 else f"{namespace}.{spec.name}"
        tools.specs.append(replace(spec, name=shown))
        if freeform:
            tools.custom.add(shown)
        if namespace is not None:
            tools.wire[shown] = (namespace, spec.name)
    return tools


class _Builder:
    """Folds input items into messages; consecutive assistant-side items
    (reasoning, assistant text, calls) form one assistant turn."""

    def __init__(self, tools: _ToolSet) -> None:
        self.messages: list[Message] = []
        self.tools = tools

    def _turn(self, starts_new: Callable[[Message], bool]) -> Message:
        """The open assistant turn, or a new one when there is none or
        `starts_new` says the item belongs to the next turn."""
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant" or starts_new(last):
            last = Message("assistant")
            self.messages.append(last)
        return last

    def add(self, item: Any, where: str) -> None:
        expect_type(item, dict, where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = text_of(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                self.messages.append(Message("system", text))
            elif role == "user":
                self.messages.append(Message("user", text))
            elif role == "assistant":
                self._turn(lambda turn: bool(turn.tool_calls)).content += text
            else:
                raise invalid(f"{where}.role: unknown role {role!r}")
        elif kind == "reasoning":
            # A thought opens the next turn unless this one has nothing yet.
            thinking = self._turn(lambda turn: bool(turn.tool_calls or turn.content or turn.reasoning))
            thinking.reasoning = _decode_reasoning(item)
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name, namespace = item.get("call_id"), item.get("name"), item.get("namespace")
            expect_type(call_id, str, f"{where}.call_id")
            expect_type(name, str, f"{where}.name")
            expect_type(namespace, (str, type(None)), f"{where}.namespace")
            name = self.tools.model_name(name, namespace)
            if kind == "function_call":
                args = parse_arguments(item.get("arguments", "{}"))
            else:
                expect_type(item.get("input"), str, f"{where}.input")
                args = {"input": item["input"]}
            self._turn(lambda turn: False).tool_calls.append(ToolCall(call_id, name, args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            expect_type(call_id, str, f"{where}.call_id")
            self.messages.append(Message("tool", text_of(item.get("output"), f"{where}.output"), tool_call_id=call_id))
        elif kind not in _SKIPPED_ITEMS:
            raise invalid(f"{where}.type: unsupported input item type {kind!r}")


def _items(result: TurnResult, request: ChatRequest) -> list[dict[str, Any]]:
    out = result.output
    items: list[dict[str, Any]] = []
    if out.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": new_id("rs_"),
                "summary": [{"type": "summary_text", "text": out.reasoning}],
                "encrypted_content": _encode_reasoning(out.reasoning),
            }
        )
    if out.content or not out.tool_calls:
        items.append(
            {
                "type": "message",
                "id": new_id("msg_"),
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": out.content, "annotations": [], "logprobs": []}],
            }
        )
    tools: _ToolSet = request.options["tools"]
    for call in out.tool_calls:
        namespace, name = tools.wire.get(call.name, (None, call.name))
        where = {"name": name} if namespace is None else {"namespace": namespace, "name": name}
        if call.name in tools.custom and isinstance(call.arguments, dict):
            items.append(
                {
                    "type": "custom_tool_call",
                    "id": new_id("ctc_"),
                    "call_id": call.id,
                    **where,
                    "input": str(call.arguments.get("input", "")),
                    "status": "completed",
                }
            )
        else:
            items.append(
                {
                    "type": "function_call",
                    "id": new_id("fc_"),
                    "call_id": call.id,
                    **where,
                    "arguments": arguments_json(call.arguments),
                    "status": "completed",
                }
            )
    return items


def _item_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, payload) for one output item between added and done."""
    at = {"item_id": item["id"], "output_index": index}
    kind = item["type"]
    if kind == "message":
        part = item["content"][0]
        yield "response.content_part.added", {**at, "content_index": 0, "part": {**part, "text": ""}}
        yield "response.output_text.delta", {**at, "content_index": 0, "delta": part["text"], "logprobs": []}
        yield "response.output_text.done", {**at, "content_index": 0, "text": part["text"], "logprobs": []}
        yield "response.content_part.done", {**at, "content_index": 0, "part": part}
    elif kind == "function_call":
        yield "response.function_call_arguments.delta", {**at, "delta": item["arguments"]}
        yield "response.function_call_arguments.done", {**at, "arguments": item["arguments"]}
    elif kind == "custom_tool_call":
        yield "response.custom_tool_call_input.delta", {**at, "delta": item["input"]}
        yield "response.custom_tool_call_input.done", {**at, "input": item["input"]}
    else:
        text = item["summary"][0]["text"]
        yield "response.reasoning_summary_text.delta", {**at, "summary_index": 0, "delta": text}
        yield "response.reasoning_summary_text.done", {**at, "summary_index": 0, "text": text}


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    blanks: dict[str, dict[str, Any]] = {
        "message": {"content": []},
        "function_call": {"arguments": ""},
        "custom_tool_call": {"input": ""},
        "reasoning": {"summary": []},
    }
    return {**item, **blanks[item["type"]], **({"status": "in_progress"} if "status" in item else {})}


class Responses:
    name = "openai_responses"
    tool_id_prefix = "call_"

    def parse(self, body: Any, params: dict[str, str], memo: ItemMemo | None = None) -> ChatRequest:
        """Parsed afresh on every call, whatever `memo` holds: an assistant
        turn here is built across items (its reasoning, text and each tool
        call are items of their own), so an item alone does not parse into
        messages."""
        expect_type(body, dict, "request body")
        tools = _tool_set(body.get("tools"))
        builder = _Builder(tools)
        instructions = body.get("instructions")
        if instructions is not None:
            expect_type(instructions, str, "instructions")
            builder.messages.append(Message("system", instructions))
        raw = body.get("input")
        if isinstance(raw, str):
            builder.messages.append(Message("user", raw))
        else:
            expect_type(raw, list, "input")
            for i, item in enumerate(raw):
                builder.add(item, f"input[{i}]")
        if not any(m.role != "system" for m in builder.messages):
            raise invalid("input: must hold at least one message")
        model = model_name(body)
        reasoning = body.get("reasoning")
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        return ChatRequest(
            messages=builder.messages,
            tools=[] if body.get("tool_choice") == "none" else tools.specs,
            model=model,
            stream=bool(body.get("stream")),
            max_tokens=optional_int(body, "max_output_tokens"),
            enable_thinking=False if effort == "none" else None,
            options={"id": new_id("resp_"), "tools": tools, "created": now()},
        )

    def _response(
        self, request: ChatRequest, output: list[dict[str, Any]], result: TurnResult | None
    ) -> dict[str, Any]:
        status = "in_progress" if result is None else "incomplete" if result.finish_reason == "length" else "completed"
        usage = (
            None
            if result is None
            else {
                "input_tokens": result.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": result.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            }
        )
        return {
            "id": request.options["id"],
            "object": "response",
            "created_at": request.options["created"],
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": request.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "store": False,
            "text": {"format": {"type": "text"}},
            "usage": usage,
        }

    def response(self, result: TurnResult, request: ChatRequest) -> dict[str, Any]:
        return self._response(request, _items(result, request), result)

    def stream(self, result: TurnResult, request: ChatRequest) -> Iterator[bytes]:
        items = _items(result, request)
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": self._response(request, [], None)}),
            ("response.in_progress", {"response": self._response(request, [], None)}),
        ]
        for index, item in enumerate(items):
            events.append(("response.output_item.added", {"output_index": index, "item": _empty(item)}))
            events += _item_events(index, item)
            events.append(("response.output_item.done", {"output_index": index, "item": item}))
        events.append(("response.completed", {"response": self._response(request, items, result)}))
        for seq, (kind, payload) in enumerate(events):
            yield sse.frame({"type": kind, "sequence_number": seq, **payload}, kind)

    def error(self, err: ProxyError) -> dict[str, Any]:
        return openai_error(err)

    def stream_error(self, err: ProxyError) -> bytes:
        body = openai_error(err)["error"]
        return sse.frame(
            {"type": "error", "code": body["code"], "message": body["message"], "param": None, "sequence_number": 0},
            "error",
        )
