"""Demonstrations recorded through the real CLIs: unmodified harnesses in Docker sandboxes, the real
proxy and trial runner, the verifier's grade, with the scripted oracle as the engine."""

from __future__ import annotations

import asyncio
import os
from itertools import groupby
from typing import Any

import docker
import pytest
from rollout.stack import trial_containers

from legorl_jax.core.config import cache_root
from legorl_jax.demo.cli_demonstrations import (
    CLI_MOVES,
    FINISH_TEXT,
    RECORD_CONCURRENCY,
    CliEpisode,
    CliRecorder,
    offered_tools,
    record_cli_demonstrations,
    shell_call,
)
from legorl_jax.demo.demonstrations import solution_command
from rollout_server.demo_families import generated_tasks
from rollout_server.tasks import Task

pytestmark = [pytest.mark.docker, pytest.mark.npm, pytest.mark.slow]

# Every CLI harness: the four the CLI demo mixes first.
HARNESSES = ("mini-swe-agent", "opencode", "codex", "claude-code", "gemini-cli", "qwen-code", "openhands")
HEADER = "<|im_start|>assistant\n"
IM_END = "<|im_end|>"


def _installed() -> None:
    for path in (cache_root() / name for name in ("harness-cli", "mini-venv", "openhands-venv")):
        if not path.is_dir():
            reason = f"no host install at {path} (run scripts/setup)"
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(f"CI=true and this test needs {reason}", pytrace=False)
            pytest.skip(reason)


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    """A generated demo task (they ask for the memory every CLI starts in)."""
    root = tmp_path_factory.mktemp("tasks")
    (generated,) = generated_tasks("train", ["add-setting"], train_per_family=1, eval_per_family=0, cache_root=root)
    return generated


@pytest.fixture(scope="module")
def episodes(request: pytest.FixtureRequest, tokenizer: Any, task: Task) -> dict[str, CliEpisode]:
    """One working-plan episode per CLI whose test is selected (`-k qwen-code` records Qwen Code's
    alone), recorded by one recorder (one proxy, one sandbox network), several at once."""
    _installed()
    selected = [h for h in HARNESSES if any(f"[{h}]" in item.nodeid for item in request.session.items)]

    async def main() -> dict[str, CliEpisode]:
        async with CliRecorder.running(tokenizer, max_context=131072) as recorder:
            recorded = await recorder.record([(task, h, "direct") for h in selected], RECORD_CONCURRENCY)
            return {e.harness: e for e in recorded}

    return asyncio.run(main())


def masked_spans(mask: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, end) of every run of loss tokens."""
    runs = [list(run) for bit, run in groupby(range(len(mask)), key=mask.__getitem__) if bit]
    return [(run[0], run[-1] + 1) for run in runs]


@pytest.mark.parametrize("harness", HARNESSES)
def test_working_plan_through_the_cli_is_graded_1(
    episodes: dict[str, CliEpisode], task: Task, tokenizer: Any, harness: str
) -> None:
    episode = episodes[harness]
    assert episode.status == "TRIAL_STATUS_OK" and episode.reward == 1.0, episode.problems
    demo = episode.demonstration
    assert demo is not None and demo.reward == 1.0 and demo.plan == "direct"
    # The task's sequence: the whole episode merged, the oracle's two answers its only loss tokens.
    ((ids, mask),) = [seq for seq in demo.sequences if offered_tools(tokenizer.decode(list(seq[0])))]
    sampled = episode.calls.sampled
    assert len(sampled) == 2 and episode.model_calls == 2 + episode.side_calls
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [t for answer in sampled for t in answer]
    spans = masked_spans(mask)
    assert len(spans) == 2
    for a, b in spans:
        assert tokenizer.decode(list(ids[:a])).endswith(HEADER)  # each loss span opens an assistant turn
        assert tokenizer.decode(list(ids[b - 1 : b])) == IM_END
    # The first answer calls the shell tool the request offered, with the task's solution.
    moves = CLI_MOVES[harness]
    shell = offered_tools(tokenizer.decode(list(ids)))[moves.shell]
    solve = tokenizer.decode(list(ids[spans[0][0] : spans[0][1] - 1]))
    assert solve == shell_call(shell, solution_command(task), moves.arguments)
    finish = tokenizer.decode(list(ids[spans[1][0] : spans[1][1] - 1]))
    last = moves.finish_command
    assert finish == (FINISH_TEXT if last is None else shell_call(shell, last, moves.arguments))
    # A side call (OpenCode's title) is a sequence of its own, never inside the task's.
    assert episode.side_calls == (1 if harness == "opencode" else 0)
    assert len(demo.sequences) == 1 + episode.side_calls


def test_no_trial_container_is_left(episodes: dict[str, CliEpisode]) -> None:
    assert trial_containers(docker.from_env()) == []


def test_concurrent_recording_gives_the_sequential_episodes(tokenizer: Any, task: Task) -> None:
    """All four episodes at once come back in order, each with the token ids and grade of the
    one-at-a-time recording. Two CLIs whose episodes are the same in any two recordings: OpenCode's
    describe episode may exit before its title call, Codex, Gemini CLI, Qwen Code and OpenHands write
    an id or the time into their prompts (docs/benchmarks.md)."""
    _installed()
    pair = ("mini-swe-agent", "claude-code")

    def recorded(concurrency: int) -> list[tuple[Any, ...]]:
        episodes = record_cli_demonstrations(tokenizer, [task], pair, concurrency=concurrency)
        return [(e.harness, e.plan, e.reward, e.demonstration and e.demonstration.sequences) for e in episodes]

    sequential = recorded(1)
    assert [(h, p) for h, p, *_ in sequential] == [(h, p) for h in pair for p in ("direct", "describe")]
    assert all(sequences for *_, sequences in sequential)  # every episode kept, its tokens compared
    assert recorded(4) == sequential
