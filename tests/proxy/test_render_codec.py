"""The chat template's encode and decode, which go straight to the Rust
tokenizer on the hot path, give exactly what the transformers tokenizer
gives, on arbitrary text with the template's special tokens mixed in."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_server.proxy.render import ChatTemplate

_SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "\t"]
_pieces = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(_SPECIAL)), max_size=12).map("".join)


@given(text=_pieces)
@settings(max_examples=200, deadline=None)
def test_encode_and_decode_match_the_tokenizer(tokenizer: Any, text: str) -> None:
    template = _template(tokenizer)
    ids = template.encode(text)
    assert list(ids) == tokenizer.encode(text, add_special_tokens=False)
    assert template.decode(ids) == tokenizer.decode(list(ids), skip_special_tokens=False)


def test_decode_clean_up_goes_through_transformers(tokenizer: Any) -> None:
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    # transformers skips the clean-up for BPE tokenizers unless told to apply it anyway
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = cleaning.encode("a , b . c !", add_special_tokens=False)
    cleaned = ChatTemplate(cleaning).decode(ids)
    assert cleaned == cleaning.decode(ids, skip_special_tokens=False)
    assert cleaned != _template(tokenizer).decode(ids)  # the clean-up really ran


_TEMPLATES: dict[int, ChatTemplate] = {}


def _template(tokenizer: Any) -> ChatTemplate:
    """One ChatTemplate per tokenizer: hypothesis calls the test many times."""
    return _TEMPLATES.setdefault(id(tokenizer), ChatTemplate(tokenizer))
