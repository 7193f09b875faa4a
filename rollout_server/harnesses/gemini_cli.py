"""Gemini CLI (`@google/gemini-cli`): Gemini `streamGenerateContent` over SSE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from .base import (
    CliHarness,
    Dialect,
    FileSpec,
    HarnessContext,
    HarnessOptions,
    InstallSpec,
    LaunchSpec,
    Outcome,
    home_path,
    json_file,
    register_harness,
)

# Documented headless exit code for "turn limit exceeded": the agent ran out of turns, not the harness.
TURN_LIMIT_EXIT = 53


def settings_file(
    ctx: HarnessContext, config_dir: str, auth_type: str, extra: Mapping[str, object] | None = None
) -> FileSpec:
    """`~/<config_dir>/settings.json` in Gemini CLI's schema, which its fork Qwen Code reads too;
    `extra`: top-level sections of the fork's own."""
    settings = {
        # Without a selected auth type the CLI asks interactively.
        "security": {"auth": {"selectedType": auth_type}},
        # Both upload to Google when on; offline they only add failing requests.
        "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False},
        **(extra or {}),
    }
    return json_file(home_path(ctx, config_dir, "settings.json"), settings)


@register_harness("gemini-cli")
class GeminiCli(CliHarness):
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="npm", package="@google/gemini-cli", version="0.61.x", binary="gemini"
    )
    wire: ClassVar[Dialect] = "gemini"

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        env = {
            # The Gemini SDK appends /v1beta/models/<m>:streamGenerateContent itself.
            "GOOGLE_GEMINI_BASE_URL": ctx.base_url,
            "GEMINI_API_KEY": ctx.api_key,
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
        }
        # An explicit -m: the default `auto` first makes a router call that needs a JSON answer.
        argv = ("gemini", "-p", ctx.instruction, "-m", ctx.model, "--yolo", "--output-format", "json")
        return self._launch(ctx, options, argv, env, (settings_file(ctx, ".gemini", "gemini-api-key"),))

    def classify(self, exit_code: int | None, stdout: str, stderr: str, timed_out: bool) -> Outcome:
        if not timed_out and exit_code == TURN_LIMIT_EXIT:
            return Outcome("ok", "stopped at the session turn limit")
        return super().classify(exit_code, stdout, stderr, timed_out)
