"""Turns one request's engine events into a vLLM completion choice: text,
stop strings, logprobs blocks, and the deltas of a streamed response.

Token ids are the ground truth; text is derived from them. A stop string ends
the choice at the token that completed it (that token stays in `token_ids`,
the stop string leaves the text unless `include_stop_str_in_output`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from legorl_jax.serve.protocol import CompletionChoice, CompletionLogprobs, WeightVersionSpan
from legorl_jax.serve.request_types import FinishEvent, PromptEntry, TokenEvent

_INCOMPLETE = "\ufffd"  # what a byte-level decode yields for a cut UTF-8 sequence


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclasses.dataclass(frozen=True)
class ChoiceOptions:
    stop_strings: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    tokens_as_ids: bool = False
    return_token_ids: bool = False
    return_weight_versions: bool = False


class ChoiceBuilder:
    def __init__(self, index: int, prompt: list[int], tokenizer: Detokenizer, options: ChoiceOptions) -> None:
        self.index = index
        self.prompt = prompt
        self.tok = tokenizer
        self.opt = options
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]] | None] = []
        self.versions: list[WeightVersionSpan] = []  # runs of tokens sampled under one weight version label
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
        self._offsets: list[int] = []  # text offset of each token (vLLM's text_offset)
        self._next_offset = 0
        # Incremental detokenization: text of tokens [_prefix, _read) is already
        # in self.text; decoding only from _prefix keeps each token O(1) while
        # giving the text a whole-sequence decode would.
        self._prefix = 0
        self._read = 0
        self._sent_tokens = 0
        self._sent_text = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, event: TokenEvent) -> bool:
        """Records a token; True when a stop string just ended the choice."""
        if self.finished:
            return False  # produced after a stop string, before the engine saw the abort
        self._offsets.append(self._next_offset)
        self._next_offset += len(self._plain(event.token))
        self.token_ids.append(event.token)
        self.logprobs.append(event.logprob)
        self.tops.append(event.top)
        self._add_version(event.version)
        previous = len(self.text)
        self._detokenize(final=False)
        return self._check_stop_strings(previous)

    def _add_version(self, version: str) -> None:
        last = self.versions[-1] if self.versions else None
        if last is not None and last.version == version:
            last.end += 1
        else:
            at = len(self.token_ids) - 1
            self.versions.append(WeightVersionSpan(version=version, start=at, end=at + 1))

    def _weight_versions(self) -> list[WeightVersionSpan] | None:
        """Covers every output token; a stop string's cut leaves token_ids whole, so the spans too."""
        if not self.opt.return_weight_versions:
            return None
        return [span.model_copy() for span in self.versions]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.opt.skip_special_tokens)

    def _plain(self, token: int) -> str:
        return self._decode([token])

    def _detokenize(self, final: bool) -> None:
        """Appends the text of tokens not yet in self.text. A cut UTF-8
        sequence (decoded as U+FFFD) waits for its next token unless final."""
        if self._read == len(self.token_ids):
            return
        known = self._decode(self.token_ids[self._prefix : self._read])
        window = self._decode(self.token_ids[self._prefix :])
        if len(window) > len(known) and (final or not window.endswith(_INCOMPLETE)):
            self.text += window[len(known) :]
            self._prefix, self._read = self._read, len(self.token_ids)

    def _check_stop_strings(self, previous: int) -> bool:
        longest = max((len(s) for s in self.opt.stop_strings), default=0)
        # Only text that could contain a newly completed stop string is searched.
        start = max(0, previous - longest)
        hits = [(self.text.find(s, start), s) for s in self.opt.stop_strings]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[: at + len(stop)] if self.opt.include_stop_str else self.text[:at]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def finish(self, event: FinishEvent) -> None:
        if not self.finished:
            self._detokenize(final=True)
            self.finish_reason = event.reason
            self.stop_reason = event.stop_token

    def set_prompt_logprobs(self, entries: list[PromptEntry]) -> None:
        """vLLM's prompt_logprobs: None for the first token, then {id: {logprob,
        rank, decoded_token}} with the prompt token and the top alternatives."""
        block: list[dict[str, dict[str, Any]] | None] = [None]
        for token, entry in zip(self.prompt[1:], entries, strict=True):
            ranked = [(token, entry.logprob, entry.rank)]
            ranked += [(alt, logprob, i + 1) for i, (alt, logprob) in enumerate(entry.top) if alt != token]
            block.append(
                {str(t): {"logprob": lp, "rank": r, "decoded_token": self._token_str(t)} for t, lp, r in ranked}
            )
        self.prompt_logprobs = block

    # ----- rendering ---------------------------------------------------------
    def _token_str(self, token: int) -> str:
        if self.opt.tokens_as_ids:
            return f"token_id:{token}"
        return self.tok.decode([token], skip_special_tokens=False)

    def _logprobs_block(self, lo: int, hi: int) -> CompletionLogprobs:
        block = CompletionLogprobs()
        for i in range(lo, hi):
            token = self._token_str(self.token_ids[i])
            block.tokens.append(token)
            block.token_logprobs.append(self.logprobs[i])
            block.text_offset.append(self._offsets[i])
            top = self.tops[i]
            if top is None:
                block.top_logprobs.append(None)
            else:
                entries = {self._token_str(t): lp for t, lp in top}
                entries.setdefault(token, self.logprobs[i])
                block.top_logprobs.append(entries)
        return block

    def final(self) -> CompletionChoice:
        return CompletionChoice(
            index=self.index,
            text=self.text,
            logprobs=self._logprobs_block(0, len(self.token_ids)) if self.opt.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=self.prompt if self.opt.return_token_ids else None,
            token_ids=self.token_ids if self.opt.return_token_ids else None,
            weight_versions=self._weight_versions(),
        )

    def delta(self) -> CompletionChoice | None:
        """What arrived since the last delta, or None when there is nothing to send.
        Text that may still become part of a stop string is held back until the
        choice finishes (a cut UTF-8 sequence never reaches self.text early)."""
        ready = len(self.text)
        if not self.finished:
            hold = max((len(s) - 1 for s in self.opt.stop_strings), default=0)
            ready = max(self._sent_text, len(self.text) - hold)
        lo, hi = self._sent_tokens, len(self.token_ids)
        if hi == lo and ready == self._sent_text and not self.finished:
            return None
        text = self.text[self._sent_text : ready]
        first = lo == 0 and self._sent_text == 0
        choice = CompletionChoice(
            index=self.index,
            text=text,
            logprobs=self._logprobs_block(lo, hi) if self.opt.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_logprobs=self.prompt_logprobs if first else None,
            prompt_token_ids=self.prompt if self.opt.return_token_ids and first else None,
            token_ids=self.token_ids[lo:hi] if self.opt.return_token_ids else None,
            # vLLM sends the spans of the whole output once, on the last chunk.
            weight_versions=self._weight_versions() if self.finished else None,
        )
        self._sent_tokens, self._sent_text = hi, ready
        return choice
