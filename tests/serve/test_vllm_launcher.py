"""The vLLM launcher: its command line, the version check, and supervision
(health wait, restart after a crash on the weights last installed) run for
real against the vLLM stand-in (tests/serve/vllm_standin.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from legorl_jax.cli import build_parser
from legorl_jax.core.config import EngineConfig
from rollout_server.backends.embedded import embedded_plan
from rollout_server.backends.launch import ManagedEngine, start_engine
from rollout_server.backends.supervisor import EngineStartError
from rollout_server.backends.vllm import (
    CPU_KV_CACHE_BYTES,
    EXTENSION_DIR,
    SUPPORTED_VLLM,
    VllmOptions,
    VllmVersionError,
    check_vllm_version,
    find_vllm,
    vllm_plan,
    with_cpu_defaults,
)

REPO = Path(__file__).resolve().parents[2]


def _pairs(command: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(command, command[1:], strict=False) if a.startswith("--")}


def test_vllm_command_carries_the_flags_rl_needs(vllm_standin: str) -> None:
    config = EngineConfig(kind="vllm", port=8123, max_batch=48, max_context=8192, extra_args=["--enforce-eager"])
    plan = vllm_plan(config, "/models/qwen3", VllmOptions(executable=vllm_standin, served_model_name="policy"))
    assert plan.command[:3] == [vllm_standin, "serve", "/models/qwen3"]
    flags = _pairs(plan.command)
    assert flags["--logprobs-mode"] == "processed_logprobs"
    # The reload that keeps tied embeddings tied, importable by vLLM's workers.
    assert flags["--worker-extension-cls"] == "legorl_vllm_ext.LegorlWorkerExtension"
    assert plan.env["PYTHONPATH"].split(os.pathsep)[0] == str(EXTENSION_DIR)
    assert flags["--max-num-seqs"] == "48" and flags["--max-model-len"] == "8192" and flags["--port"] == "8123"
    assert flags["--served-model-name"] == "policy" and flags["--generation-config"] == "vllm"
    assert "--return-tokens-as-token-ids" in plan.command and plan.command[-1] == "--enforce-eager"
    assert plan.env["VLLM_SERVER_DEV_MODE"] == "1" and plan.url == "http://127.0.0.1:8123"
    # A restart serves newer weights under the same name and tokenizer.
    later = vllm_plan(config, "/models/qwen3", VllmOptions(executable=vllm_standin), weights_dir="/w/v7")
    assert later.command[2] == "/w/v7"
    assert _pairs(later.command)["--served-model-name"] == _pairs(later.command)["--tokenizer"] == "/models/qwen3"


def test_lora_serving_allows_adapters_at_runtime(vllm_standin: str) -> None:
    """With --enable-lora vLLM serves /v1/load_lora_adapter only under VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    options = VllmOptions(executable=vllm_standin)
    plain = vllm_plan(EngineConfig(kind="vllm", port=8123), "/m", options)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
    lora = EngineConfig(kind="vllm", port=8123, extra_args=["--enable-lora", "--max-lora-rank", "32"])
    assert vllm_plan(lora, "/m", options).env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_the_engine_options_become_vllm_flags(vllm_standin: str) -> None:
    options = VllmOptions(executable=vllm_standin)
    default = vllm_plan(EngineConfig(kind="vllm", port=8123), "/m", options).command
    assert "--enable-prefix-caching" in default
    assert not {"--dtype", "--kv-cache-dtype", "--kv-cache-memory-bytes"} & set(default)  # vLLM chooses
    config = EngineConfig(
        kind="vllm", port=8123, dtype="bfloat16", kv_cache_dtype="bfloat16", kv_cache_memory_bytes=2**30,
        enable_prefix_caching=False,
    )  # fmt: skip
    command = vllm_plan(config, "/m", options).command
    flags = _pairs(command)
    assert (flags["--dtype"], flags["--kv-cache-dtype"], flags["--kv-cache-memory-bytes"]) == (
        "bfloat16",
        "bfloat16",
        str(2**30),
    )
    assert "--no-enable-prefix-caching" in command and "--enable-prefix-caching" not in command
    # One value from two places would leave which one vLLM takes to argument order.
    twice = config.model_copy(update={"extra_args": ["--enable-prefix-caching"]})
    with pytest.raises(ValueError, match="extra_args sets --enable-prefix-caching"):
        vllm_plan(twice, "/m", options)
    with pytest.raises(ValueError, match="--dtype=float16"):
        vllm_plan(config.model_copy(update={"extra_args": ["--dtype=float16"]}), "/m", options)


