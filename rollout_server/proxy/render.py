"""Prompt token ids from a conversation, reusing the ids the engine sampled.

The model's own chat template renders the conversation, except that every
assistant turn matched to a stored sampled turn is rendered as a sentinel.
The text is then cut at those turns: the text between them is tokenized, and
each matched turn's region (after the assistant header, up to and including
the turn-end token) is replaced by the stored ids. Re-rendering earlier turns
never reproduces them (Qwen3 drops earlier `<think>` blocks, harnesses
re-serialise arguments), and re-tokenized text is never trained on (PITFALLS
1, 3); this way an append-only conversation yields a prompt that extends the
previous prompt + completion token for token.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from rollout_server.proxy.conversation import AssistantOutput, ChatRequest, Message
from rollout_server.proxy.errors import ProxyError, invalid

_SENTINEL = "\u2063legorl-sampled-turn-{}\u2063"
_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class SampledTurn:
    """One assistant turn as the engine produced it. `ids` start right after
    the assistant header: generation-prompt tail (mask 0), the sampled ids
    (mask 1), and the turn-end token when the engine stopped without it (mask 0)."""

    index: int
    ids: tuple[int, ...]
    mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    output: AssistantOutput


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    gen_tail: list[int]  # the prompt's last ids, after the assistant header
    reused_turns: int  # assistant turns whose sampled ids were reused
    unmatched_turns: int  # assistant turns re-rendered from text (history rewritten)


class ChatTemplate:
    """A tokenizer with its chat template, and what the cut-and-splice needs
    to know about the template (assistant header, turn-end token)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        base = [{"role": "user", "content": "x"}]
        with_prompt = self._apply(base, None, True, True)
        without = self._apply(base, None, False, True)
        if not with_prompt.startswith(without) or with_prompt == without:
            raise ValueError("chat template: the generation prompt does not extend the rendered conversation")
        self.header = with_prompt[len(without):]
        sentinel = _SENTINEL.format(0)
        turn = self._apply([*base, {"role": "assistant", "content": sentinel}], None, False, True)
        if self.header not in turn[: turn.find(sentinel)]:
            raise ValueError(f"chat template: assistant turns do not start with the header {self.header!r}")
        after = turn[turn.find(sentinel) + len(sentinel):]
        self.turn_end_id = self.tokenizer.encode(after, add_special_tokens=False)[0]
        self.turn_end_text = self.tokenizer.decode([self.turn_end_id])
        if not after.startswith(self.turn_end_text) or self.turn_end_id not in self.tokenizer.all_special_ids:
            raise ValueError(f"chat template: assistant turns do not end with a special token (got {after!r})")

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, enable_thinking: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking, tokenize=False,
        )

    def encode(self, text: str) -> tuple[int, ...]:
        """Tokenizes a text piece; the pieces recur on every call of a session
        (system prompt, tool results), so they are cached."""
        ids = self._cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            self._cache[text] = ids
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def render(self, request: ChatRequest, matched: dict[int, SampledTurn], enable_thinking: bool) -> Prompt:
        """Prompt ids for `request`; `matched` maps message positions to the
        stored turns they were matched to."""
        hf_messages = [
            {"role": "assistant", "content": _SENTINEL.format(i)} if i in matched else _hf_message(m)
            for i, m in enumerate(request.messages)
        ]
        tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in request.tools
        ] or None
        if not any(m.role != "system" for m in request.messages):
            raise invalid("the conversation has no user, assistant or tool message")
        try:
            text = self._apply(hf_messages, tools, True, enable_thinking)
        except (TemplateError, ValueError, TypeError) as exc:
            raise invalid(f"the conversation cannot be rendered with the model's chat template: {exc}") from exc
        ids: list[int] = []
        cursor = 0
        for i in sorted(matched):
            sentinel = _SENTINEL.format(i)
            at = text.find(sentinel, cursor)
            start = text.rfind(self.header, cursor, at) if at >= 0 else -1
            end = text.find(self.turn_end_text, at + len(sentinel)) if at >= 0 else -1
            if start < 0 or end < 0:
                raise ProxyError("invalid_request", f"message {i}: the chat template dropped an assistant turn")
            ids += self.encode(text[cursor:start + len(self.header)])
            ids += matched[i].ids
            cursor = end + len(self.turn_end_text)
        last = text.rfind(self.header, cursor)
        if last < 0:
            raise invalid("the chat template did not end the prompt with an assistant header")
        ids += self.encode(text[cursor:last + len(self.header)])
        gen_tail = list(self.encode(text[last + len(self.header):]))
        ids += gen_tail
        assistants = sum(m.role == "assistant" for m in request.messages)
        return Prompt(ids, gen_tail, len(matched), assistants - len(matched))


def _hf_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant":
        if message.reasoning:
            out["reasoning_content"] = message.reasoning
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in message.tool_calls
            ]
    elif message.role == "tool":
        out["tool_call_id"] = message.tool_call_id or ""
        if message.name:
            out["name"] = message.name
    return out
