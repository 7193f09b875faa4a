"""scripts/bench_proxy.py runs end to end at a tiny size (servers in their own
processes, alternating proxy and direct phases, CPU and latency figures), and
the engine instrument answers the chat route a pass-through proxy calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .scripted_engine import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the whole benchmark script, engine and proxy processes included
def test_bench_runs_and_reports_every_figure() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench_proxy.py"),
            "--sessions",
            "2",
            "--turns",
            "3",
            "--min-calls",
            "12",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["sessions"] == 2 and row["calls"] == 12  # 2 sessions x 3 turns x 2 rounds
    for key in ("ours_p50_ms", "direct_p99_ms", "ours_added_p50_ms", "ours_calls_per_s", "ours_cpu_ms_per_call"):
        assert isinstance(row[key], float), key
    # Calls 2.. of each session render from the memo (the turn the call before sampled); every
    # session merges into one sequence.
    assert row["incremental_render_share"] == pytest.approx(2 / 3, abs=1e-3)
    assert row["merged_ratio_mean"] == pytest.approx(2 / 3, abs=1e-3)
    assert "litellm_p50_ms" not in row


def test_instrument_answers_chat_completions(
    _engine_server: tuple[ScriptedEngine, str], engine: ScriptedEngine
) -> None:
    _, url = _engine_server
    call: dict[str, Any] = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    engine.chat_message = {"role": "assistant", "content": "", "tool_calls": [call]}
    reply = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    choice = reply.json()["choices"][0]
    assert choice["message"]["tool_calls"] == [call] and choice["finish_reason"] == "tool_calls"
