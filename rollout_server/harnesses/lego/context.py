"""What part of the history each model call sees (the `context` axis).

The head (system prompt and task) is always kept. A turn is an assistant
message with the tool results and notes that follow it, so cutting at turn
boundaries never separates a tool call from its result.
"""

from __future__ import annotations

import json
from typing import Any

from .prompts import SUMMARY_PREFIX

Message = dict[str, Any]


def head_length(messages: list[Message]) -> int:
    """Messages up to and including the first user message (the task)."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return i + 1
    return len(messages)


def window(messages: list[Message], keep_turns: int) -> list[Message]:
    head = head_length(messages)
    starts = [i for i in range(head, len(messages)) if messages[i]["role"] == "assistant"]
    if len(starts) <= keep_turns:
        return messages
    dropped = len(starts) - keep_turns
    note = {"role": "user", "content": f"[{dropped} earlier turns are hidden to save context]"}
    return [*messages[:head], note, *messages[starts[-keep_turns] :]]


def history_chars(messages: list[Message]) -> int:
    return len(json.dumps(messages, ensure_ascii=False))


def restart_from_summary(messages: list[Message], summary: str) -> list[Message]:
    return [*messages[: head_length(messages)], {"role": "user", "content": SUMMARY_PREFIX + summary}]
