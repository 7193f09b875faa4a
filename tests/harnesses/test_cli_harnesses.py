"""Launch specs of the real harness CLIs carry the settings each CLI needs to run offline against the proxy."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.harnesses import (
    CliHarness,
    HarnessConfigError,
    HarnessContext,
    LaunchSpec,
    UnknownHarnessError,
    get_harness,
    harness_names,
)
from rollout_server.harnesses.base import stdin_from
from rollout_server.sandbox.local import LocalSandbox
from rollout_server.tasks import DEMO_TASKS_DIR, load_task
from rollout_server.trial import TrialSpec, _sandbox_spec

CTX = HarnessContext(
    session_url="http://172.30.0.1:8080/s/key-123/",
    api_key="key-123",
    model="policy-v3",
    instruction="Fix the failing test.\nThen run it.",
    workdir="/app",
    home="/home/agent",
)
BASE = "http://172.30.0.1:8080/s/key-123"
CLI_NAMES = ["claude-code", "codex", "gemini-cli", "mini-swe-agent", "opencode", "openhands", "qwen-code"]


def spec(name: str, **options: object) -> LaunchSpec:
    harness = get_harness(name)
    assert isinstance(harness, CliHarness)
    return harness.launch_spec(CTX, harness.parse_options(options))


def file_at(launch: LaunchSpec, path: str) -> str:
    matches = [f for f in launch.files if f.path == path]
    assert len(matches) == 1, [f.path for f in launch.files]
    assert matches[0].mode == 0o600
    return matches[0].content


def test_registry_lists_every_harness_and_names_them_on_error() -> None:
    assert set(CLI_NAMES) | {"lego"} <= set(harness_names())
    with pytest.raises(UnknownHarnessError, match="registered: claude-code, codex"):
        get_harness("cursor")


def test_claude_code() -> None:
    launch = spec("claude-code", max_turns=30)
    assert launch.dialect == "anthropic" and launch.workdir == "/app"
    assert launch.argv[:3] == ("claude", "-p", CTX.instruction)
    for flag in ("--verbose", "--dangerously-skip-permissions"):
        assert flag in launch.argv
    args = list(launch.argv)
    assert args[args.index("--output-format") + 1] == "stream-json"
    assert args[args.index("--model") + 1] == "policy-v3"
    assert args[args.index("--max-turns") + 1] == "30"
    env = launch.env
    assert env["ANTHROPIC_BASE_URL"] == BASE  # no /v1: the SDK adds it
    assert env["ANTHROPIC_API_KEY"] == "key-123"
    for name in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER", "IS_SANDBOX"):
        assert env[name] == "1"
    assert env["CLAUDE_CODE_DISABLE_THINKING"] == "1"
    assert "CLAUDE_CODE_DISABLE_THINKING" not in spec("claude-code", disable_thinking=False).env


def test_claude_code_rejects_model_names_with_a_slash() -> None:
    harness = get_harness("claude-code")
    ctx = HarnessContext(session_url=BASE, api_key="k", model="Qwen/Qwen3-0.6B", instruction="x")
    with pytest.raises(HarnessConfigError, match="must not contain '/'"):
        harness.launch_spec(ctx, harness.parse_options({}))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("wire", "package"),
    [
        ("openai_chat", "@ai-sdk/openai-compatible"),
        ("openai_responses", "@ai-sdk/openai"),
        ("anthropic", "@ai-sdk/anthropic"),
    ],
)
def test_opencode_config_file_selects_the_wire(wire: str, package: str) -> None:
    launch = spec("opencode", wire=wire)
    assert launch.dialect == wire
    config = json.loads(file_at(launch, "/app/opencode.json"))
    provider = config["provider"]["legorl"]
    assert provider["npm"] == package
    assert provider["options"] == {"baseURL": f"{BASE}/v1", "apiKey": "key-123"}
    assert provider["models"]["policy-v3"]["tool_call"] is True
    assert config["model"] == config["small_model"] == "legorl/policy-v3"
    for name in ("MODELS_FETCH", "AUTOUPDATE", "SHARE", "LSP_DOWNLOAD"):
        assert launch.env[f"OPENCODE_DISABLE_{name}"] == "1"


def test_opencode_prompt_travels_as_words_or_stdin() -> None:
    words = spec("opencode")
    assert words.argv == ("opencode", "run", "Fix", "the", "failing", "test.", "Then", "run", "it.")
    piped = spec("opencode", prompt_via="stdin")
    assert file_at(piped, "/home/agent/.legorl/instruction.md") == CTX.instruction
    assert piped.argv == stdin_from("/home/agent/.legorl/instruction.md", ("opencode", "run"))


def test_stdin_from_redirects_in_a_real_shell(sandbox: LocalSandbox, tmp_path: Path) -> None:
    text = "line one\n$HOME `id` 'quoted' \"double\"\n"
    (tmp_path / "in.txt").write_text(text)
    sandbox.copy_in(tmp_path / "in.txt", "/app/odd name $x.txt")
    result = sandbox.exec(list(stdin_from("odd name $x.txt", ("cat", "-"))), timeout=10, workdir="/app")
    assert result.ok and result.stdout == text


def test_codex_config_toml() -> None:
    launch = spec("codex")
    assert launch.dialect == "openai_responses"
    # The observed `codex exec ... "<task>" </dev/null`.
    assert launch.argv == stdin_from(
        "/dev/null",
        (
            "codex",
            "exec",
            "--json",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            CTX.instruction,
        ),
    )
    assert launch.env["CODEX_HOME"] == "/home/agent/.codex"
    config = tomllib.loads(file_at(launch, "/home/agent/.codex/config.toml"))
    assert config["model"] == "policy-v3" and config["model_provider"] == "legorl"
    provider = config["model_providers"]["legorl"]
    assert provider["base_url"] == f"{BASE}/v1" and provider["wire_api"] == "responses"
    assert launch.env[provider["env_key"]] == "key-123"
    assert config["analytics"] == {"enabled": False}


def test_mini_swe_agent() -> None:
    launch = spec("mini-swe-agent", step_limit=40)
    assert launch.dialect == "openai_chat"
    args = list(launch.argv)
    assert args[:2] == ["mini", "-m"] and args[2] == "openai/policy-v3"
    assert "-y" in args and "--exit-immediately" in args
    configs = [args[i + 1] for i, a in enumerate(args) if a == "-c"]
    assert configs == ["mini.yaml", f"model.model_kwargs.api_base={BASE}/v1", "agent.step_limit=40"]
    assert args[args.index("-t") + 1] == CTX.instruction
    assert launch.env["OPENAI_API_KEY"] == "key-123"
    assert launch.env["MSWEA_CONFIGURED"] == "true"
    assert launch.env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert launch.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


def test_gemini_cli() -> None:
    launch = spec("gemini-cli")
    assert launch.dialect == "gemini"
    args = list(launch.argv)
    assert args[:3] == ["gemini", "-p", CTX.instruction]
    assert args[args.index("-m") + 1] == "policy-v3"  # never the default `auto` router
    assert launch.env["GOOGLE_GEMINI_BASE_URL"] == BASE
    assert launch.env["GEMINI_API_KEY"] == "key-123"
    assert launch.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    settings = json.loads(file_at(launch, "/home/agent/.gemini/settings.json"))
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"


def test_qwen_code() -> None:
    launch = spec("qwen-code")
    assert launch.dialect == "openai_chat"
    assert launch.argv[:3] == ("qwen", "-p", CTX.instruction)
    assert launch.env["OPENAI_BASE_URL"] == f"{BASE}/v1"
    assert launch.env["OPENAI_API_KEY"] == "key-123"
    assert launch.env["OPENAI_MODEL"] == "policy-v3"
    settings = json.loads(file_at(launch, "/home/agent/.qwen/settings.json"))
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["memory"] == {"enableManagedAutoMemory": False}  # no background extraction call


@pytest.mark.parametrize("name", ["qwen-code", "claude-code"])
def test_a_cli_runtime_memory_comes_on_top_of_the_task_limit(name: str) -> None:
    harness = get_harness(name)
    task = load_task(DEMO_TASKS_DIR / "edit-config")
    trial = TrialSpec(
        "t1",
        task,
        pb.HarnessConfig(name=name),
        harness.parse_options({}),
        pb.SamplingParams(),
        pb.TrialLimits(),
        {},
        agent_timeout_s=60.0,
        verifier_timeout_s=30.0,
    )
    host = SimpleNamespace(harness_tools=None)
    extra = 512 if name == "qwen-code" else 0  # Qwen Code's shell tool peaks past a 512 MB task's limit
    box = _sandbox_spec(host, harness, trial)  # type: ignore[arg-type]
    assert box.memory_mb == task.config.environment.memory_mb + extra


def test_openhands() -> None:
    launch = spec("openhands")
    assert launch.dialect == "openai_chat"
    assert launch.argv[0] == "openhands" and launch.argv[-2:] == ("-t", CTX.instruction)
    # Without --override-with-envs the CLI ignores the LLM_* variables and asks for settings.
    assert {"--headless", "--override-with-envs"} <= set(launch.argv)
    assert launch.env["LLM_BASE_URL"] == f"{BASE}/v1" and launch.env["LLM_API_KEY"] == "key-123"
    assert launch.env["LLM_MODEL"] == "openai/policy-v3"  # litellm's OpenAI-compatible client
    assert launch.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


def test_openhands_conversation_error_is_a_harness_error_despite_exit_0() -> None:
    harness = get_harness("openhands")
    assert isinstance(harness, CliHarness)
    # Abridged from a real 1.16.0 run whose command held `[server\\]`.
    stream = "\n".join(
        [
            "Initializing agent...",
            json.dumps({"source": "agent", "tool_name": "terminal", "kind": "ActionEvent"}),
            json.dumps(
                {
                    "source": "environment",
                    "code": "MissingStyle",
                    "kind": "ConversationErrorEvent",
                    "detail": "Failed to get style 'server\\\\'",
                }
            ),
            "Goodbye!",
        ]
    )
    outcome = harness.classify(0, stream, "", False)
    assert outcome.status == "harness_error"
    assert outcome.reason == "openhands: MissingStyle: Failed to get style 'server\\\\'"
    assert harness.classify(0, stream.replace("ConversationErrorEvent", "MessageEvent"), "", False).status == "ok"
    assert harness.classify(None, stream, "", True).status == "timeout"


@pytest.mark.parametrize("name", CLI_NAMES)
def test_every_cli_sets_home_and_writes_absolute_paths(name: str) -> None:
    launch = spec(name)
    assert launch.env["HOME"] == "/home/agent"
    assert all(f.path.startswith("/") for f in launch.files)


@pytest.mark.parametrize(
    ("name", "command", "check"),
    [
        ("claude-code", ["npm", "install", "-g", "@anthropic-ai/claude-code@2.1.x"], ["claude", "--version"]),
        ("codex", ["npm", "install", "-g", "@openai/codex@>=0.170.0 <0.180.0"], ["codex", "--version"]),
        # mini has no --version: it rejects the option and exits 2.
        ("mini-swe-agent", ["python3", "-m", "pip", "install", "mini-swe-agent>=2.4,<2.5"], ["mini", "--help"]),
        ("opencode", ["npm", "install", "-g", "opencode-ai@1.18.x"], ["opencode", "--version"]),
        ("openhands", ["python3", "-m", "pip", "install", "openhands>=1.16,<1.17"], ["openhands", "--version"]),
    ],
)
def test_install_commands(name: str, command: list[str], check: list[str]) -> None:
    harness = get_harness(name)
    assert isinstance(harness, CliHarness)
    install = harness.install_spec(harness.parse_options({}))
    assert install.commands() == [command]
    assert install.check_argv() == check
    pinned = harness.install_spec(harness.parse_options({"version": "9.9.9"}))
    assert pinned.requirement().endswith("9.9.9")
    assert get_harness("lego").install.commands() == []


def test_cli_options_are_validated() -> None:
    with pytest.raises(HarnessConfigError, match="wire"):
        get_harness("opencode").parse_options({"wire": "gemini"})
    with pytest.raises(HarnessConfigError, match="max_turns"):
        get_harness("claude-code").parse_options({"max_turns": 0})
    with pytest.raises(HarnessConfigError, match="sandbox: Extra inputs"):
        get_harness("codex").parse_options({"sandbox": "none"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"session_url": "172.30.0.1:8080/s/k"}, "http"),
        ({"api_key": " "}, "api_key"),
        ({"instruction": ""}, "instruction"),
        ({"workdir": "app"}, "absolute"),
    ],
)
def test_context_rejects_bad_inputs(kwargs: dict[str, str], message: str) -> None:
    fields = {"session_url": BASE, "api_key": "k", "model": "m", "instruction": "x", **kwargs}
    with pytest.raises(HarnessConfigError, match=message):
        HarnessContext(**fields)


def _claude_result(**fields: object) -> str:
    return "\n".join(
        [
            json.dumps({"type": "system", "subtype": "init"}),
            json.dumps({"type": "result", **fields}),
        ]
    )


@pytest.mark.parametrize(
    ("name", "exit_code", "stdout", "timed_out", "status"),
    [
        ("claude-code", 0, _claude_result(subtype="success", is_error=False), False, "ok"),
        ("claude-code", 1, _claude_result(subtype="error_max_turns", is_error=True), False, "ok"),
        (
            "claude-code",
            0,
            _claude_result(subtype="success", is_error=True, result="API Error: 500"),
            False,
            "harness_error",
        ),
        ("claude-code", 1, "not json at all", False, "harness_error"),
        ("codex", 1, '{"type":"turn.failed","error":{"message":"stream disconnected"}}', False, "harness_error"),
        ("codex", 0, '{"type":"thread.started","thread_id":"t"}\n{"type":"turn.completed"}', False, "ok"),
        ("gemini-cli", 53, "", False, "ok"),
        ("gemini-cli", 1, "", False, "harness_error"),
        ("qwen-code", None, "", True, "timeout"),
        ("codex", None, '{"type":"turn.failed","error":{"message":"x"}}', True, "timeout"),
    ],
)
def test_classify_reads_exit_and_output(
    name: str, exit_code: int | None, stdout: str, timed_out: bool, status: str
) -> None:
    harness = get_harness(name)
    assert isinstance(harness, CliHarness)
    outcome = harness.classify(exit_code, stdout, "stderr tail\n", timed_out)
    assert outcome.status == status
    if status == "harness_error":
        assert outcome.reason


def test_config_id_is_the_name_unless_options_change() -> None:
    harness = get_harness("opencode")
    assert harness.config_id(harness.parse_options({})) == "opencode"
    responses = harness.config_id(harness.parse_options({"wire": "openai_responses"}))
    assert responses.startswith("opencode~") and responses == harness.config_id(
        harness.parse_options('{"wire": "openai_responses"}')
    )
    assert responses != harness.config_id(harness.parse_options({"wire": "anthropic"}))
