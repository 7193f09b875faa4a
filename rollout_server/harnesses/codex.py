"""Codex CLI (`@openai/codex`): Responses API only (`wire_api = "chat"` is rejected)."""

from __future__ import annotations

from typing import ClassVar

import tomli_w

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
    json_lines,
    register_harness,
    stdin_from,
)

PROVIDER_ID = "legorl"
KEY_ENV = "LEGORL_SESSION_KEY"


@register_harness("codex")
class Codex(CliHarness):
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="npm", package="@openai/codex", version=">=0.170.0 <0.180.0", binary="codex"
    )
    wire: ClassVar[Dialect] = "openai_responses"

    def config(self, ctx: HarnessContext) -> dict[str, object]:
        return {
            "model": ctx.model,
            "model_provider": PROVIDER_ID,
            "model_providers": {
                PROVIDER_ID: {
                    "name": PROVIDER_ID,
                    "base_url": ctx.openai_base_url,
                    "env_key": KEY_ENV,
                    "wire_api": "responses",
                }
            },
            # Offline, analytics uploads stretch a 0.3 s run to 5 s.
            "analytics": {"enabled": False},
        }

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        codex_home = home_path(ctx, ".codex")
        argv = (
            "codex",
            "exec",
            "--json",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            ctx.instruction,
        )
        return self._launch(
            ctx,
            options,
            # `codex exec` reads more prompt from a non-TTY stdin until EOF, so it must see an empty one.
            argv=stdin_from("/dev/null", argv),
            env={"CODEX_HOME": codex_home, KEY_ENV: ctx.api_key},
            files=(FileSpec(path=f"{codex_home}/config.toml", content=tomli_w.dumps(self.config(ctx))),),
        )

    def classify(self, exit_code: int | None, stdout: str, stderr: str, timed_out: bool) -> Outcome:
        if timed_out:
            return super().classify(exit_code, stdout, stderr, timed_out)
        # `exec --json` reports API failures as `turn.failed` / `error` events.
        for event in json_lines(stdout):
            if event.get("type") == "turn.failed":
                message = (event.get("error") or {}).get("message", "turn failed")
                return Outcome("harness_error", f"codex: {str(message)[:500]}")
            if event.get("type") == "error" and exit_code != 0:
                return Outcome("harness_error", f"codex: {str(event.get('message', 'error'))[:500]}")
        return super().classify(exit_code, stdout, stderr, timed_out)
