"""The proxy's tool-call parsers against vLLM's parsers of the same names, run
on the same completion texts by vLLM itself (set-up's CPU build): the harness
must get the calls and content it would get from the policy deployed on vLLM.

Where the two differ on purpose, `DIFFERENT` says how and why, and the test
holds that difference too, so a change on either side is seen.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollout_server.backends.vllm import find_vllm
from rollout_server.proxy.completion_parser import ToolCallFormat, parse_completion
from rollout_server.proxy.conversation import ToolSpec

from .chat_formats import build_llama_style_tokenizer

pytestmark = pytest.mark.vllm

PARAMS = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "n": {"type": "integer"}, "path": {"type": "string"}},
}


def hermes(name: str, args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def xml(name: str, **params: Any) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def llama(name: str, args: Any) -> str:
    return json.dumps({"name": name, "parameters": args})


SAME: dict[ToolCallFormat, list[str]] = {
    "hermes": [
        "Just text, no call.",
        hermes("bash", {"command": "ls -la"}),
        "Let me look.\n" + hermes("bash", {"command": "ls"}),
        hermes("bash", {"command": "ls"}) + "\n" + hermes("bash", {"command": "pwd"}),
        hermes("bash", {"command": "echo 'héllo' && cat <<EOF\n}\nEOF"}),
        hermes("bash", {"command": "ls"}) + "\nand words after the call",
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}',  # never closed
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}\n</tool_call>',  # not JSON
        '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "bash"}\n</tool_call>',  # no arguments
    ],
    "qwen3_coder": [
        "Just text, no call.",
        xml("bash", command="ls -la"),
        "Let me look.\n" + xml("bash", command="ls"),
        xml("bash", command="ls") + "\n" + xml("bash", command="pwd", n=3),
        xml("bash", command="cat <<EOF\na < b\nEOF"),
        xml("bash", n="3"),
        xml("bash", command="ls", n="not a number"),
        xml("bash", command="ls").removesuffix("</tool_call>"),  # never closed
        xml("bash", command="ls") + "\nwords after the call",
        xml("unknown_tool", path="a.txt"),
    ],
    "llama3_json": [
        "Just text, no call.",
        "I'd write {x} here.",
        'Set {"a": 1} in the config.',
        llama("bash", {"command": "ls"}),
        "<|python_tag|>" + llama("bash", {"command": "ls; pwd"}),
        llama("bash", {"command": "a"}) + "; " + llama("bash", {"command": "b"}),
        "Some words " + llama("bash", {"command": "ls"}),
        llama("bash", {"command": "ls"}) + " trailing words",
        '{"name": "bash", "arguments": {"command": "ls"}}',
        '{"name": "bash", "parameters": {"command": "ls"}',  # not JSON
        '{"parameters": {"command": "ls"}}',  # no name
    ],
}

# (format, text, what the proxy does, why it does not follow vLLM)
DIFFERENT: list[tuple[ToolCallFormat, str, dict[str, Any], str]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}\n</tool_call>',
        {"calls": [["bash", {"command": "ls"}]], "content": None},
        "double-encoded arguments are decoded; vLLM passes the harness a JSON string where an object belongs",
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "bash", "arguments": {"n": NaN}}\n</tool_call>',
        {"calls": [], "content": '<tool_call>\n{"name": "bash", "arguments": {"n": NaN}}\n</tool_call>'},
        "NaN is not JSON: vLLM would send the harness arguments no JSON parser reads",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<parameter=command>\nls\n</parameter>\n</tool_call>",
        {"calls": [], "content": "<tool_call>\n<parameter=command>\nls\n</parameter>\n</tool_call>"},
        "a call with no function is the policy's text, kept as content; vLLM returns no content at all",
    ),
]


def _ours(fmt: ToolCallFormat, text: str) -> dict[str, Any]:
    out = parse_completion(text, fmt, [ToolSpec("bash", "", PARAMS)], lambda: "call")
    return {"calls": [[c.name, c.arguments] for c in out.tool_calls], "content": out.content or None}


def _theirs(result: dict[str, Any]) -> dict[str, Any]:
    # Whitespace around the content is the only liberty taken: the proxy strips it.
    content = (result["content"] or "").strip() or None
    return {"calls": [[name, json.loads(args)] for name, args in result["calls"]], "content": content}


def test_tool_parsers_read_completions_as_vllm_does(tokenizer_dir: Path, tmp_path: Path) -> None:
    python = Path(find_vllm()).parent / "python"
    if not python.is_file():
        pytest.skip(f"no Python beside {find_vllm()}: vLLM's parsers cannot be run")
    tokenizers = {"hermes": tokenizer_dir, "qwen3_coder": tokenizer_dir}
    tokenizers["llama3_json"] = build_llama_style_tokenizer(tmp_path / "llama")  # has `<|python_tag|>`
    cases = [(fmt, text) for fmt, texts in SAME.items() for text in texts]
    cases += [(fmt, text) for fmt, text, _, _ in DIFFERENT]
    job = {
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": PARAMS}}],
        "cases": [[fmt, str(tokenizers[fmt]), text] for fmt, text in cases],
    }
    script = Path(__file__).parent / "vllm_parse.py"
    run = subprocess.run([str(python), str(script)], input=json.dumps(job), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    differing = {(fmt, text): ours for fmt, text, ours, _ in DIFFERENT}
    for (fmt, text), result in zip(cases, results, strict=True):
        theirs, ours = _theirs(result), _ours(fmt, text)
        if (fmt, text) in differing:
            assert ours == differing[fmt, text] and ours != theirs, (fmt, text, theirs)
        else:
            assert ours == theirs, (fmt, text)
