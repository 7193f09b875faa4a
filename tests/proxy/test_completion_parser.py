"""Completion text -> reasoning, content, tool calls; malformed calls are the policy's error."""

from __future__ import annotations

import itertools

import pytest

from rollout_server.proxy.completion_parser import parse_completion, split_reasoning
from rollout_server.proxy.conversation import ToolSpec

TOOLS = [
    ToolSpec(
        "edit",
        "Edit a file.",
        {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "dry": {"type": "boolean"},
                "text": {"type": "string"},
            },
        },
    )
]


def ids() -> object:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_split_reasoning_variants() -> None:
    assert split_reasoning("<think>\nhmm\n</think>\n\nanswer") == ("hmm", "answer")
    # The template put `<think>` in the prompt: only the close was sampled.
    assert split_reasoning("hmm\n</think>\n\nanswer") == ("hmm", "answer")
    # Cut off mid-thought by max_tokens.
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")
    assert split_reasoning("plain answer") == (None, "plain answer")


def test_hermes_calls_with_prose_and_reasoning() -> None:
    text = (
        '<think>look first</think>\n\nLet me look.\n<tool_call>\n{"name": "edit", "arguments": {"path": "a.py"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "edit", "arguments": "{\\"path\\": \\"b.py\\"}"}\n</tool_call>'
    )
    out = parse_completion(text, "hermes", TOOLS, ids())
    assert out.reasoning == "look first"
    assert out.content == "Let me look."
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_0", "edit", {"path": "a.py"}),
        ("call_1", "edit", {"path": "b.py"}),
    ]
    assert out.parse_error is None


@pytest.mark.parametrize(
    "body, error",
    [
        ('<tool_call>\n{"name": "edit", "arguments": {"path": \n</tool_call>', "not JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "lacks a string 'name'"),
        ('<tool_call>\n{"name": "edit", "arguments": [1]}\n</tool_call>', "not a JSON object"),
        ('<tool_call>\n{"name": "edit"}\n</tool_call>', "lacks 'arguments'"),
    ],
)
def test_malformed_hermes_call_is_content_with_parse_error(body: str, error: str) -> None:
    out = parse_completion("Trying.\n" + body, "hermes", TOOLS, ids())
    assert out.tool_calls == ()
    assert out.content == ("Trying.\n" + body).strip()
    assert out.parse_error is not None and error in out.parse_error


def test_an_unclosed_last_call_is_read_and_text_after_calls_is_dropped() -> None:
    """As vLLM's parsers read them: the harness sees what it would see deployed on vLLM."""
    out = parse_completion(
        'Sure.\n<tool_call>\n{"name": "edit", "arguments": {"path": "a.py"}}', "hermes", TOOLS, ids()
    )
    assert out.content == "Sure." and [c.arguments for c in out.tool_calls] == [{"path": "a.py"}]
    xml = "<tool_call>\n<function=edit>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>\nDone."
    out = parse_completion(
        xml + "\n" + xml.removesuffix("\nDone.").removesuffix("</tool_call>"), "qwen3_coder", TOOLS, ids()
    )
    assert out.content == "" and [c.arguments for c in out.tool_calls] == [{"path": "a.py"}] * 2
    assert out.parse_error is None


def test_qwen3_coder_xml_calls_coerced_by_schema() -> None:
    text = (
        "I will edit.\n<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
        "<parameter=line>\n12\n</parameter>\n<parameter=dry>\nfalse\n</parameter>\n"
        "<parameter=text>\n42\n  indented\n</parameter>\n</function>\n</tool_call>"
    )
    out = parse_completion(text, "qwen3_coder", TOOLS, ids())
    assert out.content == "I will edit."
    assert out.tool_calls[0].name == "edit"
    # Declared strings stay strings even when they look like JSON.
    assert out.tool_calls[0].arguments == {"path": "src/a.py", "line": 12, "dry": False, "text": "42\n  indented"}


def test_qwen3_coder_unknown_tool_keeps_json_looking_values() -> None:
    text = "<tool_call>\n<function=other>\n<parameter=n>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    out = parse_completion(text, "qwen3_coder", TOOLS, ids())
    assert out.tool_calls[0].arguments == {"n": [1, 2]}


def test_qwen3_coder_without_function_is_parse_error() -> None:
    out = parse_completion('<tool_call>\n{"name": "edit"}\n</tool_call>', "qwen3_coder", TOOLS, ids())
    assert out.tool_calls == () and "function=NAME" in (out.parse_error or "")


def test_non_standard_json_constants_are_parse_errors() -> None:
    out = parse_completion(
        '<tool_call>\n{"name": "edit", "arguments": {"line": NaN}}\n</tool_call>', "hermes", TOOLS, ids()
    )
    assert out.tool_calls == () and "NaN is not JSON" in (out.parse_error or "")
    xml = "<tool_call>\n<function=edit>\n<parameter=line>\nInfinity\n</parameter>\n</function>\n</tool_call>"
    assert parse_completion(xml, "qwen3_coder", TOOLS, ids()).tool_calls[0].arguments == {"line": "Infinity"}


def test_tool_call_nested_too_deeply_is_a_parse_error() -> None:
    """A policy that emits JSON nested past the parser's stack gets a parse
    error (its turn still captured), not a failed call."""
    for block in ("[" * 5_000 + "]" * 5_000, '{"name": "f", "arguments": "' + "[" * 5_000 + "]" * 5_000 + '"}'):
        out = parse_completion(f"<tool_call>\n{block}\n</tool_call>", "hermes", [], lambda: "c")
        assert out.tool_calls == () and out.parse_error is not None and "deep" in out.parse_error


def test_llama3_json_single_and_several_calls() -> None:
    single = '{"name": "edit", "parameters": {"path": "a.py", "line": 3}}'
    out = parse_completion(single, "llama3_json", TOOLS, ids())
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("edit", {"path": "a.py", "line": 3})]
    assert out.content == "" and out.parse_error is None
    # Several calls separated by `;`; a `;` inside an argument (a shell command) is the argument's.
    several = '{"name": "edit", "parameters": {"text": "cd src; ls"}} ; {"name": "edit", "arguments": {"dry": true}};\n'
    out = parse_completion(several, "llama3_json", TOOLS, ids())
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_0", "edit", {"text": "cd src; ls"}),
        ("call_1", "edit", {"dry": True}),
    ]


