"""What one proxied model call produced, as the dialects turn it into their wire answers."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_server.proxy.conversation import AssistantOutput


@dataclass(frozen=True)
class TurnResult:
    output: AssistantOutput
    finish_reason: str  # "stop" | "length" (tool calls are read off `output`)
    prompt_tokens: int
    completion_tokens: int
    call_index: int
