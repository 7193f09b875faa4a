"""`legorl proxy` as a user runs it: a subprocess in front of the scripted
test engine, driven through its admin API and the openai SDK; started before
its engine, it waits for it."""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from legorl_jax.cli import build_parser
from legorl_jax.commands import proxy_cmd
from legorl_jax.models.tokenizer import load_chat_template

from .chat_formats import BASH, CHATML_NO_TOOLS_TEMPLATE, with_template
from .scripted_engine import ScriptedEngine, ServerThread


@contextmanager
def legorl(command: str, args: list[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`legorl COMMAND --port 0 ARGS` with its output in `log_path`, terminated on exit."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "legorl_jax.cli", command, "--port", "0", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def legorl_proxy(args: list[str], log_path: Path) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """`legorl proxy --port 0 ARGS` (see `legorl`)."""
    return legorl("proxy", args, log_path)


def wait_for_log(proc: subprocess.Popen[bytes], log_path: Path, *patterns: str) -> list[re.Match[str]]:
    """The first match of each pattern in the command's output, once all are there (120 s at most)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text()
        found = [re.search(p, text) for p in patterns]
        if all(found):
            return found  # type: ignore[return-value]
        time.sleep(0.2)
    raise AssertionError(f"{patterns} not in the output:\n{log_path.read_text()}")


def test_legorl_proxy_command(_engine_server: tuple[ScriptedEngine, str], tokenizer: Any, tmp_path: Path) -> None:
    engine, engine_url = _engine_server
    engine.reset()
    model_dir = tmp_path / "model"
    tokenizer.save_pretrained(model_dir)
    log = tmp_path / "proxy.log"
    with legorl_proxy(
        ["--engine-url", engine_url, "--model", str(model_dir), "--set", "proxy.max_model_calls=1"], log
    ) as proc:
        found_url, found_token = wait_for_log(proc, log, r"Uvicorn running on (http://\S+)", r"admin token (\S+)")
        url, token = found_url.group(1), found_token.group(1)
        assert "context 4096" in log.read_text()  # asked of the engine's /v1/models
        made = httpx.post(
            f"{url}/admin/sessions", json={"labels": {"run": "cli"}}, headers={"authorization": f"Bearer {token}"}
        ).json()
        # An engine whose card names no `legorl` owner is taken for vLLM: prompt logprobs at temperature 1 only.
        recompute = {"recompute_logprobs": True, "sampling": {"temperature": 0.5}}
        refused = httpx.post(f"{url}/admin/sessions", json=recompute, headers={"authorization": f"Bearer {token}"})
        assert refused.status_code == 400 and "temperature 1" in refused.text
        client = openai.OpenAI(base_url=made["urls"]["openai"], api_key=made["key"], max_retries=0)
        reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "ok"
        assert engine.log.bodies[0]["model"] == "scripted"  # the engine's own model id
        # The config's call cap (--set proxy.max_model_calls=1) is the session default.
        with pytest.raises(openai.BadRequestError) as capped:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "again"}])
        assert capped.value.body["code"] == "session_cap_exceeded"


def test_legorl_proxy_rejects_a_directory_without_tokenizer(tmp_path: Path) -> None:
    args = build_parser().parse_args(["proxy", "--engine-url", "http://127.0.0.1:9", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot use the tokenizer"):
        proxy_cmd.run(args)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_legorl_proxy_waits_for_an_engine_that_starts_late(tokenizer: Any, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Started before its engine, as a deployment starts them, the proxy
    waits, saying so, then serves with the engine's context rather than a
    config default; its --chat-template replaces the model's own, which
    renders no tools."""
    model_dir = with_template(tokenizer_dir, CHATML_NO_TOOLS_TEMPLATE, tmp_path / "model")
    template_file = tmp_path / "tools.jinja"
    template_file.write_text(load_chat_template(), encoding="utf-8")
    port = _free_port()
    engine = ScriptedEngine(tokenizer, max_model_len=98_304)
    log = tmp_path / "proxy.log"
    args = [
        "--engine-url",
        f"http://127.0.0.1:{port}",
        "--model",
        str(model_dir),
        "--chat-template",
        str(template_file),
        "--admin-token",
        "t",
    ]
    with legorl_proxy(args, log) as proc:
        wait_for_log(proc, log, r"waiting for the engine at http://127\.0\.0\.1:\d+ \(\d+ of 120 s")
        with ServerThread(engine.app, port=port):
            (found,) = wait_for_log(proc, log, r"Uvicorn running on (http://\S+)")
            assert "context 98304" in log.read_text()
            made = httpx.post(f"{found.group(1)}/admin/sessions", json={}, headers={"authorization": "Bearer t"}).json()
            client = openai.OpenAI(base_url=made["urls"]["openai"], api_key=made["key"], max_retries=0)
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], tools=[BASH]
            )
            assert reply.choices[0].message.content == "ok"
    assert "<tools>" in tokenizer.decode(engine.log.prompts[0])
    assert "renders no tools" not in log.read_text()


def test_engine_wait_is_bounded_and_ends_with_a_clear_error(
    tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(
        [
            "proxy",
            "--engine-url",
            f"http://127.0.0.1:{_free_port()}",
            "--model",
            str(tokenizer_dir),
            "--engine-wait-s",
            "1.5",
        ]
    )
    with pytest.raises(SystemExit, match=r"did not answer \S+/v1/models within 1.5 s .*--engine-wait-s"):
        proxy_cmd.run(args)
    assert "waiting for the engine" in capsys.readouterr().err


def test_engine_without_a_context_length_is_an_error(tokenizer: Any, tokenizer_dir: Path) -> None:
    with ServerThread(ScriptedEngine(tokenizer, max_model_len=None).app) as engine_server:
        args = build_parser().parse_args(["proxy", "--engine-url", engine_server.url, "--model", str(tokenizer_dir)])
        with pytest.raises(SystemExit, match="no usable context length .*--max-context"):
            proxy_cmd.run(args)


def test_explicit_context_and_model_id_skip_the_engine_wait(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: dict[str, Any] = {}
    monkeypatch.setattr("legorl_jax.serve.drain.serve", lambda app, **_: served.update(app=app))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the test process's objects stay collectable
    args = build_parser().parse_args(
        [
            "proxy",
            "--engine-url",
            f"http://127.0.0.1:{_free_port()}",
            "--model",
            str(tokenizer_dir),
            "--max-context",
            "98304",
            "--served-model-name",
            "m",
            "--engine-wait-s",
            "600",
        ]
    )
    assert proxy_cmd.run(args) == 0
    core = served["app"].core
    assert core.max_context == 98_304 and core.engine.model == "m"
    with pytest.raises(SystemExit):  # argparse: a context length is an integer > 1
        build_parser().parse_args(["proxy", "--engine-url", "u", "--model", "d", "--max-context", "1"])
