"""The lego harness's pure parts: the configuration space, observations, context views, tool parsing."""

from __future__ import annotations

import random

import pytest

from rollout_server.harnesses import HarnessConfigError, get_harness
from rollout_server.harnesses.lego import LegoOptions, axes, config_id, sample_configs, space_size
from rollout_server.harnesses.lego.context import head_length, restart_from_summary, window
from rollout_server.harnesses.lego.observation import format_observation, head_tail
from rollout_server.harnesses.lego.tools import (
    CommandArgs,
    ToolError,
    number_lines,
    parse_arguments,
    replace_once,
    tool_schemas,
)
from rollout_server.sandbox.base import ExecResult


def test_space_has_at_least_five_axes_of_three_options() -> None:
    space = axes()
    assert len(space) >= 5 and all(len(options) >= 3 for options in space.values())
    for axis, options in space.items():
        for option in options:
            LegoOptions(**{axis: option})  # every declared option validates
    assert space_size() == 3**5


@pytest.mark.parametrize("k", [3, 5, 9, 40])
def test_sample_configs_cover_every_option_and_are_distinct(k: int) -> None:
    configs = sample_configs(k, random.Random(k))
    assert len({config_id(c) for c in configs}) == k
    for axis, options in axes().items():
        assert {getattr(c, axis) for c in configs} == set(options)


def test_sample_configs_are_reproducible_and_keep_base_knobs() -> None:
    base = LegoOptions(stream=True, tool_timeout_s=5)
    first = sample_configs(6, random.Random(7), base)
    assert first == sample_configs(6, random.Random(7), base)
    assert all(c.stream and c.tool_timeout_s == 5 for c in first)


def test_sample_configs_can_enumerate_the_whole_space() -> None:
    everything = sample_configs(space_size(), random.Random(0))
    assert len({config_id(c) for c in everything}) == space_size()


@pytest.mark.parametrize("k", [0, space_size() + 1])
def test_sample_configs_rejects_impossible_k(k: int) -> None:
    with pytest.raises(HarnessConfigError, match="k must be in"):
        sample_configs(k, random.Random(0))


def test_config_id_is_readable_stable_and_marks_changed_knobs() -> None:
    options = LegoOptions(tools="minimal", context="summarize")
    assert config_id(options) == "minimal.guided.summarize.truncated.medium"
    assert config_id(LegoOptions.model_validate(options.model_dump())) == config_id(options)
    streamed = config_id(options.model_copy(update={"stream": True}))
    assert streamed.startswith("minimal.guided.summarize.truncated.medium~") and streamed != config_id(options)
    assert get_harness("lego").config_id(options) == "lego." + config_id(options)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tools": "everything"}, "tools"),
        ({"turn_budget": 7}, "turn_budget"),
        ({"color": "blue"}, "color"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_options_name_the_problem(raw: object, message: str) -> None:
    with pytest.raises(HarnessConfigError, match=message):
        get_harness("lego").parse_options(raw)  # type: ignore[arg-type]


def test_options_accept_json_text_as_in_the_proto() -> None:
    options = get_harness("lego").parse_options('{"tools": "bash_only", "turn_budget": "long"}')
    assert isinstance(options, LegoOptions) and options.max_turns == 24


def test_observation_styles() -> None:
    result = ExecResult(exit_code=2, stdout="out\n" * 1000, stderr="boom")
    raw = format_observation("raw", result, truncate_chars=200, max_chars=1000)
    assert raw.startswith("out\nout") and "cut at 1000" in raw
    truncated = format_observation("truncated", result, truncate_chars=200, max_chars=10_000)
    assert len(truncated) < 300 and truncated.endswith("boom") and "omitted" in truncated
    structured = format_observation("structured", result, truncate_chars=200, max_chars=10_000)
    assert structured.startswith("exit_code: 2\n<stdout>\n") and "<stderr>\nboom\n</stderr>" in structured
    empty = ExecResult(exit_code=0, stdout="", stderr="")
    assert format_observation("raw", empty, truncate_chars=200, max_chars=1000) == "(no output)"
    with pytest.raises(ValueError, match="unknown observation style"):
        format_observation("poetry", empty, truncate_chars=200, max_chars=1000)


def test_head_tail_keeps_both_ends() -> None:
    text = "A" * 50 + "B" * 50
    cut = head_tail(text, 20)
    assert cut.startswith("A" * 10) and cut.endswith("B" * 10) and "80 characters omitted" in cut
    assert head_tail("short", 20) == "short"


def _turn(i: int) -> list[dict[str, object]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": str(i)},
    ]


def test_window_cuts_at_turn_boundaries() -> None:
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    history = head + [m for i in range(5) for m in _turn(i)]
    assert head_length(history) == 2
    view = window(history, 2)
    assert view[:2] == head and "3 earlier turns" in view[2]["content"]
    assert view[3:] == _turn(3) + _turn(4)
    assert window(history, 5) == history
    summary = restart_from_summary(history, "did things")
    assert summary[:2] == head and summary[2]["content"].endswith("did things") and len(summary) == 3


def test_number_lines_and_ranges() -> None:
    text = "a\nb\nc\n"
    assert number_lines(text, None, None) == "     1\ta\n     2\tb\n     3\tc"
    assert number_lines(text, 2, 2) == "     2\tb"
    assert number_lines(text, 3, 99) == "     3\tc"
    assert number_lines("", None, None) == "(empty file)"
    for start, end in [(4, None), (3, 2)]:
        with pytest.raises(ToolError, match="outside the file"):
            number_lines(text, start, end)


def test_replace_once_requires_a_unique_match() -> None:
    assert replace_once("x = 1\ny = 2\n", "y = 2", "y = 3") == "x = 1\ny = 3\n"
    with pytest.raises(ToolError, match="not found"):
        replace_once("abc", "z", "y")
    with pytest.raises(ToolError, match="occurs 2 times"):
        replace_once("aa", "a", "b")


def test_tool_schemas_and_argument_parsing() -> None:
    schemas = tool_schemas("edit_tools")
    by_name = {s["function"]["name"]: s["function"] for s in schemas}
    assert by_name["str_replace"]["parameters"]["required"] == ["path", "old", "new"]
    assert by_name["bash"]["parameters"]["additionalProperties"] is False
    assert parse_arguments("minimal", "run", '{"command": "ls"}') == CommandArgs(command="ls")
    with pytest.raises(ToolError, match="unknown tool 'bash'"):
        parse_arguments("minimal", "bash", '{"command": "ls"}')
    with pytest.raises(ToolError, match="must be a JSON object"):
        parse_arguments("minimal", "run", '["ls"]')
    with pytest.raises(ToolError, match="command"):
        parse_arguments("minimal", "run", '{"command": ""}')
