"""`legorl proxy` as a user runs it: a subprocess in front of the scripted
test engine, driven through its admin API and the openai SDK."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from legorl_jax.cli import build_parser
from legorl_jax.commands import proxy_cmd

from .scripted_engine import ScriptedEngine


def test_legorl_proxy_command(_engine_server: tuple[ScriptedEngine, str], tokenizer: Any, tmp_path: Path) -> None:
    engine, engine_url = _engine_server
    engine.reset()
    model_dir = tmp_path / "model"
    tokenizer.save_pretrained(model_dir)
    log = (tmp_path / "proxy.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "legorl_jax.cli", "proxy", "--engine-url", engine_url, "--model", str(model_dir),
         "--port", "0", "--set", "proxy.max_model_calls=1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = token = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            text = Path(log.name).read_text()
            found_url = re.search(r"Uvicorn running on (http://\S+)", text)
            found_token = re.search(r"admin token (\S+)", text)
            if found_url and found_token:
                url, token = found_url.group(1), found_token.group(1)
        assert url and token, Path(log.name).read_text()
        assert "context 4096" in Path(log.name).read_text()  # asked of the engine's /v1/models
        made = httpx.post(f"{url}/admin/sessions", json={"labels": {"run": "cli"}},
                          headers={"authorization": f"Bearer {token}"}).json()
        client = openai.OpenAI(base_url=made["urls"]["openai"], api_key=made["key"], max_retries=0)
        reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "ok"
        assert engine.log.bodies[0]["model"] == "scripted"  # the engine's own model id
        # The config's call cap (--set proxy.max_model_calls=1) is the session default.
        with pytest.raises(openai.BadRequestError) as capped:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "again"}])
        assert capped.value.body["code"] == "session_cap_exceeded"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_legorl_proxy_rejects_a_directory_without_tokenizer(tmp_path: Path) -> None:
    args = build_parser().parse_args(["proxy", "--engine-url", "http://127.0.0.1:9", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot use the tokenizer"):
        proxy_cmd.run(args)
