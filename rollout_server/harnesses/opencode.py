"""OpenCode (`opencode-ai`): one CLI, three wire dialects chosen by the provider package.

OpenCode ignores OPENAI_BASE_URL; only `opencode.json` in the work directory
points it at the proxy, so the session key lives in that file.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .base import (
    CliHarness,
    CliOptions,
    Dialect,
    FileSpec,
    HarnessContext,
    HarnessOptions,
    InstallSpec,
    LaunchSpec,
    home_path,
    json_file,
    register_harness,
    stdin_from,
)

PROVIDER_ID = "legorl"

# The AI SDK provider package decides which API OpenCode speaks.
PROVIDER_PACKAGES: dict[Dialect, str] = {
    "openai_chat": "@ai-sdk/openai-compatible",
    "openai_responses": "@ai-sdk/openai",
    "anthropic": "@ai-sdk/anthropic",
}

_OFFLINE_ENV = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
}


class OpenCodeOptions(CliOptions):
    wire: Literal["openai_chat", "openai_responses", "anthropic"] = Field(
        "openai_chat", description="API OpenCode speaks to the proxy (selects the provider package)."
    )
    prompt_via: Literal["words", "stdin"] = Field(
        "words",
        description="words: the instruction as separate argv words (observed to work; newlines become spaces, "
        "since one quoted argument arrives wrapped in literal quotes); stdin: piped from a file (keeps layout; "
        "not probed here).",
    )


@register_harness("opencode")
class OpenCode(CliHarness):
    Options: ClassVar[type[HarnessOptions]] = OpenCodeOptions
    install: ClassVar[InstallSpec] = InstallSpec(kind="npm", package="opencode-ai", version="1.18.x", binary="opencode")

    def dialect(self, options: HarnessOptions) -> Dialect:
        return self._typed(options, OpenCodeOptions).wire

    def config(self, ctx: HarnessContext, options: OpenCodeOptions) -> dict[str, object]:
        model_ref = f"{PROVIDER_ID}/{ctx.model}"
        return {
            "provider": {
                PROVIDER_ID: {
                    "npm": PROVIDER_PACKAGES[options.wire],
                    "name": PROVIDER_ID,
                    # All three AI SDK packages append their route (/chat/completions, /responses, /messages).
                    "options": {"baseURL": ctx.openai_base_url, "apiKey": ctx.api_key},
                    "models": {ctx.model: {"name": ctx.model, "tool_call": True}},
                }
            },
            "model": model_ref,
            # The per-run title call would otherwise go to a hosted default model.
            "small_model": model_ref,
        }

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        opts = self._typed(options, OpenCodeOptions)
        files = [json_file(f"{ctx.workdir.rstrip('/')}/opencode.json", self.config(ctx, opts))]
        if opts.prompt_via == "words":
            argv = ("opencode", "run", *ctx.instruction.split())
        else:
            prompt = FileSpec(path=home_path(ctx, ".legorl", "instruction.md"), content=ctx.instruction)
            files.append(prompt)
            argv = stdin_from(prompt.path, ("opencode", "run"))
        return self._launch(ctx, opts, argv, _OFFLINE_ENV, files)
