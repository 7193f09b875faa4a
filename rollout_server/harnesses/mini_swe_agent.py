"""mini-swe-agent (PyPI `mini-swe-agent`): one `bash` tool, chat completions through litellm."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import (
    CliHarness,
    CliOptions,
    Dialect,
    HarnessContext,
    HarnessOptions,
    InstallSpec,
    LaunchSpec,
    register_harness,
)

_OFFLINE_ENV = {
    # Skips the first-run setup wizard.
    "MSWEA_CONFIGURED": "true",
    # The proxy's model is unknown to litellm's price table; without this the cost check raises.
    "MSWEA_COST_TRACKING": "ignore_errors",
    # Use the bundled price map instead of downloading it.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}


class MiniSweAgentOptions(CliOptions):
    step_limit: int | None = Field(None, gt=0, description="agent.step_limit override; None keeps mini.yaml's.")


@register_harness("mini-swe-agent")
class MiniSweAgent(CliHarness):
    Options: ClassVar[type[HarnessOptions]] = MiniSweAgentOptions
    install: ClassVar[InstallSpec] = InstallSpec(
        kind="pip", package="mini-swe-agent", version=">=2.4,<2.5", binary="mini", check_args=("--help",)
    )
    wire: ClassVar[Dialect] = "openai_chat"

    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec:
        opts = self._typed(options, MiniSweAgentOptions)
        argv = [
            "mini",
            # litellm's `openai/` prefix selects the OpenAI-compatible client for any model name.
            "-m",
            f"openai/{ctx.model}",
            "-y",
            "--exit-immediately",
            # Later -c entries override earlier ones: the built-in config, then our settings.
            "-c",
            "mini.yaml",
            "-c",
            f"model.model_kwargs.api_base={ctx.openai_base_url}",
        ]
        if opts.step_limit is not None:
            argv += ["-c", f"agent.step_limit={opts.step_limit}"]
        argv += ["-t", ctx.instruction]
        return self._launch(ctx, opts, argv, {**_OFFLINE_ENV, "OPENAI_API_KEY": ctx.api_key})
