"""Choice assembly: stop strings, streamed deltas, held-back text, offsets."""

from __future__ import annotations

from legorl_jax.serve.output import ChoiceBuilder, ChoiceOptions
from legorl_jax.serve.request_types import FinishEvent, TokenEvent


class ByteDetokenizer:
    """TEST INSTRUMENT: each id is a byte string; decoding joins bytes like a byte-level BPE."""

    VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xc3", 6: b"\xa9", 7: b"!", 8: b"<eos>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 8)).decode("utf-8", "replace")


def _builder(**options: object) -> ChoiceBuilder:
    return ChoiceBuilder(0, [1], ByteDetokenizer(), ChoiceOptions(**options))  # type: ignore[arg-type]


def _feed(builder: ChoiceBuilder, ids: list[int]) -> list[bool]:
    return [builder.add_token(TokenEvent(i, -float(i), None)) for i in ids]


def test_stop_string_across_tokens_cuts_text_and_ignores_later_tokens() -> None:
    b = _builder(stop_strings=("o wo",), return_token_ids=True, logprobs=0)
    assert _feed(b, [1, 2, 3, 4]) == [False, False, True, False]
    final = b.final()
    assert final.text == "Hell" and final.finish_reason == "stop" and final.stop_reason == "o wo"
    assert final.token_ids == [1, 2, 3]  # the token completing the stop string stays
    assert final.logprobs is not None and final.logprobs.text_offset == [0, 3, 5]


def test_include_stop_str_keeps_it() -> None:
    b = _builder(stop_strings=("lo",), include_stop_str=True)
    _feed(b, [1, 2, 3])
    assert b.final().text == "Hello"


def test_deltas_hold_back_possible_stop_prefix_and_cut_utf8() -> None:
    b = _builder(stop_strings=("ld!",), return_token_ids=True)
    texts = []
    for token in [1, 5, 6, 3, 4]:
        _feed(b, [token])
        delta = b.delta()
        texts.append(None if delta is None else delta.text)
    # "Hel" minus 2 held-back chars; the cut "\xc3" waits for its second byte.
    assert texts[0] == "H"
    streamed = "".join(t or "" for t in texts)
    assert "\ufffd" not in streamed and streamed == "Hel\u00e9 wor"[: len(streamed)]
    b.finish(FinishEvent("length"))
    last = b.delta()
    assert last is not None and last.finish_reason == "length"
    assert streamed + last.text == "Hel\u00e9 world"
    assert last.token_ids == []


def test_first_delta_carries_prompt_ids_and_finish_keeps_engine_reason() -> None:
    b = _builder(return_token_ids=True)
    _feed(b, [1])
    first = b.delta()
    assert first is not None and first.prompt_token_ids == [1] and first.token_ids == [1]
    _feed(b, [8])
    b.finish(FinishEvent("stop"))
    second = b.delta()
    assert second is not None and second.prompt_token_ids is None and second.token_ids == [8]
    assert b.final().text == "Hel" and b.final().finish_reason == "stop" and b.final().stop_reason is None


def test_incremental_text_equals_a_whole_decode() -> None:
    ids = [1, 5, 6, 2, 8, 5, 6, 3, 7, 4, 5]  # ends on a cut UTF-8 byte
    b = _builder()
    _feed(b, ids)
    assert b.text == ByteDetokenizer().decode(ids[:-1])
    b.finish(FinishEvent("length"))
    assert b.text == ByteDetokenizer().decode(ids) and b.text.endswith("\ufffd")
