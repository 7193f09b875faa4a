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

Rendering the whole conversation on every call costs time linear in its
length (Jinja dominates the proxy's own time), so each session keeps a
`PrefixMemo`: ids up to the end of a reused turn. A call whose messages
extend the memo's renders only [system (where the template's text after a
turn reads it), that turn, what follows]: the text after a sentinel turn
depends only on the messages after it, for templates that pass the check
made when the template is loaded; others, and conversations with a turn
re-rendered from text (whose rendering may depend on later messages, as
Qwen3's dropped `<think>` blocks do), always render in full. Both paths cut
the same text at the same places, so they give the same ids.

Once a call's turn is sampled, the memo moves on to it (its prompt + the
sampled ids), where the template renders a conversation up to a turn's
header as it rendered the prompt that turn was sampled for (checked at
load too): the next call then renders only that turn and what the harness
added after it, the fewest messages there can be.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from rollout_server.proxy.conversation import AssistantOutput, ChatRequest, Message, ToolSpec
from rollout_server.proxy.errors import ProxyError, invalid

_SENTINEL = "\u2063legorl-sampled-turn-{}\u2063"
_CACHE_ENTRIES = 4096


def _probe_turn(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": _SENTINEL.format(i)}


# What a template is checked on when loaded: every message kind, sentinel turns numbered by position.
_PROBE: list[dict[str, Any]] = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, _probe_turn(2),
    {"role": "tool", "content": "r1", "tool_call_id": "a", "name": "f"},
    {"role": "tool", "content": "r2", "tool_call_id": "b", "name": "f"},
    _probe_turn(5), {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}, _probe_turn(7),
    {"role": "user", "content": "next"}, _probe_turn(9), {"role": "tool", "content": "r3", "tool_call_id": "c"},
]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}]


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
    # Where each reused turn's ids start in `ids`, with the turn.
    reused_spans: tuple[tuple[int, SampledTurn], ...] = ()
    incremental: bool = False  # rendered from a session's PrefixMemo


@dataclass
class PrefixMemo:
    """A session's conversation rendered up to the end of one reused turn, at
    position len(messages): its last render's last reused turn, or the turn
    its last call sampled."""

    tools: list[ToolSpec] = field(default_factory=list)
    enable_thinking: bool = True
    messages: list[Message] = field(default_factory=list)  # the messages before that turn
    turns: dict[int, int] = field(default_factory=dict)  # message position -> SampledTurn.index, that turn's too
    spans: tuple[tuple[int, SampledTurn], ...] = ()
    ids: tuple[int, ...] = ()
    valid: bool = False


@dataclass
class _Spliced:
    ids: list[int]
    gen_tail: list[int]
    spans: list[tuple[int, SampledTurn]]
    stable: int  # len(ids) at the end of the last reused turn (0: none)


