"""The demo tokenizer and the Qwen3-format chat template.

Expected renderings are written out literally: they are the token format a real
Qwen3 model was trained on, so any drift in the template must show up here.
"""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import legorl_jax.models.tokenizer as tokenizer_module
from legorl_jax.models.tokenizer import (
    CONTROL_TOKENS,
    MARKUP_TOKENS,
    TOKENIZER_FILES,
    build_demo_tokenizer,
    load_chat_template,
)

VOCAB = 512

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}},
]

TOOLS_SYSTEM = (
    "# Tools\n\nYou can call the functions below to help with the request. Their signatures, one JSON object per"
    " line, are inside <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": '
    '{"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}\n'
    '{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}\n'
    "</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments inside"
    " <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_plain_chat(tok) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye\n"},
    ]
    assert render(tok, messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye\n<|im_end|>\n"
    )


def test_tools_tool_calls_and_grouped_tool_results(tok) -> None:
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files, then show the cwd."},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls -a"}}},
                {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": '{"command": "pwd"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": ".\n..\nsetup.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "/work/ü"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "read_file", "arguments": {}}}]},
        {"role": "tool", "content": [{"type": "text", "text": "print(1)"}]},
    ]
    assert render(tok, messages, tools=TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a coding agent.\n\n" + TOOLS_SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\nList the files, then show the cwd.<|im_end|>\n"
        "<|im_start|>assistant\nSure.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n.\n..\nsetup.py\n</tool_response>\n"
        "<tool_response>\n/work/ü\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_without_system_message_get_their_own_system_turn(tok) -> None:
    assert render(tok, [{"role": "user", "content": "hi"}], tools=TOOLS) == (
        "<|im_start|>system\n" + TOOLS_SYSTEM + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_reasoning_before_the_last_user_query_is_dropped(tok) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "reasoning_content": "old thought", "content": "a1"},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "reasoning_content": "\nneed ls\n",
            "content": "\nLooking.",
            "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        # A tool result a harness sent as user text is not a new query.
        {"role": "user", "content": "<tool_response>\nsetup.py\n</tool_response>"},
        {"role": "assistant", "content": "<think>\ninline thought\n</think>\n\nDone."},
    ]
    assert render(tok, messages) == (
        "<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nneed ls\n</think>\n\nLooking.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsetup.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\ninline thought\n</think>\n\nDone.<|im_end|>\n"
    )


def test_inline_reasoning_before_the_last_query_is_stripped(tok) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
    ]
    assert render(tok, messages) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("kwargs", "suffix"),
    [
        ({}, "<|im_start|>assistant\n"),
        ({"enable_thinking": True}, "<|im_start|>assistant\n"),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
def test_generation_prompt(tok, kwargs: dict, suffix: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render(tok, messages, add_generation_prompt=True, **kwargs) == "<|im_start|>user\nhi<|im_end|>\n" + suffix
    assert render(tok, messages, **kwargs) == "<|im_start|>user\nhi<|im_end|>\n"


def test_multi_part_content_is_joined(tok) -> None:
    content = [{"type": "text", "text": "first "}, {"type": "text", "text": "second"}]
    assert render(tok, [{"role": "user", "content": content}]) == "<|im_start|>user\nfirst second<|im_end|>\n"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "robot", "content": "x"}], "unknown message role: robot"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "only text content parts"),
        ([{"role": "user", "content": 3}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "only allowed first"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], "needs a function name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], "arguments must be a JSON string"),
    ],
)
def test_bad_messages_get_a_clear_error(tok, messages: list, error: str) -> None:
    with pytest.raises(jinja2.TemplateError, match=error):
        render(tok, messages)


def test_rendering_does_not_depend_on_jinja_whitespace_options(tok) -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "r", "content": "a"},
        {"role": "tool", "content": "t"},
    ]
    plain = ImmutableSandboxedEnvironment().from_string(load_chat_template())
    assert plain.render(messages=messages, add_generation_prompt=True) == render(
        tok, messages, add_generation_prompt=True
    )


