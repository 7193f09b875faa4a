"""Parsing a resent conversation once: each session remembers its last
request's conversation items and what they parsed into."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_server.proxy import jsonio
from rollout_server.proxy.conversation import Message


@dataclass
class ItemMemo:
    """A session's last conversation items as they came, each with the
    messages it parsed into. Harnesses resend the whole conversation on
    every call; parsing only what changed takes most of the growth out of a
    call's cost (what is left is each item's JSON text for the comparison),
    and the messages of the
    part that did not change are the same objects as last call's, which the
    render memo then compares by identity."""

    items: list[Any] = field(default_factory=list)
    encoded: list[bytes] = field(default_factory=list)
    parsed: list[list[Message]] = field(default_factory=list)


def parse_items(
    items: list[Any], where: str, parse_one: Callable[[Any, str], list[Message]], memo: ItemMemo | None
) -> list[Message]:
    """The messages of a conversation's items, each item parsed by
    `parse_one(item, "<where>[i]")` (a function of the item alone) unless it
    is the same as the memo's item at its place. "Same" is `==` and the same
    JSON text: `==` alone takes 1, 1.0 and true for one another, the text
    alone takes NaN for null."""
    if memo is None:
        return [m for i, item in enumerate(items) for m in parse_one(item, f"{where}[{i}]")]
    encoded = [jsonio.dumps(item) for item in items]
    parsed: list[list[Message]] = []
    for i, item in enumerate(items):
        same = i < len(memo.items) and memo.encoded[i] == encoded[i] and memo.items[i] == item
        parsed.append(memo.parsed[i] if same else parse_one(item, f"{where}[{i}]"))
    memo.items, memo.encoded, memo.parsed = items, encoded, parsed
    return [m for messages in parsed for m in messages]
