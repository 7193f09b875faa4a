"""The dialect-neutral conversation every wire API is parsed into.

Each dialect module turns its request body into a `ChatRequest` and a
`TurnResult` back into its response shape; everything between (rendering,
token reuse, the engine call, trajectory assembly) sees only these types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    # A dict when the arguments parsed as a JSON object; the raw string when a
    # harness sent back something that does not parse (kept, not guessed at).
    arguments: dict[str, Any] | str


@dataclass
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # role == "tool": the call this answers
    name: str | None = None  # role == "tool": the tool's name, where the dialect gives it


@dataclass
class ChatRequest:
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    model: str = ""
    stream: bool = False
    max_tokens: int | None = None
    enable_thinking: bool | None = None  # None: the session's default
    # Dialect-specific switches that only change the response shape.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # System text arrives in several places (Anthropic's `system` plus system
        # messages inside `messages`, Codex's developer messages). The leading
        # ones become the one system message chat templates take first; later
        # ones become user turns in place: templates differ on mid-conversation
        # system messages, and moving them up front would rewrite the history
        # (and break token-exact merging) each time one appears.
        lead = 0
        while lead < len(self.messages) and self.messages[lead].role == "system":
            lead += 1
        system = "\n\n".join(m.content for m in self.messages[:lead] if m.content)
        rest = [Message("user", m.content) if m.role == "system" else m for m in self.messages[lead:]]
        self.messages = ([Message("system", system)] if system else []) + rest

    def root_key(self) -> str:
        """What tells a side call (title generation, a sub-agent) from the main
        conversation: its system prompt and tool set."""
        system = "\n".join(m.content for m in self.messages if m.role == "system")
        return json.dumps([system, sorted(t.name for t in self.tools)])


@dataclass(frozen=True)
class AssistantOutput:
    """A completion parsed into what the harness sees."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    parse_error: str | None = None  # the policy emitted a malformed tool call


def parse_arguments(raw: Any) -> dict[str, Any] | str:
    """Tool-call arguments as a dict when they are a JSON object, else the raw text."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, an integer past the digit limit, nesting past the stack
            return raw
        return value if isinstance(value, dict) else raw
    return json.dumps(raw)


def arguments_json(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def fingerprint(content: str, tool_calls: tuple[ToolCall, ...] | list[ToolCall]) -> str:
    """Message-level identity of an assistant turn, blind to what harnesses
    rewrite (argument whitespace and key order, surrounding whitespace, ids)."""
    calls = [
        [c.name, c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments, sort_keys=True)]
        for c in tool_calls
    ]
    return json.dumps([content.strip(), calls])