class ChatTemplate:
    """A tokenizer with its chat template, and what the cut-and-splice needs
    to know about the template (assistant header, turn-end token)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._encode, self._decode = _codec(tokenizer)
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
        # Whether a memo can be extended, and whether that render needs the tools, and the system message.
        self.incremental, self._suffix_without_tools, self._suffix_without_system = self._local_suffixes()
        self._prompts_extend = self.incremental and self._holds(self._prompt_prefixes_stay)

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, enable_thinking: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking, tokenize=False,
        )

    def _turn_end(self, text: str, position: int) -> int:
        """Where the text after sentinel turn `position` starts, -1 if the turn is not there."""
        at = text.find(_SENTINEL.format(position))
        end = text.find(self.turn_end_text, at) if at >= 0 else -1
        return -1 if end < 0 else end + len(self.turn_end_text)

    def _after_turn(self, text: str, position: int) -> str | None:
        """The text after sentinel turn `position` ends, None if it is not there."""
        end = self._turn_end(text, position)
        return None if end < 0 else text[end:]

    def _local_suffixes(self) -> tuple[bool, bool, bool]:
        """Whether this template renders the text after a sentinel turn from
        the system message and the messages after that turn alone; whether it
        does so without the tools too (a long tool list is most of the
        template's work); and whether also without the system message (one
        message less to render on every call)."""
        def same(reduced_tools: list[dict[str, Any]] | None, keep_system: bool) -> Callable[..., bool]:
            def check(base: list[dict[str, Any]], offset: int, thinking: bool, full: str) -> bool:
                head = base[:1] if keep_system and base[0]["role"] == "system" else []
                for k in (i for i, m in enumerate(base) if m["role"] == "assistant"):
                    reduced = self._apply([*head, *base[k:]], reduced_tools, True, thinking)
                    after = self._after_turn(full, k + offset)  # sentinels are numbered as in the probe
                    if after is None or after != self._after_turn(reduced, k + offset):
                        return False
                return True
            return check

        local, without_tools = self._holds(same(_PROBE_TOOLS, True)), self._holds(same(None, True))
        return local, without_tools, local and self._holds(same(None if without_tools else _PROBE_TOOLS, False))

    def _prompt_prefixes_stay(self, base: list[dict[str, Any]], offset: int, thinking: bool, full: str) -> bool:
        """Whether the prompt each turn was sampled for, up to its assistant
        header, is the conversation's text up to that turn's header: with
        the tools and without (templates place them differently)."""
        for tools in (_PROBE_TOOLS, None):
            text = full if tools else self._apply(base, None, True, thinking)
            for k in (i for i, m in enumerate(base) if m["role"] == "assistant"):
                prompt = self._apply(base[:k], tools, True, thinking)
                at = text.find(_SENTINEL.format(k + offset))
                header = text.rfind(self.header, 0, at)
                if at < 0 or header < 0 or prompt[:prompt.rfind(self.header)] != text[:header]:
                    return False
        return True

    def _holds(self, check: Callable[[list[dict[str, Any]], int, bool, str], bool]) -> bool:
        """`check(base, offset, thinking, full render)` on a conversation with
        every message kind, with and without a system message, with and
        without thinking."""
        try:
            for base in (_PROBE, _PROBE[1:]):
                for thinking in (True, False):
                    full = self._apply(base, _PROBE_TOOLS, True, thinking)
                    if not check(base, len(_PROBE) - len(base), thinking, full):
                        return False
        except (TemplateError, ValueError, TypeError):  # e.g. a template that wants a user message first
            return False
        return True

    def encode(self, text: str) -> tuple[int, ...]:
        """Tokenizes a text piece; the pieces recur on every call of a session
        (system prompt, tool results), so they are cached."""
        ids = self._cache.get(text)
        if ids is None:
            ids = self._encode(text)
            self._cache[text] = ids
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self._decode(list(ids))

    def render(self, request: ChatRequest, matched: dict[int, SampledTurn], enable_thinking: bool,
               memo: PrefixMemo | None = None) -> Prompt:
        """Prompt ids for `request`; `matched` maps message positions to the
        stored turns they were matched to. With a `memo` (one per session),
        a conversation that extends the last one renders only its new part;
        the memo is brought up to date either way."""
        if not any(m.role != "system" for m in request.messages):
            raise invalid("the conversation has no user, assistant or tool message")
        assistants = sum(m.role == "assistant" for m in request.messages)
        all_reused = assistants == len(matched)
        spliced = self._incremental(request, matched, enable_thinking, memo) if all_reused and memo is not None else None
        incremental = spliced is not None
        if spliced is None:
            spliced = self._splice(self._text(request.messages, matched, request.tools, enable_thinking),
                                   sorted(matched), matched, 0, [], [])
        if memo is not None:
            _remember(memo, request, matched, enable_thinking, spliced, all_reused)
        return Prompt(spliced.ids, spliced.gen_tail, len(matched), assistants - len(matched),
                      tuple(spliced.spans), incremental)

    def remember_sampled(self, memo: PrefixMemo, request: ChatRequest, matched: dict[int, SampledTurn],
                         enable_thinking: bool, prompt: Prompt, turn: SampledTurn) -> None:
        """Moves the memo on to `turn`, sampled for `prompt` (`request`
        rendered with `matched`): the next call's messages extend this one's
        by that turn and what the harness adds after it."""
        if not (self._prompts_extend and prompt.unmatched_turns == 0):
            return  # the memo stays at the prompt's last reused turn, if any
        start = len(prompt.ids) - len(prompt.gen_tail)  # the turn's stored ids begin with the generation tail
        memo.tools, memo.enable_thinking = request.tools, enable_thinking
        memo.messages = list(request.messages)
        memo.turns = {**{i: t.index for i, t in matched.items()}, len(request.messages): turn.index}
        memo.spans = (*prompt.reused_spans, (start, turn))
        memo.ids = (*prompt.ids[:start], *turn.ids)
        memo.valid = True

    def _incremental(self, request: ChatRequest, matched: dict[int, SampledTurn], enable_thinking: bool,
                     memo: PrefixMemo) -> _Spliced | None:
        k = len(memo.messages)  # the memo's last turn; its message renders as a sentinel, whatever it says
        if not (self.incremental and memo.valid and memo.enable_thinking == enable_thinking
                and memo.tools == request.tools
                and {i: t.index for i, t in matched.items() if i <= k} == memo.turns
                and request.messages[:k] == memo.messages):
            return None
        system = request.messages[0].role == "system" and not self._suffix_without_system
        head = [request.messages[0]] if system else []
        reduced = [*head, *request.messages[k:]]
        shift = k - len(head)  # reduced position + shift = position in the request
        reduced_matched = {i - shift: t for i, t in matched.items() if i >= k}
        try:
            text = self._text(reduced, reduced_matched, [] if self._suffix_without_tools else request.tools,
                              enable_thinking)
        except ProxyError:
            return None  # e.g. a template that wants a user message first: render in full
        cursor = self._turn_end(text, k - shift)
        if cursor < 0:
            return None
        later = sorted(i for i in reduced_matched if i > k - shift)
        return self._splice(text, later, reduced_matched, cursor, list(memo.ids), list(memo.spans), shift)

    def _text(self, messages: list[Message], matched: dict[int, SampledTurn], tools: list[ToolSpec],
              enable_thinking: bool) -> str:
        hf_messages = [
            {"role": "assistant", "content": _SENTINEL.format(i)} if i in matched else _hf_message(m)
            for i, m in enumerate(messages)
        ]
        hf_tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in tools
        ] or None
        try:
            return self._apply(hf_messages, hf_tools, True, enable_thinking)
        except (TemplateError, ValueError, TypeError) as exc:
            raise invalid(f"the conversation cannot be rendered with the model's chat template: {exc}") from exc

    def _splice(self, text: str, positions: list[int], matched: dict[int, SampledTurn], cursor: int,
                ids: list[int], spans: list[tuple[int, SampledTurn]], shift: int = 0) -> _Spliced:
        """Cuts `text` from `cursor` at the sentinel turns in `positions`,
        appending to `ids` the text pieces' ids and the turns' stored ids."""
        stable = len(ids) if spans else 0
        for i in positions:
            sentinel = _SENTINEL.format(i)
            at = text.find(sentinel, cursor)
            start = text.rfind(self.header, cursor, at) if at >= 0 else -1
            end = text.find(self.turn_end_text, at + len(sentinel)) if at >= 0 else -1
            if start < 0 or end < 0:
                raise ProxyError("invalid_request", f"message {i + shift}: the chat template dropped an assistant turn")
            ids += self.encode(text[cursor:start + len(self.header)])
            spans.append((len(ids), matched[i]))
            ids += matched[i].ids
            stable = len(ids)
            cursor = end + len(self.turn_end_text)
        last = text.rfind(self.header, cursor)
        if last < 0:
            raise invalid("the chat template did not end the prompt with an assistant header")
        ids += self.encode(text[cursor:last + len(self.header)])
        gen_tail = list(self.encode(text[last + len(self.header):]))
        return _Spliced(ids + gen_tail, gen_tail, spans, stable)


def _codec(tokenizer: Any) -> tuple[Callable[[str], tuple[int, ...]], Callable[[list[int]], str]]:
    """Encode and decode as `tokenizer.encode(text, add_special_tokens=False)`
    and `tokenizer.decode(ids)` do, straight on the Rust tokenizer: the
    wrappers cost as much again on a short piece, and the fast encode skips
    the character offsets nobody reads here (0.12 → 0.08 ms for a
    300-character tool result). Decode clean-up stays transformers' work.
    (A tokenizer that splits special tokens as text never gets here: its turn
    end is no special token.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a tokenizer without a Rust one (sentencepiece, tiktoken)
        return (lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)),
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    else:
        decode = lambda ids: backend.decode(ids, skip_special_tokens=False)  # noqa: E731
    return lambda text: tuple(backend.encode_batch_fast([text], add_special_tokens=False)[0].ids), decode


def _remember(memo: PrefixMemo, request: ChatRequest, matched: dict[int, SampledTurn], enable_thinking: bool,
              spliced: _Spliced, all_reused: bool) -> None:
    """Keeps the render up to its last reused turn, when every assistant turn
    was reused (a turn re-rendered from text may render differently later)."""
    memo.valid = all_reused and bool(matched)
    if not memo.valid:
        return
    k = max(matched)
    memo.tools, memo.enable_thinking = request.tools, enable_thinking
    memo.messages = request.messages[:k]
    memo.turns = {i: t.index for i, t in matched.items()}
    memo.spans = tuple(spliced.spans)
    memo.ids = tuple(spliced.ids[:spliced.stable])


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
