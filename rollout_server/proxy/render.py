"""Prompt token ids from a conversation, reusing the ids the engine sampled.

The model's own chat template renders the conversation, except that every
assistant turn matched to a stored sampled turn is rendered as a sentinel.
The text is then cut at those turns: the text between them is tokenized, and
each matched turn's region (after the assistant header, up to and including
the turn-end token) is replaced by the stored ids. Re-rendering earlier turns
never reproduces them (Qwen3 drops earlier `<think>` blocks, harnesses
re-serialise arguments), and re-tokenized text is not what was sampled, so it
is never trained on; this way an append-only conversation yields a prompt that extends the
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

Content is never markup: the template gets every string of the request
with the model's added tokens it spells (`<|im_end|>`, `<tool_call>`,
`<think>`) replaced by placeholders, and the rendered text is encoded with
only the template's own added tokens as tokens, the spelled ones as the
text they are, so no file an agent prints can forge a turn boundary. The
placeholders and the turn sentinels are built from surrogate code points,
which no request carries (a body's lone surrogates are read as U+FFFD, and
such a string here is refused), so content can imitate neither.

Once a call's turn is sampled, the memo moves on to it (its prompt + the
sampled ids), where the template renders a conversation up to a turn's
header as it rendered the prompt that turn was sampled for (checked at
load too): the next call then renders only that turn and what the harness
added after it, the fewest messages there can be.
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from jinja2 import TemplateError

from rollout_server.proxy.conversation import AssistantOutput, ChatRequest, Message, ToolSpec
from rollout_server.proxy.errors import ProxyError, invalid

# Surrogate code points: no request's text holds one (see the module's docstring).
_TURN_MARK = "\udb00"  # around a sampled turn's message position
_TOKEN_MARK = "\udb01"  # around the index of an added token that content spelled
_SENTINEL = _TURN_MARK + "sampled-turn-{}" + _TURN_MARK
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLACEHOLDER = re.compile(_TOKEN_MARK + r"(\d+)" + _TOKEN_MARK)

# The encode cache's budget, in estimated bytes held; a piece needing more
# than 1/_CACHE_SHARE of it (a prompt bound to be refused as too long) is not kept.
_CACHE_BYTES = 64 << 20
_CACHE_SHARE = 8
# What an id costs in a cached tuple: its slot, and its int object (ids above 256 are not shared).
_ID_BYTES = 36


def _probe_turn(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": _SENTINEL.format(i)}


# What a template is checked on when loaded: every message kind, sentinel turns numbered by position.
_PROBE: list[dict[str, Any]] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    _probe_turn(2),
    {"role": "tool", "content": "r1", "tool_call_id": "a", "name": "f"},
    {"role": "tool", "content": "r2", "tool_call_id": "b", "name": "f"},
    _probe_turn(5),
    {"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
    _probe_turn(7),
    {"role": "user", "content": "next"},
    _probe_turn(9),
    {"role": "tool", "content": "r3", "tool_call_id": "c"},
]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
]


# How to give the proxy another chat template (a Jinja file), as vLLM's --chat-template does.
TEMPLATE_OVERRIDE = "`legorl proxy --chat-template FILE`, or `proxy.chat_template: FILE` in the config"
NO_TOOLS = (
    "the request offers tools, but the model's chat template renders none, so the model would never see "
    f"them; give the proxy a chat template that renders tools: {TEMPLATE_OVERRIDE}"
)


def _unusable(problem: str) -> ValueError:
    return ValueError(f"chat template: {problem}; give the proxy one that works: {TEMPLATE_OVERRIDE}")


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
    to know about the template (assistant header, turn-end token), and
    whether it renders tools at all. A template the proxy cannot use fails
    here, with a message saying how to give it another."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise _unusable("the tokenizer has none")
        self.tokenizer = tokenizer
        self._cache = _EncodeCache(_CACHE_BYTES)
        self._encode, self._encode_text, self._decode = _codec(tokenizer)
        # Longest first, so a regex alternation matches as the tokenizer does (leftmost, then longest).
        added = sorted(((t.content, i) for i, t in tokenizer.added_tokens_decoder.items()), key=lambda t: -len(t[0]))
        self._added_ids = dict(added)
        self._added_texts = [text for text, _ in added]
        self._added_index = {text: k for k, text in enumerate(self._added_texts)}
        alternation = "|".join(re.escape(text) for text in self._added_texts) or "(?!)"
        self._added = re.compile(alternation)
        # Whether an added token spelled in a JSON string reads the same in its JSON text (nothing to escape).
        self._json_spells_as_text = all(orjson.dumps(text).decode()[1:-1] == text for text in self._added_texts)
        try:
            self._check_added_tokens()
            self.header, self.turn_end_id, self.turn_end_text = self._turn_shape()
            # A template that renders nothing of the tools leaves the model blind to them: such calls are refused.
            base = [{"role": "user", "content": "x"}]
            self.renders_tools = self._apply(base, _PROBE_TOOLS, True, True) != self._apply(base, None, True, True)
        except (TemplateError, TypeError) as exc:  # e.g. a template that refuses tool messages
            raise _unusable(
                f"it cannot render a conversation of system, user, assistant and tool messages with a tool: {exc}"
            ) from exc
        # Whether a memo can be extended, and whether that render needs the tools, and the system message.
        self.incremental, self._suffix_without_tools, self._suffix_without_system = self._local_suffixes()
        self._prompts_extend = self.incremental and self._holds(self._prompt_prefixes_stay)

    def _turn_shape(self) -> tuple[str, int, str]:
        """The assistant header (the generation prompt), and the turn-end
        token's id and text: where the splice cuts a sampled turn."""
        base = [{"role": "user", "content": "x"}]
        with_prompt = self._apply(base, None, True, True)
        without = self._apply(base, None, False, True)
        if not with_prompt.startswith(without) or with_prompt == without:
            raise _unusable("its generation prompt does not extend the rendered conversation")
        header = with_prompt[len(without) :]
        sentinel = _SENTINEL.format(0)
        turn = self._apply([*base, {"role": "assistant", "content": sentinel}], None, False, True)
        if header not in turn[: turn.find(sentinel)]:
            raise _unusable(f"its assistant turns do not start with the generation prompt {header!r}")
        after = turn[turn.find(sentinel) + len(sentinel) :]
        end_ids = self.tokenizer.encode(after, add_special_tokens=False)
        end_text = self.tokenizer.decode(end_ids[:1])
        if not end_ids or not after.startswith(end_text) or end_ids[0] not in self.tokenizer.all_special_ids:
            raise _unusable(f"its assistant turns do not end with a special token (got {after!r} after the content)")
        return header, end_ids[0], end_text

    def call_text(self) -> str | None:
        """How the template writes an assistant turn that calls the probe's
        tool `f` with `{"a": "v"}`: the text between the assistant header and
        the turn end (None when it cannot render one)."""
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": "v"}}}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            text = self._apply(messages, _PROBE_TOOLS, False, True)
        except (TemplateError, TypeError, ValueError):
            return None
        start = text.rfind(self.header)
        end = text.find(self.turn_end_text, start) if start >= 0 else -1
        return None if end < 0 else text[start + len(self.header) : end]

    def _check_added_tokens(self) -> None:
        """That the tokenizer matches added tokens in text as `_encode_spelled`
        does (no token strips the spaces around it, say), and that its
        text-only encode matches none."""
        answered = [{**m, "content": "a"} if m["role"] == "assistant" else m for m in _PROBE]
        full = self._apply(answered, _PROBE_TOOLS, True, True)
        if self._encode_spelled(full) != self._encode(full):
            raise ValueError("chat template: the tokenizer's added tokens are not matched as plain strings in text")
        spelled = self._encode_text("".join(self._added_texts))
        if any(i in spelled for i in self._added_ids.values()):
            raise ValueError("tokenizer: added tokens are still matched when encoding text without them")

    def _apply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tokenize=False,
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
                if at < 0 or header < 0 or prompt[: prompt.rfind(self.header)] != text[:header]:
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
        """Tokenizes a piece of rendered text (cached: the pieces recur on every
        call of a session, system prompt and tool results)."""
        ids = self._cache.get(text)
        if ids is None:
            # A placeholder (a surrogate) never sits in a piece of mostly ASCII text: then this test costs nothing.
            ids = self._encode_spelled(text) if _TOKEN_MARK in text else self._encode(text)
            self._cache.put(text, ids)
        return ids

    def _encode_spelled(self, text: str) -> tuple[int, ...]:
        """Ids of rendered text with placeholders in it: the added tokens left
        in it (the template's own) are tokens; the text between them, the
        placeholders spelled out again, is encoded matching no added token."""
        ids: list[int] = []
        at = 0
        for match in self._added.finditer(text):
            ids += self._encode_text(self._respell(text[at : match.start()]))
            ids.append(self._added_ids[match.group()])
            at = match.end()
        ids += self._encode_text(self._respell(text[at:]))
        return tuple(ids)

    def _respell(self, text: str) -> str:
        return _PLACEHOLDER.sub(lambda m: self._added_texts[int(m.group(1))], text) if text else text

    def _defuse(self, text: str) -> str:
        """A string of the request as the template gets it: each added token it
        spells replaced by a placeholder (encoded back as text). Two searches:
        one pattern for both loses the regex engine's literal prefix scan."""
        if not text.isascii() and (surrogate := _SURROGATE.search(text)) is not None:
            raise invalid(f"the request holds a lone surrogate ({surrogate.group()!r}), which is no Unicode character")
        return text if self._added.search(text) is None else self._added.sub(self._placeholder, text)

    def _placeholder(self, match: re.Match[str]) -> str:
        return f"{_TOKEN_MARK}{self._added_index[match.group()]}{_TOKEN_MARK}"

    def _defused(self, value: Any) -> Any:
        """`_defuse` on every string in a JSON value (tool arguments, schemas).
        One search of its JSON text clears most values, far cheaper than
        walking them; orjson refuses those it cannot write exactly (a surrogate,
        a big integer), which are walked."""
        if isinstance(value, str):
            return self._defuse(value)
        if self._json_spells_as_text:
            try:
                if self._added.search(orjson.dumps(value).decode()) is None:
                    return value
            except TypeError:
                pass
        return self._walk(value)

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._defuse(value)
        if isinstance(value, dict):
            return {self._defuse(k): self._walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v) for v in value]
        return value

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self._decode(list(ids))

    def render(
        self,
        request: ChatRequest,
        matched: dict[int, SampledTurn],
        enable_thinking: bool,
        memo: PrefixMemo | None = None,
    ) -> Prompt:
        """Prompt ids for `request`; `matched` maps message positions to the
        stored turns they were matched to. With a `memo` (one per session),
        a conversation that extends the last one renders only its new part;
        the memo is brought up to date either way."""
        if not any(m.role != "system" for m in request.messages):
            raise invalid("the conversation has no user, assistant or tool message")
        if request.tools and not self.renders_tools:
            raise invalid(NO_TOOLS)
        assistants = sum(m.role == "assistant" for m in request.messages)
        all_reused = assistants == len(matched)
        spliced = (
            self._incremental(request, matched, enable_thinking, memo) if all_reused and memo is not None else None
        )
        incremental = spliced is not None
        if spliced is None:
            spliced = self._splice(
                self._text(request.messages, matched, request.tools, enable_thinking),
                sorted(matched),
                matched,
                0,
                [],
                [],
            )
        if memo is not None:
            _remember(memo, request, matched, enable_thinking, spliced, all_reused)
        return Prompt(
            spliced.ids, spliced.gen_tail, len(matched), assistants - len(matched), tuple(spliced.spans), incremental
        )

    def remember_sampled(
        self,
        memo: PrefixMemo,
        request: ChatRequest,
        matched: dict[int, SampledTurn],
        enable_thinking: bool,
        prompt: Prompt,
        turn: SampledTurn,
    ) -> None:
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

    def _incremental(
        self, request: ChatRequest, matched: dict[int, SampledTurn], enable_thinking: bool, memo: PrefixMemo
    ) -> _Spliced | None:
        k = len(memo.messages)  # the memo's last turn; its message renders as a sentinel, whatever it says
        if not (
            self.incremental
            and memo.valid
            and memo.enable_thinking == enable_thinking
            and memo.tools == request.tools
            and {i: t.index for i, t in matched.items() if i <= k} == memo.turns
            and request.messages[:k] == memo.messages
        ):
            return None
        system = request.messages[0].role == "system" and not self._suffix_without_system
        head = [request.messages[0]] if system else []
        reduced = [*head, *request.messages[k:]]
        shift = k - len(head)  # reduced position + shift = position in the request
        reduced_matched = {i - shift: t for i, t in matched.items() if i >= k}
        try:
            text = self._text(
                reduced, reduced_matched, [] if self._suffix_without_tools else request.tools, enable_thinking
            )
        except ProxyError:
            return None  # e.g. a template that wants a user message first: render in full
        cursor = self._turn_end(text, k - shift)
        if cursor < 0:
            return None
        later = sorted(i for i in reduced_matched if i > k - shift)
        return self._splice(text, later, reduced_matched, cursor, list(memo.ids), list(memo.spans), shift)

    def written_turn(
        self,
        request: ChatRequest,
        matched: dict[int, SampledTurn],
        enable_thinking: bool,
        gen_tail: list[int],
        output: AssistantOutput,
    ) -> list[int]:
        """The ids this model would have sampled to write `output` after the
        prompt of `request` (rendered with `matched`, ending in `gen_tail`): the
        conversation with `output` as its last message, from the assistant
        header up to the turn end, which is included, less the prompt's tail
        where the turn repeats it (Qwen3's empty think block with thinking off).
        A reasoning the tail rules out is left out, as that model could not write it."""
        message = Message("assistant", output.content, output.reasoning, list(output.tool_calls))
        tail = self.decode(gen_tail)
        body = ""
        for reasoning in dict.fromkeys((output.reasoning, None)):
            message.reasoning = reasoning
            text = self._text([*request.messages, message], matched, request.tools, enable_thinking, prompt=False)
            start = text.rfind(self.header)
            end = text.find(self.turn_end_text, start) if start >= 0 else -1
            if end < 0:
                raise invalid("the chat template did not write the teacher's turn as an assistant turn")
            body = text[start + len(self.header) : end]
            if body.startswith(tail):
                return [*self.encode(body[len(tail) :]), self.turn_end_id]
        # The template writes the tail only in its generation prompt (the demo's): the turn follows it whole.
        return [*self.encode(body), self.turn_end_id]

    def _text(
        self,
        messages: list[Message],
        matched: dict[int, SampledTurn],
        tools: list[ToolSpec],
        enable_thinking: bool,
        *,
        prompt: bool = True,
    ) -> str:
        hf_messages = [
            {"role": "assistant", "content": _SENTINEL.format(i)} if i in matched else self._hf_message(m)
            for i, m in enumerate(messages)
        ]
        hf_tools = [
            {
                "type": "function",
                "function": {
                    "name": self._defuse(t.name),
                    "description": self._defuse(t.description),
                    "parameters": self._defused(t.parameters),
                },
            }
            for t in tools
        ] or None
        try:
            return self._apply(hf_messages, hf_tools, prompt, enable_thinking)
        except (TemplateError, ValueError, TypeError) as exc:
            raise invalid(f"the conversation cannot be rendered with the model's chat template: {exc}") from exc

    def _hf_message(self, message: Message) -> dict[str, Any]:
        defuse = self._defuse
        out: dict[str, Any] = {"role": message.role, "content": defuse(message.content)}
        if message.role == "assistant":
            if message.reasoning:
                out["reasoning_content"] = defuse(message.reasoning)
            if message.tool_calls:
                out["tool_calls"] = [
                    {
                        "id": defuse(c.id),
                        "type": "function",
                        "function": {"name": defuse(c.name), "arguments": self._defused(c.arguments)},
                    }
                    for c in message.tool_calls
                ]
        elif message.role == "tool":
            out["tool_call_id"] = defuse(message.tool_call_id or "")
            if message.name:
                out["name"] = defuse(message.name)
        return out

    def _splice(
        self,
        text: str,
        positions: list[int],
        matched: dict[int, SampledTurn],
        cursor: int,
        ids: list[int],
        spans: list[tuple[int, SampledTurn]],
        shift: int = 0,
    ) -> _Spliced:
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
            ids += self.encode(text[cursor : start + len(self.header)])
            spans.append((len(ids), matched[i]))
            ids += matched[i].ids
            stable = len(ids)
            cursor = end + len(self.turn_end_text)
        last = text.rfind(self.header, cursor)
        if last < 0:
            raise invalid("the chat template did not end the prompt with an assistant header")
        ids += self.encode(text[cursor : last + len(self.header)])
        gen_tail = list(self.encode(text[last + len(self.header) :]))
        return _Spliced(ids + gen_tail, gen_tail, spans, stable)


