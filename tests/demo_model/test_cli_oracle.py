"""The CLI oracle without a CLI or Docker: its moves read off prompts as the demo chat template renders
them (a harness's own opening exchange is no move; side calls, with tools or without, get the side
text), and the shell calls it writes from a tool's schema."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from legorl_jax.demo.cli_demonstrations import CLI_MOVES, CLI_PLANS, SIDE_TEXT, CliOracle, shell_call
from legorl_jax.demo.demonstrations import FINISH_TEXT, DemonstrationError
from rollout_server.proxy.engine_client import CompletionParams
from rollout_server.proxy.render import ChatTemplate

COMMAND = "echo color=blue >> /app/settings.conf"
SHELL = {
    "name": "run_shell_command",
    "description": "Runs a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
SAMPLING = CompletionParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=1024, stop_token_ids=())
# Qwen Code opens every conversation with its context and an answer it wrote itself.
OPENING = [
    {"role": "system", "content": "You are Qwen Code."},
    {"role": "user", "content": "This is the Qwen Code. We are setting up the context for our chat."},
    {"role": "assistant", "content": "Got it. Thanks for the context!"},
    {"role": "user", "content": "Add the line color=blue at the end of /app/settings.conf."},
]


def answer(oracle: CliOracle, tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The oracle's completion text for this conversation, rendered as the proxy renders it."""
    wire_tools = [{"type": "function", "function": tool} for tool in tools] or None
    ids = tokenizer.apply_chat_template(messages, tools=wire_tools, add_generation_prompt=True, return_dict=False)
    completion = asyncio.run(oracle.complete(list(ids), SAMPLING))
    return str(tokenizer.decode(list(completion.token_ids[:-1])))


def test_a_harness_opening_exchange_is_not_a_move_and_side_calls_get_the_side_text(tokenizer: Any) -> None:
    oracle = CliOracle(ChatTemplate(tokenizer), CLI_MOVES["qwen-code"], CLI_PLANS["direct"], COMMAND)
    solve = shell_call(SHELL, COMMAND)
    # The first call already holds an assistant turn: the harness's, so the plan starts at its first move.
    assert answer(oracle, tokenizer, OPENING, [SHELL]) == solve
    assert answer(oracle, tokenizer, OPENING, [SHELL]) == solve  # a retried call gets the same move
    # A call with tools under another system prompt (a memory extraction, a sub-agent) is a side call.
    side = [{"role": "system", "content": "Extract memories."}, *OPENING[1:]]
    assert answer(oracle, tokenizer, side, [SHELL]) == SIDE_TEXT
    assert answer(oracle, tokenizer, OPENING, []) == SIDE_TEXT  # so is a call without tools
    call = {"id": "call_1", "type": "function", "function": {"name": SHELL["name"], "arguments": {"command": COMMAND}}}
    done = [*OPENING, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": ""}]
    assert answer(oracle, tokenizer, done, [SHELL]) == FINISH_TEXT
    assert len(oracle.log.prompt_tokens) == 3 and len(oracle.log.side_prompt_tokens) == 2
    assert oracle.log.unanswered == 0


def test_shell_call_fills_the_schema_and_refuses_what_it_cannot() -> None:
    tool = {
        "name": "Bash",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
            "required": ["command", "description"],
        },
    }
    call = json.loads(shell_call(tool, "ls").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call == {"name": "Bash", "arguments": {"command": "ls", "description": "Run a shell command"}}
    with pytest.raises(DemonstrationError, match="takes none of"):
        shell_call({"name": "x", "parameters": {"properties": {"path": {"type": "string"}}}}, "ls")
    # Arguments the harness's moves give (OpenHands' risk level, an enum) are not filled in.
    risk = {"type": "string", "enum": ["UNKNOWN", "LOW"]}
    terminal = {"name": "terminal", "parameters": {"properties": {"command": {}, "security_risk": risk}}}
    terminal["parameters"]["required"] = ["command", "security_risk"]
    call = json.loads(shell_call(terminal, "ls", {"security_risk": "LOW"}).split("\n")[1])
    assert call["arguments"] == {"command": "ls", "security_risk": "LOW"}
    timeout = {"properties": {"cmd": {}, "timeout": {"type": "integer"}}, "required": ["timeout"]}
    with pytest.raises(DemonstrationError, match="requires 'timeout', not a string"):
        shell_call({"name": "x", "parameters": timeout}, "ls")