@pytest.mark.parametrize("version", ["0.17.1", "0.33.0"])
def test_vllm_takes_the_mapped_flags(
    vllm_standin: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The stand-in parses `serve` with the flags and choices of that vLLM's arg_utils."""
    monkeypatch.setenv("STANDIN_VLLM_VERSION", version)
    config = EngineConfig(
        kind="vllm", port=0, max_batch=2, max_context=64, dtype="bfloat16", kv_cache_dtype="bfloat16",
        kv_cache_memory_bytes=2**28, enable_prefix_caching=False,
    )  # fmt: skip
    engine = start_engine(config, tiny_model_dir, VllmOptions(executable=vllm_standin), health_timeout=180)
    try:
        state = httpx.get(f"{engine.url}/standin/state").json()
    finally:
        engine.stop()
    assert state["options"] == {
        "dtype": "bfloat16",
        "kv_cache_dtype": "bfloat16",
        "kv_cache_memory_bytes": 2**28,
        "enable_prefix_caching": False,
    }


def test_each_plan_draws_its_own_seed_unless_one_is_configured(vllm_standin: str) -> None:
    config = EngineConfig(kind="vllm", port=8123)
    seeds = {_pairs(vllm_plan(config, "/m", VllmOptions(executable=vllm_standin)).command)["--seed"] for _ in range(8)}
    assert len(seeds) == 8
    pinned = vllm_plan(config, "/m", VllmOptions(executable=vllm_standin, seed=42))
    assert _pairs(pinned.command)["--seed"] == "42"


def test_missing_vllm_executable_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="vLLM not found.*scripts/setup.*LEGORL_VLLM"):
        vllm_plan(EngineConfig(kind="vllm"), "/m", VllmOptions(executable="no-such-vllm-binary"))
    with pytest.raises(VllmVersionError, match="vLLM not found"):
        check_vllm_version("no-such-vllm-binary")


def test_which_vllm_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$LEGORL_VLLM first, then `vllm` on PATH, then set-up's CPU build in the cache."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("LEGORL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEGORL_VLLM", raising=False)
    assert find_vllm() == str(tmp_path / "cache" / "vllm-venv" / "bin" / "vllm")
    on_path = tmp_path / "bin" / "vllm"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_vllm() == str(on_path) == VllmOptions().executable
    monkeypatch.setenv("LEGORL_VLLM", "/opt/vllm/bin/vllm")
    assert find_vllm() == "/opt/vllm/bin/vllm"


def test_the_cpu_build_gets_a_bounded_kv_pool() -> None:
    """On CPU vLLM would size its KV cache as 90% of the host's RAM."""
    config = EngineConfig(kind="vllm")
    cpu = with_cpu_defaults(config, Version("0.32.0+cpu"))
    assert cpu.kv_cache_memory_bytes == CPU_KV_CACHE_BYTES
    assert with_cpu_defaults(config, Version("0.32.0")).kv_cache_memory_bytes is None
    chosen = config.model_copy(update={"kv_cache_memory_bytes": 2**28})
    assert with_cpu_defaults(chosen, Version("0.32.0+cpu")).kv_cache_memory_bytes == 2**28


def test_pinned_range_is_the_vllm_extra() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = (Requirement(spec) for spec in extras["vllm"])
    assert requirement.name == "vllm" and requirement.specifier == SUPPORTED_VLLM


