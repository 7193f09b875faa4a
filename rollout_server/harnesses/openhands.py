"""OpenHands CLI (PyPI `openhands`, on the OpenHands agent SDK), headless over chat completions (litellm).

Needs Python >= 3.12, which the bookworm sandbox's python3 (3.11) is not: the
venv runs on its own mounted interpreter (see tools.py). Offline settings,
probed against the proxy: `--override-with-envs` is what makes it read
LLM_MODEL / LLM_API_KEY / LLM_BASE_URL (ignored otherwise); litellm's `openai/`
prefix selects its OpenAI-compatible client for any model name; without
LITELLM_LOCAL_MODEL_COST_MAP each start tries to download litellm's price table.
Its `terminal` tool requires a `security_risk` argument on every call, and uses
tmux where present, else a plain subprocess (task images have no tmux).
"""

from __future__ import annotations

from typing import ClassVar

from .base import (
    CliHarness,
    Dialect,
    HarnessContext,
    HarnessOptions,
    InstallSpec,
    LaunchSpec,
    Outcome,
    json_lines,
    register_harness,
)

_OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "OPENHANDS_SUPPRESS_BANNER": "1",
}


@register_harness("openhands")
class OpenHands(CliHarness):
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="pip", package="openhands", version=">=1.16,<1.17", binary="openhands"
    )
    wire: ClassVar[Dialect] = "openai_chat"

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        env = {
            **_OFFLINE_ENV,
            "LLM_MODEL": f"openai/{ctx.model}",
            "LLM_API_KEY": ctx.api_key,
            "LLM_BASE_URL": ctx.openai_base_url,
        }
        # --headless approves every action itself; --json streams events as JSONL for the trial log.
        argv = ("openhands", "--headless", "--json", "--override-with-envs", "-t", ctx.instruction)
        return self._launch(ctx, options, argv, env)

    def classify(self, exit_code: int | None, stdout: str, stderr: str, timed_out: bool) -> Outcome:
        if not timed_out:
            # The CLI exits 0 when its conversation ends on an error: seen when it fails to render an
            # action whose command holds Rich markup such as `[server\\]` (1.16.0).
            for event in json_lines(stdout):
                if event.get("kind") == "ConversationErrorEvent":
                    detail = f"{event.get('code', 'error')}: {event.get('detail', '')}"
                    return Outcome("harness_error", f"openhands: {detail[:500]}")
        return super().classify(exit_code, stdout, stderr, timed_out)