def test_tokenized_template_matches_encoded_text(tok) -> None:
    messages = [{"role": "user", "content": "run ls"}, {"role": "assistant", "content": "ok"}]
    text = render(tok, messages, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    encoded = tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, add_generation_prompt=True, enable_thinking=False, return_dict=True
    )
    ids = encoded["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 4
    think = tok.convert_tokens_to_ids("<think>")
    assert ids.count(think) == 1 and tok.decode(ids[ids.index(think) :]) == "<think>\n\n</think>\n\n"


def test_special_tokens_are_single_ids(tok, tok_dir: Path) -> None:
    ids = [tok.encode(token, add_special_tokens=False) for token in (*CONTROL_TOKENS, *MARKUP_TOKENS)]
    assert all(len(single) == 1 for single in ids)
    assert len({single[0] for single in ids}) == len(ids)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert len(tok) == VOCAB
    # Control tokens vanish with skip_special_tokens; the markup the proxy parses stays.
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == (
        "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    )
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == load_chat_template() == tok.chat_template


FRAGMENTS = st.one_of(
    st.text(),
    st.sampled_from([*CONTROL_TOKENS, *MARKUP_TOKENS, " ", "\n", "\r\n", "\t", "  \n\n ", "<|im", "</"]),
)


@pytest.fixture(scope="module")
def raw_tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@settings(max_examples=300, deadline=None)
@given(st.lists(FRAGMENTS, max_size=8).map("".join))
def test_round_trip_is_exact(tok, raw_tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # The `tokenizers` library alone (no transformers) agrees both ways.
    assert raw_tok.encode(text).ids == ids
    assert raw_tok.decode(ids, skip_special_tokens=False) == text


def _same_files(a: Path, b: Path) -> bool:
    return all(filecmp.cmp(a / name, b / name, shallow=False) for name in TOKENIZER_FILES)


def test_build_is_deterministic_across_processes(tmp_path: Path) -> None:
    corpus = ["def extra_corpus_function():\n    return 'ok'\n"] * 3
    here = build_demo_tokenizer(tmp_path / "here", corpus=corpus, vocab_size=VOCAB)
    # A fresh interpreter has fresh hash seeds (Python's and the Rust trainer's).
    # It loads the module file alone, to skip the package's heavy JAX imports.
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('demo_tokenizer', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"module.build_demo_tokenizer(sys.argv[2], corpus={corpus!r}, vocab_size={VOCAB})\n"
    )
    subprocess.run([sys.executable, "-c", script, tokenizer_module.__file__, str(tmp_path / "there")], check=True)
    assert _same_files(here, tmp_path / "there")
    plain = build_demo_tokenizer(tmp_path / "plain", vocab_size=VOCAB)
    assert not filecmp.cmp(here / "tokenizer.json", plain / "tokenizer.json", shallow=False)


def test_extra_corpus_shapes_the_vocabulary(tmp_path: Path) -> None:
    word = "zyxwvutsrqzyxwvutsrq"
    base = AutoTokenizer.from_pretrained(build_demo_tokenizer(tmp_path / "a", vocab_size=VOCAB))
    tuned = AutoTokenizer.from_pretrained(build_demo_tokenizer(tmp_path / "b", corpus=[word] * 500, vocab_size=VOCAB))
    assert len(tuned.encode(word)) < len(base.encode(word))


def test_default_vocab_size_is_filled(tmp_path: Path) -> None:
    assert len(AutoTokenizer.from_pretrained(build_demo_tokenizer(tmp_path))) == 1024


@pytest.mark.parametrize("vocab_size", [10, 0, -5, 300.5, True])
def test_bad_vocab_size(tmp_path: Path, vocab_size: object) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_demo_tokenizer(tmp_path, vocab_size=vocab_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("corpus", ["a single string", ["ok", 3]])
def test_bad_corpus(tmp_path: Path, corpus: object) -> None:
    with pytest.raises(TypeError, match="corpus"):
        build_demo_tokenizer(tmp_path, corpus=corpus)  # type: ignore[arg-type]