_Encode = Callable[[str], tuple[int, ...]]


def _codec(tokenizer: Any) -> tuple[_Encode, _Encode, Callable[[list[int]], str]]:
    """Encode and decode as `tokenizer.encode(text, add_special_tokens=False)`
    and `tokenizer.decode(ids)` do, straight on the Rust tokenizer: the
    wrappers cost as much again on a short piece, and the fast encode skips
    the character offsets nobody reads here. Decode clean-up stays transformers' work.
    The second encode matches no added token: a tokenizer over the same
    model, normalizer and pre-tokenizer (shared, not copied) without them.
    (A tokenizer that splits special tokens as text never gets here: its turn
    end is no special token.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a tokenizer without a Rust one (sentencepiece, tiktoken)
        return (
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)),
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        )
    from tokenizers import Tokenizer

    text_only = Tokenizer(backend.model)
    text_only.normalizer, text_only.pre_tokenizer = backend.normalizer, backend.pre_tokenizer
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    else:
        decode = lambda ids: backend.decode(ids, skip_special_tokens=False)  # noqa: E731
    return (
        lambda text: tuple(backend.encode_batch_fast([text], add_special_tokens=False)[0].ids),
        lambda text: tuple(text_only.encode_batch_fast([text], add_special_tokens=False)[0].ids),
        decode,
    )


class _EncodeCache:
    """Text pieces' ids, the least recently used dropped first once the bytes
    held (an estimate) pass the budget; a piece too big for its share of the
    budget is not kept at all."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0  # estimated bytes held
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> tuple[int, ...] | None:
        ids = self._entries.get(text)
        if ids is not None:
            self._entries.move_to_end(text)
        return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        cost = _cost(text, ids)
        if cost > self.budget // _CACHE_SHARE:
            return
        self._entries[text] = ids
        self.size += cost
        while self.size > self.budget:
            self.size -= _cost(*self._entries.popitem(last=False))


def _cost(text: str, ids: tuple[int, ...]) -> int:
    return sys.getsizeof(text) + _ID_BYTES * len(ids)


def _remember(
    memo: PrefixMemo,
    request: ChatRequest,
    matched: dict[int, SampledTurn],
    enable_thinking: bool,
    spliced: _Spliced,
    all_reused: bool,
) -> None:
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
    memo.ids = tuple(spliced.ids[: spliced.stable])
