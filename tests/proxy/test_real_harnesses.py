"""Real harness CLIs, offline, against the proxy in front of the scripted
engine (each with its harness module's launch settings): each completes a two-tool-call
task, and the whole episode merges into one captured token sequence.

The CLIs come from PATH (`npm install -g` and `pip install`, as the harness
install specs do) or from the directories in LEGORL_HARNESS_BIN (a PATH-style
list). Missing, they skip locally and fail under CI=true, as the `npm`
marker does for node itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from process_report import failure_report

from .scripted_engine import ScriptedEngine
from .test_openai_chat import call_text

TASK = "Write hi into out.txt, then show it."


def cli(name: str) -> str:
    extra = os.environ.get("LEGORL_HARNESS_BIN")
    found = shutil.which(name, path=extra) if extra else None
    found = found or shutil.which(name)
    if found is None:
        reason = f"{name} CLI not installed (see the harness install specs; or set LEGORL_HARNESS_BIN)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and this test needs {reason}", pytrace=False)
        pytest.skip(reason)
    return found


def claude_code(binary: str, url: str, key: str, home: Path) -> tuple[list[str], dict[str, str]]:
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",
    }
    return [
        binary,
        "-p",
        TASK,
        "--output-format",
        "stream-json",
        "--verbose",
        "--dangerously-skip-permissions",
        "--model",
        "policy",
    ], env


def codex(binary: str, url: str, key: str, home: Path) -> tuple[list[str], dict[str, str]]:
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(
        'model = "policy"\nmodel_provider = "legorl"\n[model_providers.legorl]\nname = "legorl"\n'
        f'base_url = "{url}/v1"\nenv_key = "LEGORL_KEY"\nwire_api = "responses"\n[analytics]\nenabled = false\n'
    )
    return (
        [binary, "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK],
        {"CODEX_HOME": str(home / ".codex"), "LEGORL_KEY": key},
    )


def gemini_cli(binary: str, url: str, key: str, home: Path) -> tuple[list[str], dict[str, str]]:
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(
        json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}})
    )
    return (
        [binary, "-m", "policy", "-p", TASK, "--yolo", "--output-format", "json"],
        {"GOOGLE_GEMINI_BASE_URL": url, "GEMINI_API_KEY": key, "GEMINI_CLI_TRUST_WORKSPACE": "true"},
    )


def qwen_code(binary: str, url: str, key: str, home: Path) -> tuple[list[str], dict[str, str]]:
    (home / ".qwen").mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps({"security": {"auth": {"selectedType": "openai"}}}))
    return (
        [binary, "-p", TASK, "--yolo", "--output-format", "json"],
        {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key, "OPENAI_MODEL": "policy"},
    )


def mini_swe_agent(binary: str, url: str, key: str, home: Path) -> tuple[list[str], dict[str, str]]:
    return (
        [
            binary,
            "-m",
            "openai/policy",
            "-y",
            "--exit-immediately",
            "-c",
            "mini.yaml",
            "-c",
            f"model.model_kwargs.api_base={url}/v1",
            "-t",
            TASK,
        ],
        {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "OPENAI_API_KEY": key,
        },
    )


def opencode(provider: str) -> Any:
    def launch(binary: str, url: str, key: str, home: Path) -> tuple[list[str], dict[str, str]]:
        config = {
            "provider": {
                "legorl": {
                    "npm": provider,
                    "name": "legorl",
                    "options": {"baseURL": f"{url}/v1", "apiKey": key},
                    "models": {"policy": {"name": "policy", "tool_call": True}},
                }
            },
            "model": "legorl/policy",
            "small_model": "legorl/policy",
        }
        (home.parent / "work" / "opencode.json").write_text(json.dumps(config))
        env = {f"OPENCODE_DISABLE_{what}": "1" for what in ("MODELS_FETCH", "AUTOUPDATE", "SHARE", "LSP_DOWNLOAD")}
        return [binary, "run", *TASK.split()], env

    return launch


# name -> (binary, launcher, the shell tool and its arguments for a command)
HARNESSES: dict[str, tuple[str, Any, str, Any]] = {
    "claude-code": ("claude", claude_code, "Bash", lambda cmd: {"command": cmd, "description": "run"}),
    "codex": ("codex", codex, "exec_command", lambda cmd: {"cmd": cmd}),
    "gemini-cli": ("gemini", gemini_cli, "run_shell_command", lambda cmd: {"command": cmd}),
    "mini-swe-agent": ("mini", mini_swe_agent, "bash", lambda cmd: {"command": cmd}),
    "qwen-code": ("qwen", qwen_code, "run_shell_command", lambda cmd: {"command": cmd}),
    "opencode-chat": (
        "opencode",
        opencode("@ai-sdk/openai-compatible"),
        "bash",
        lambda cmd: {"command": cmd, "description": "run"},
    ),
    "opencode-responses": (
        "opencode",
        opencode("@ai-sdk/openai"),
        "bash",
        lambda cmd: {"command": cmd, "description": "run"},
    ),
}


def title_call(prompt: str) -> str | None:
    """OpenCode asks for a title alongside the first real call."""
    return "Writing hi" if "Generate a title for this conversation" in prompt else None


def run_cli_session(proxy: Any, engine: ScriptedEngine, root: Path, name: str) -> tuple[str, Path]:
    """Runs the CLI `name` through a new session of `proxy` on the two-tool-call task, the scripted engine
    answering; returns the session's key and the CLI's working directory."""
    binary_name, launch, tool, args = HARNESSES[name]
    binary = cli(binary_name)
    session = proxy.new_session()
    engine.respond = title_call
    # mini-swe-agent ends only on its submit command; the others on a plain answer.
    last = (
        call_text(tool, args("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")) if name == "mini-swe-agent" else "All done."
    )
    engine.push(call_text(tool, args("echo hi > out.txt")), call_text(tool, args("cat out.txt")), last)
    work, home = root / "work", root / "home"
    work.mkdir()
    home.mkdir()
    argv, env = launch(binary, f"{proxy.url}/s/{session['key']}", session["key"], home)
    done = subprocess.run(
        argv,
        cwd=work,
        env={"PATH": os.environ["PATH"], "HOME": str(home), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, failure_report(done)
    return session["key"], work


@pytest.mark.npm
@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_real_cli_two_tool_calls_one_sequence(
    proxy: Any, engine: ScriptedEngine, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proxy.core, "max_context", 65536)  # real system prompts run to ~25k tokens
    key, work = run_cli_session(proxy, engine, tmp_path, name)
    assert (work / "out.txt").read_text() == "hi\n"
    traj = proxy.trajectory(key)
    main = [c for c in traj["calls"] if not c["side"]]
    assert [c["merged"] for c in main] == [False, True, True], json.dumps(traj["metrics"])
    assert [c["tool_calls"] for c in main] == [1, 1, 1 if name == "mini-swe-agent" else 0]
    # Side calls (OpenCode's title) are their own flagged sequences; every
    # token the engine sampled for the task is captured once, with its logprob.
    (sequence,) = [s for s in traj["sequences"] if not s["side"]]
    sides = [s for s in traj["sequences"] if s["side"]]
    assert all(s["root_reason"] == "side_call" for s in sides) and len(sides) == (1 if "opencode" in name else 0)
    task_replies = [
        r
        for r, c in zip(engine.log.replies, engine.log.prompts, strict=False)
        if "Generate a title" not in engine.tokenizer.decode(c)
    ]
    sampled = [
        (t, lp)
        for t, m, lp in zip(sequence["token_ids"], sequence["loss_mask"], sequence["behavior_logprobs"], strict=True)
        if m
    ]
    assert sampled == [(t, lp) for r in task_replies for t, lp in zip(r["token_ids"], r["logprobs"], strict=True)]