def test_llama3_json_calls_after_python_tag_with_prose_and_reasoning() -> None:
    text = (
        '<think>look</think>\n\nLet me edit.<|python_tag|>{"name": "edit", "parameters": {"path": "a.py"}}; '
        '{"name": "edit", "parameters": "{\\"path\\": \\"b.py\\"}"}'
    )
    out = parse_completion(text, "llama3_json", TOOLS, ids())
    assert out.reasoning == "look" and out.content == ""  # vLLM's llama3_json parser drops the prose
    assert [c.arguments for c in out.tool_calls] == [{"path": "a.py"}, {"path": "b.py"}]
    # After `<|python_tag|>` it is a call even in a request without tools: the model meant one.
    assert parse_completion('<|python_tag|>{"name": "f", "parameters": {}}', "llama3_json", [], ids()).tool_calls


def test_llama3_json_plain_answers_are_content() -> None:
    for text in ("The answer is 4.", "I'd write {x} here.", 'Set {"a": 1} in the config.'):
        out = parse_completion(text, "llama3_json", TOOLS, ids())
        assert out.content == text and out.tool_calls == () and out.parse_error is None
    # A JSON answer to a request that offered no tools is an answer, not a malformed call.
    out = parse_completion('{"answer": 4}', "llama3_json", [], ids())
    assert out.content == '{"answer": 4}' and out.tool_calls == () and out.parse_error is None


def test_llama3_json_calls_anywhere_in_the_text_are_read() -> None:
    text = 'Running it: {"name": "edit", "parameters": {"path": "a.py"}} then {"name": "edit", "arguments": {}}.'
    out = parse_completion(text, "llama3_json", TOOLS, ids())
    assert [c.arguments for c in out.tool_calls] == [{"path": "a.py"}, {}] and out.content == ""


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"name": "edit", "parameters": {"path": ', "not JSON"),
        ('{"parameters": {}}', "lacks a string 'name'"),
        ('{"name": "edit", "parameters": [1]}', "not a JSON object"),
        ('{"name": "edit"}', "lacks 'arguments' or 'parameters'"),
        ("Sure.<|python_tag|>", "no tool call"),
        ('<|python_tag|>{"name": "edit", "parameters": {"line": NaN}}', "NaN is not JSON"),
        ('<|python_tag|>{"name": "f", "parameters": ' + "[" * 5_000 + "]" * 5_000 + "}", "deep"),
    ],
)
def test_malformed_llama3_json_call_is_content_with_parse_error(text: str, error: str) -> None:
    out = parse_completion(text, "llama3_json", TOOLS, ids())
    assert out.tool_calls == () and out.content == text.strip()
    assert out.parse_error is not None and error in out.parse_error
