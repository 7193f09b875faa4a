"""Reading reward.txt / reward.json: numbers are rewards, anything else is named, never a silent 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_server.verifier import parse_reward


def write(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("text", "reward"), [("1\n", 1.0), ("0", 0.0), (" 0.25 \n", 0.25), ("-1e-1", -0.1)])
def test_reward_txt(tmp_path: Path, text: str, reward: float) -> None:
    assert parse_reward(write(tmp_path, "reward.txt", text)) == (reward, {"reward": reward})


def test_reward_json_with_metrics(tmp_path: Path) -> None:
    logs = write(tmp_path, "reward.json", '{"reward": 0.5, "passed": 3, "note": "x", "flag": true}')
    assert parse_reward(logs) == (0.5, {"reward": 0.5, "passed": 3.0})


def test_reward_json_single_value_and_precedence(tmp_path: Path) -> None:
    assert parse_reward(write(tmp_path, "reward.json", '{"accuracy": 0.75}'))[0] == 0.75
    write(tmp_path, "reward.txt", "0")
    assert parse_reward(tmp_path)[0] == 0.75  # reward.json wins when both exist


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("reward.txt", "PASS", "not a number"),
        ("reward.txt", "", "not a number"),
        ("reward.txt", "nan", "not a finite number"),
        ("reward.json", "", "not valid JSON"),
        ("reward.json", "[1]", "JSON object"),
        ("reward.json", '{"reward": "1"}', "not a finite number"),
        ("reward.json", '{"a": 1, "b": 0}', "no 'reward' key"),
    ],
)
def test_bad_reward_files(tmp_path: Path, name: str, text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_reward(write(tmp_path, name, text))


def test_no_reward_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither reward.txt nor reward.json"):
        parse_reward(tmp_path)
