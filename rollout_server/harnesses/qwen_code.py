"""Qwen Code (`@qwen-code/qwen-code`): a Gemini CLI fork that speaks chat completions."""

from __future__ import annotations

import json
from typing import ClassVar

from .base import (
    CliHarness,
    Dialect,
    FileSpec,
    HarnessContext,
    HarnessOptions,
    InstallSpec,
    LaunchSpec,
    home_path,
    register_harness,
)

SETTINGS: dict[str, object] = {
    # Without a selected auth type the CLI asks interactively (Qwen OAuth by default).
    "security": {"auth": {"selectedType": "openai"}},
    # Inherited from Gemini CLI's settings schema; offline they only add failing requests.
    "telemetry": {"enabled": False},
    "privacy": {"usageStatisticsEnabled": False},
}


@register_harness("qwen-code")
class QwenCode(CliHarness):
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="npm", package="@qwen-code/qwen-code", version="0.x", binary="qwen"
    )

    def dialect(self, options: HarnessOptions) -> Dialect:
        return "openai_chat"

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        env = {
            "HOME": ctx.home,
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
        }
        settings = FileSpec(path=home_path(ctx, ".qwen", "settings.json"), content=json.dumps(SETTINGS, indent=2))
        return LaunchSpec(
            argv=("qwen", "-p", ctx.instruction, "--yolo"),
            env=env,
            files=(settings,),
            workdir=ctx.workdir,
            dialect="openai_chat",
        )