@pytest.mark.parametrize("version", ["0.11.0", "0.16.0", "0.34.0", "not-a-version"])
def test_a_vllm_outside_the_range_is_refused_before_launch(
    vllm_standin: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setenv("STANDIN_VLLM_VERSION", version)
    with pytest.raises(VllmVersionError, match="outside the supported range|without a version") as err:
        start_engine(EngineConfig(kind="vllm", port=0), tiny_model_dir, VllmOptions(executable=vllm_standin))
    assert version in str(err.value) or "without a version" in str(err.value)


@pytest.mark.parametrize("version", ["0.17.0", "0.17.1", "0.33.0"])
def test_a_vllm_inside_the_range_passes(vllm_standin: str, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setenv("STANDIN_VLLM_VERSION", version)
    assert str(check_vllm_version(vllm_standin)) == version


def _wait_for(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_crash_restart_serves_the_weights_last_installed(
    vllm_standin: str, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    config = EngineConfig(kind="vllm", port=0, max_batch=2, max_context=64)
    engine = start_engine(
        config, tiny_model_dir, VllmOptions(executable=vllm_standin), health_timeout=180, max_restarts=1
    )
    try:
        client = engine.sync_client(timeout=120)
        assert len(client.complete([5, 6, 7], max_tokens=2, ignore_eos=True)[0].token_ids) == 2
        client.update_weights(str(other_weights_dir), version="7")
        updated = httpx.get(f"{engine.url}/standin/state").json()
        assert updated["weights_path"] == str(other_weights_dir) == engine.installed()
        greedy = client.complete([5, 6, 7], max_tokens=4, temperature=0)[0].token_ids

        supervisor = engine.supervisor
        assert supervisor is not None and supervisor.state == "healthy" and engine.epoch() == 0
        first_pid = supervisor.pid
        assert first_pid is not None
        os.killpg(first_pid, signal.SIGKILL)  # the crash
        _wait_for(lambda: supervisor.restarts == 1 and supervisor.state == "healthy", 180)
        assert supervisor.pid != first_pid and engine.epoch() == 1
        # Back on the update, not the base model: the version reported is the version served.
        restarted = httpx.get(f"{engine.url}/standin/state").json()
        assert restarted["params"] == updated["params"] and restarted["weights_path"] == str(other_weights_dir)
        assert client.complete([5, 6, 7], max_tokens=4, temperature=0)[0].token_ids == greedy
        assert client.model() == str(tiny_model_dir)  # the same served name
        # Its tokens carry the label of the weights, as before the crash.
        assert restarted["weight_version"] == updated["weight_version"] == "7"

        # A planned restart (a reload that failed its probe) spends none of the crash budget.
        engine.restart("a test's planned restart")
        _wait_for(lambda: engine.epoch() == 2 and supervisor.state == "healthy", 180)
        assert supervisor.restarts == 1 and httpx.get(f"{engine.url}/standin/state").json()["weight_version"] == "7"
    finally:
        engine.stop()
    assert engine.supervisor is not None and engine.supervisor.state == "stopped"
    assert not engine.sync_client().healthy()


def test_engine_that_cannot_start_reports_its_output(vllm_standin: str, tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="no config.json"):
        start_engine(
            EngineConfig(kind="vllm", port=0),
            tmp_path / "no-model",
            VllmOptions(executable=vllm_standin),
            health_timeout=120,
        )


def test_external_engine_needs_a_url() -> None:
    with pytest.raises(ValueError, match="engine.url"):
        start_engine(EngineConfig(kind="external"))
    external = start_engine(EngineConfig(kind="external", url="http://h:1/"))
    assert isinstance(external, ManagedEngine) and external.url == "http://h:1" and external.client().watch is None


def test_embedded_plan_is_a_valid_legorl_serve_command_line() -> None:
    plan = embedded_plan(EngineConfig(kind="embedded", port=8200, max_batch=6, max_context=512), "/m", "policy")
    assert plan.command[:4] == [sys.executable, "-m", "legorl_jax.cli", "serve"]
    args = build_parser().parse_args(plan.command[3:])
    assert (args.model, args.port, args.max_num_seqs, args.max_model_len) == ("/m", 8200, 6, 512)
    assert args.served_model_name == "policy" and args.return_tokens_as_token_ids
    assert plan.url == "http://127.0.0.1:8200"
    later = embedded_plan(EngineConfig(kind="embedded", port=8200), "/m", "/m", weights_dir="/w/v3")
    assert build_parser().parse_args(later.command[3:]).model == "/w/v3"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, waiting to be reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_an_engine_does_not_outlive_the_process_that_started_it() -> None:
    """The supervisor starts engines through die_with_parent.py; a SIGKILL of the parent
    (which runs no clean-up) still takes the engine down."""
    import subprocess

    from rollout_server.backends import supervisor

    parent_code = (
        "import os, subprocess, sys, time\n"
        f"guard = {supervisor._DIE_WITH_PARENT!r}\n"
        "child = subprocess.Popen([sys.executable, guard, str(os.getpid()), 'sleep', '300'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        engine = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while open(f"/proc/{engine}/cmdline").read().split("\0")[0] != "sleep":  # exec'd into the command
            assert time.monotonic() < deadline
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not _gone(engine):
            assert time.monotonic() < deadline, "the engine outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
