"""Claude Code (`@anthropic-ai/claude-code`), headless over the Anthropic Messages API."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import (
    CliHarness,
    CliOptions,
    Dialect,
    HarnessConfigError,
    HarnessContext,
    HarnessOptions,
    InstallSpec,
    LaunchSpec,
    Outcome,
    json_lines,
    register_harness,
)

# Without these an offline run stalls on update checks and telemetry endpoints.
_OFFLINE_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    # As root, --dangerously-skip-permissions exits 1 unless the CLI is told it is sandboxed.
    "IS_SANDBOX": "1",
}


class ClaudeCodeOptions(CliOptions):
    disable_thinking: bool = Field(
        True, description="Set CLAUDE_CODE_DISABLE_THINKING=1, which drops `thinking`/`context_management`."
    )
    max_turns: int | None = Field(None, gt=0, description="Pass --max-turns; the proxy's call cap still applies.")


@register_harness("claude-code")
class ClaudeCode(CliHarness):
    Options: ClassVar[type[HarnessOptions]] = ClaudeCodeOptions
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="npm", package="@anthropic-ai/claude-code", version="2.1.x", binary="claude"
    )
    wire: ClassVar[Dialect] = "anthropic"

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        opts = self._typed(options, ClaudeCodeOptions)
        if "/" in ctx.model:
            raise HarnessConfigError(f"claude-code: model names must not contain '/', got {ctx.model!r}")
        env = {
            **_OFFLINE_ENV,
            # The Anthropic SDK appends /v1/messages itself.
            "ANTHROPIC_BASE_URL": ctx.base_url,
            "ANTHROPIC_API_KEY": ctx.api_key,
        }
        if opts.disable_thinking:
            env["CLAUDE_CODE_DISABLE_THINKING"] = "1"
        argv = [
            "claude",
            "-p",
            ctx.instruction,
            "--output-format",
            "stream-json",
            "--verbose",
            "--dangerously-skip-permissions",
            "--model",
            ctx.model,
        ]
        if opts.max_turns is not None:
            argv += ["--max-turns", str(opts.max_turns)]
        return self._launch(ctx, opts, argv, env)

    def classify(self, exit_code: int | None, stdout: str, stderr: str, timed_out: bool) -> Outcome:
        # stream-json ends with one `result` event; its subtype says why the run ended.
        result = next((e for e in reversed(list(json_lines(stdout))) if e.get("type") == "result"), None)
        if timed_out or result is None:
            return super().classify(exit_code, stdout, stderr, timed_out)
        subtype = str(result.get("subtype", ""))
        if subtype == "error_max_turns":
            return Outcome("ok", "stopped at --max-turns")
        if result.get("is_error") or exit_code != 0:
            detail = result.get("result") or subtype or f"exit code {exit_code}"
            return Outcome("harness_error", f"claude-code: {str(detail)[:500]}")
        return Outcome("ok")
