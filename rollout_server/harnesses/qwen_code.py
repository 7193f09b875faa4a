"""Qwen Code (`@qwen-code/qwen-code`): a Gemini CLI fork that speaks chat completions."""

from __future__ import annotations

from typing import ClassVar

from .base import CliHarness, Dialect, HarnessContext, HarnessOptions, InstallSpec, LaunchSpec, register_harness
from .gemini_cli import settings_file


@register_harness("qwen-code")
class QwenCode(CliHarness):
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="npm", package="@qwen-code/qwen-code", version="0.x", binary="qwen"
    )
    wire: ClassVar[Dialect] = "openai_chat"

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        env = {
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
        }
        # Unset, the auth type defaults to Qwen OAuth, which is interactive.
        settings = settings_file(ctx, ".qwen", auth_type="openai")
        return self._launch(ctx, options, ("qwen", "-p", ctx.instruction, "--yolo"), env, (settings,))
