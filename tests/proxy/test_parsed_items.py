"""A session parses only the conversation items that changed since its last
call: the same item at the same place gives the same message objects, and
"the same" is exact (1, 1.0, true and NaN, null are told apart)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rollout_server.proxy import jsonio
from rollout_server.proxy.conversation import Message
from rollout_server.proxy.dialects.anthropic import Anthropic
from rollout_server.proxy.dialects.gemini import Gemini
from rollout_server.proxy.dialects.openai_chat import OpenAIChat
from rollout_server.proxy.errors import ProxyError
from rollout_server.proxy.parsed_items import ItemMemo, parse_items


class CountingParser:
    """TEST INSTRUMENT: parses an item into one user message holding its JSON text, counting calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, item: Any, where: str) -> list[Message]:
        self.calls.append(where)
        if item == "bad":
            raise ProxyError("invalid_request", f"{where}: bad item")
        return [Message("user", json.dumps(item))]


def test_unchanged_items_are_not_parsed_again_and_keep_their_messages() -> None:
    memo, parse = ItemMemo(), CountingParser()
    first = parse_items([{"a": 1}, {"b": [2]}], "messages", parse, memo)
    second = parse_items([{"a": 1}, {"b": [2]}, {"c": 3}], "messages", parse, memo)
    assert parse.calls == ["messages[0]", "messages[1]", "messages[2]"]
    assert second[0] is first[0] and second[1] is first[1]
    # An item changed in the middle: it alone is parsed again.
    third = parse_items([{"a": 1}, {"b": [2, 4]}, {"c": 3}], "messages", parse, memo)
    assert parse.calls[3:] == ["messages[1]"] and third[0] is first[0] and third[2] is second[2]
    assert third[1].content == '{"b": [2, 4]}'


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (1, 1.0),
        (1, True),
        (0, False),
        (0.0, -0.0),
        (None, float("nan")),
        (float("nan"), float("nan")),
    ],
)
def test_values_equal_in_python_but_not_in_json_are_parsed_again(before: Any, after: Any) -> None:
    memo, parse = ItemMemo(), CountingParser()
    parse_items([{"x": before}], "messages", parse, memo)
    again = parse_items([{"x": after}], "messages", parse, memo)
    assert parse.calls == ["messages[0]", "messages[0]"]
    assert again[0].content == json.dumps({"x": after})


def test_a_bad_item_is_reported_and_leaves_the_memo_as_it_was() -> None:
    memo, parse = ItemMemo(), CountingParser()
    first = parse_items([{"a": 1}], "contents", parse, memo)
    with pytest.raises(ProxyError, match=r"contents\[1\]: bad item"):
        parse_items([{"a": 1}, "bad"], "contents", parse, memo)
    assert parse_items([{"a": 1}], "contents", parse, memo)[0] is first[0]


_TOOL_LOOPS: dict[str, tuple[Any, str, list[Any]]] = {
    "openai_chat": (
        OpenAIChat(),
        "messages",
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"n": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "out"},
        ],
    ),
    "anthropic": (
        Anthropic(),
        "messages",
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"n": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out"}]},
        ],
    ),
    "gemini": (
        Gemini(),
        "contents",
        [
            {"role": "user", "parts": [{"text": "q"}]},
            {"role": "model", "parts": [{"functionCall": {"name": "bash", "args": {"n": 1}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": "out"}}}]},
        ],
    ),
}


@pytest.mark.parametrize("dialect", sorted(_TOOL_LOOPS))
def test_dialects_parse_with_the_memo_as_without(dialect: str) -> None:
    """A growing tool loop parsed call by call with a memo gives the messages
    a fresh parse gives, sharing the earlier calls' objects."""
    wire, field, items = _TOOL_LOOPS[dialect]
    memo = ItemMemo()
    previous: list[Message] = []
    for n in range(1, len(items) + 1):
        body = {"model": "m", field: items[:n]}
        # The harness's body arrives as JSON each time: fresh objects, equal values.
        with_memo = wire.parse(jsonio.loads(json.dumps(body).encode()), {}, memo).messages
        assert with_memo == wire.parse(body, {}).messages
        shared = [m for m in with_memo if m.role != "system"][: len([m for m in previous if m.role != "system"])]
        assert all(any(m is p for p in previous) for m in shared)
        previous = with_memo


def test_an_item_utf8_cannot_carry_is_compared_too() -> None:
    """A lone surrogate has no UTF-8 form; an item holding one (made in
    process: request bodies holding one are refused) is still remembered."""
    memo, parse = ItemMemo(), CountingParser()
    first = parse_items([{"text": "half a pair: \ud800"}], "messages", parse, memo)
    assert parse_items([{"text": "half a pair: \ud800"}], "messages", parse, memo)[0] is first[0]
    assert parse.calls == ["messages[0]"]


def test_each_dialect_keeps_its_own_parse(proxy: Any, engine: Any) -> None:
    """A session answers on every dialect's routes, and an item parses
    differently in each: Anthropic's tool blocks are no chat content."""
    key = proxy.new_session()["key"]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out"}]},
    ]
    engine.push("done")
    anthropic = httpx.post(
        f"{proxy.url}/v1/messages",
        headers={"x-api-key": key},
        timeout=30,
        json={"model": "m", "max_tokens": 64, "messages": messages},
    )
    assert anthropic.status_code == 200, anthropic.text
    chat = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"x-api-key": key},
        timeout=30,
        json={"model": "m", "messages": messages},
    )
    assert chat.status_code == 400 and "tool_use" in chat.json()["error"]["message"]
