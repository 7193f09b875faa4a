"""Admin-API sessions of a standalone `legorl proxy` expire when idle, over
real HTTP: a session whose engine call outlasts the idle time is not
expired; an expired one's key is refused with the reason, its trajectory is
answered once (marked expired) and then 410; one never fetched is reported
lost, in a WARNING and to the fetch, never dropped unsaid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from legorl_jax.cli import build_parser

from .scripted_engine import ScriptedEngine
from .test_proxy_cmd import legorl_proxy, wait_for_log

IDLE_S = 3.0
HI = [{"role": "user", "content": "hi"}]


def test_idle_admin_sessions_expire_and_their_trajectories_are_collected_or_reported_lost(
    _engine_server: tuple[ScriptedEngine, str], tokenizer: Any, tmp_path: Path
) -> None:
    engine, engine_url = _engine_server
    engine.reset()
    model_dir = tmp_path / "model"
    tokenizer.save_pretrained(model_dir)
    log = tmp_path / "proxy.log"
    args = ["--engine-url", engine_url, "--model", str(model_dir), "--admin-token", "t"]
    with legorl_proxy([*args, "--session-idle-timeout-s", str(IDLE_S)], log) as proc:
        url = wait_for_log(proc, log, r"Uvicorn running on (http://\S+)")[0].group(1)
        admin = {"authorization": "Bearer t"}

        def made(run: str) -> dict[str, Any]:
            reply = httpx.post(f"{url}/admin/sessions", json={"labels": {"run": run}}, headers=admin)
            assert reply.status_code == 201, reply.text
            return reply.json()

        def trajectory(key: str) -> httpx.Response:
            return httpx.get(f"{url}/admin/sessions/{key}/trajectory", headers=admin)

        collected, lost, slow = made("collected"), made("lost"), made("slow")
        client = openai.OpenAI(base_url=collected["urls"]["openai"], api_key=collected["key"], max_retries=0)
        client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
        # An engine call longer than the idle time: its session is busy, not idle, all along.
        engine.delay_s = IDLE_S + 1
        slow_client = openai.OpenAI(base_url=slow["urls"]["openai"], api_key=slow["key"], max_retries=0, timeout=30)
        slow_client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
        engine.delay_s = 0.0
        alive = trajectory(slow["key"])
        assert alive.status_code == 200 and len(alive.json()["calls"]) == 1 and "expired" not in alive.json()

        # The others went unused past the idle time: expired. The harness is told why.
        with pytest.raises(openai.AuthenticationError, match="expired after going idle"):
            client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
        first = trajectory(collected["key"])
        assert first.status_code == 200, first.text
        assert first.json()["expired"] is True and first.json()["labels"] == {"run": "collected"}
        assert len(first.json()["calls"]) == 1  # the call made before it expired is there
        again = trajectory(collected["key"])
        assert again.status_code == 410 and "fetched once already" in again.json()["error"]["message"]

        # Never fetched: kept as long again, then lost, and said so.
        wait_for_log(proc, log, r"not fetched within .* is lost")
        gone = httpx.delete(f"{url}/admin/sessions/{lost['key']}", headers=admin)
        assert gone.status_code == 410
        assert "is lost" in gone.json()["error"]["message"]
        assert "proxy.session_idle_timeout_s" in gone.json()["error"]["message"]
        assert httpx.get(f"{url}/health").json()["sessions"] == 1  # the slow one, read just now, lives
    text = log.read_text()
    assert "WARNING" in text and "{'run': 'collected'} expired after 3 s idle" in text
    assert all(session["key"] not in text for session in (collected, lost, slow))  # keys are secrets


def test_the_idle_time_is_a_positive_number_of_seconds() -> None:
    parse = build_parser().parse_args
    base = ["proxy", "--engine-url", "http://127.0.0.1:9", "--model", "m"]
    assert parse([*base, "--session-idle-timeout-s", "90"]).session_idle_timeout_s == 90.0
    with pytest.raises(SystemExit):
        parse([*base, "--session-idle-timeout-s", "0"])
