"""How a tool's result is shown to the model (the `observation` axis)."""

from __future__ import annotations

from rollout_server.sandbox.base import ExecResult


def head_tail(text: str, limit: int) -> str:
    """Keep the start and the end, where commands put headers and errors."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters omitted ...]\n{text[-tail:]}"


def _status_note(result: ExecResult) -> str:
    return "[timed out]" if result.timed_out else ""


def format_observation(style: str, result: ExecResult, *, truncate_chars: int, max_chars: int) -> str:
    if style == "structured":
        return "\n".join(
            [
                f"exit_code: {'timeout' if result.timed_out else result.exit_code}",
                "<stdout>",
                head_tail(result.stdout, truncate_chars),
                "</stdout>",
                "<stderr>",
                head_tail(result.stderr, truncate_chars),
                "</stderr>",
            ]
        )
    text = "\n".join(part for part in (result.stdout, result.stderr, _status_note(result)) if part)
    if style == "truncated":
        return head_tail(text, truncate_chars) or "(no output)"
    if style == "raw":
        if len(text) > max_chars:
            return f"{text[:max_chars]}\n[output cut at {max_chars} characters]"
        return text or "(no output)"
    raise ValueError(f"unknown observation style {style!r}")
