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
    # 0.15's shell tool checks every command with a tree-sitter bash parser whose WASM bytes the bundle
    # turns into ~700k property getters: the JS heap peaks near 500 MB (630 MB resident), and node
    # runs out of heap (or the container of memory) in a 512 MB task sandbox at the first command.
    runtime_memory_mb = 512

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        env = {
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
        }
        # Unset, the auth type defaults to Qwen OAuth, which is interactive. Managed auto-memory
        # (on by default) asks the model, in the background after a prompt's turn, what to remember
        # in ~/.qwen: a home no later trial reads, and a ~20k-token side call that may or may not
        # be made before the CLI exits.
        memory = {"memory": {"enableManagedAutoMemory": False}}
        settings = settings_file(ctx, ".qwen", auth_type="openai", extra=memory)
        return self._launch(ctx, options, ("qwen", "-p", ctx.instruction, "--yolo"), env, (settings,))
