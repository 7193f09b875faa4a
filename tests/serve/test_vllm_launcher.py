"""The vLLM launcher: its command line, and supervision (health wait, reload,
restart after a crash) run for real against a stand-in `vllm` executable."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from legorl_jax.config import EngineConfig
from legorl_jax.cli import build_parser
from rollout_server.backends.embedded import embedded_plan
from rollout_server.backends.launch import ManagedEngine, start_engine
from rollout_server.backends.supervisor import EngineStartError
from rollout_server.backends.vllm import EXTENSION_RELOAD_METHOD, WORKER_EXTENSION, VllmOptions, vllm_plan

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An executable named `vllm` that runs the test instrument with this interpreter."""
    exe = tmp_path_factory.mktemp("bin") / "vllm"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def _pairs(command: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(command, command[1:], strict=False) if a.startswith("--")}


def test_vllm_command_carries_the_flags_rl_needs(fake_vllm: str) -> None:
    config = EngineConfig(kind="vllm", port=8123, max_batch=48, max_context=8192, extra_args=["--enforce-eager"])
    plan = vllm_plan(config, "/models/qwen3", VllmOptions(executable=fake_vllm, served_model_name="policy"))
    assert plan.command[:3] == [fake_vllm, "serve", "/models/qwen3"]
    flags = _pairs(plan.command)
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--worker-extension-cls"] == WORKER_EXTENSION
    assert flags["--max-num-seqs"] == "48" and flags["--max-model-len"] == "8192" and flags["--port"] == "8123"
    assert flags["--served-model-name"] == "policy" and flags["--generation-config"] == "vllm"
    assert "--return-tokens-as-token-ids" in plan.command and plan.command[-1] == "--enforce-eager"
    assert plan.env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert plan.url == "http://127.0.0.1:8123" and plan.reload_method == EXTENSION_RELOAD_METHOD
    native = vllm_plan(config, "/m", VllmOptions(executable=fake_vllm, use_worker_extension=False))
    assert "--worker-extension-cls" not in native.command and native.reload_method == "reload_weights"


def test_missing_vllm_executable_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="not found on PATH"):
        vllm_plan(EngineConfig(kind="vllm"), "/m", VllmOptions(executable="no-such-vllm-binary"))


def _wait_for(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_launch_reload_and_restart_after_crash(fake_vllm: str, tiny_model_dir: Path, other_weights_dir: Path) -> None:
    config = EngineConfig(kind="vllm", port=0, max_batch=2, max_context=64)
    engine = start_engine(config, tiny_model_dir, VllmOptions(executable=fake_vllm), health_timeout=180, max_restarts=1)
    try:
        client = engine.sync_client(timeout=120)
        assert client.reload_method == EXTENSION_RELOAD_METHOD
        assert len(client.complete([5, 6, 7], max_tokens=2)[0].token_ids) == 2
        assert client.update_weights(str(other_weights_dir))["results"][0]["weight_version"] == 1

        supervisor = engine.supervisor
        assert supervisor is not None and supervisor.state == "healthy"
        first_pid = supervisor.pid
        assert first_pid is not None
        os.killpg(first_pid, signal.SIGKILL)  # the crash
        _wait_for(lambda: supervisor.restarts == 1 and supervisor.state == "healthy", 180)
        assert supervisor.pid != first_pid
        assert len(client.complete([5, 6, 7], max_tokens=2)[0].token_ids) == 2
    finally:
        engine.stop()
    assert engine.supervisor is not None and engine.supervisor.state == "stopped"
    assert not engine.sync_client().healthy()


def test_engine_that_cannot_start_reports_its_output(fake_vllm: str, tmp_path: Path) -> None:
    plan = vllm_plan(EngineConfig(kind="vllm", port=0), tmp_path / "no-model", VllmOptions(executable=fake_vllm))
    with pytest.raises(EngineStartError, match="no config.json"):
        ManagedEngine.launch(plan, health_timeout=120)


def test_external_engine_needs_a_url() -> None:
    with pytest.raises(ValueError, match="engine.url"):
        start_engine(EngineConfig(kind="external"))
    assert start_engine(EngineConfig(kind="external", url="http://h:1/")).url == "http://h:1"


def test_embedded_plan_is_a_valid_legorl_serve_command_line() -> None:
    plan = embedded_plan(EngineConfig(kind="embedded", port=8200, max_batch=6, max_context=512), "/m", "policy")
    assert plan.command[:4] == [sys.executable, "-m", "legorl_jax.cli", "serve"]
    args = build_parser().parse_args(plan.command[3:])
    assert (args.model, args.port, args.max_num_seqs, args.max_model_len) == ("/m", 8200, 6, 512)
    assert args.served_model_name == "policy" and args.return_tokens_as_token_ids
    assert plan.url == "http://127.0.0.1:8200" and plan.reload_method == "reload_weights"
