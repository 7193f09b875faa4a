"""`lego`: our composable harness, an agent loop on the host whose parts are declared axes.

It talks to the proxy's chat-completions route with the `openai` SDK and runs
the agent's tool calls inside the trial's sandbox as the agent user.
"""

from __future__ import annotations

from typing import ClassVar

from rollout_server.sandbox.base import Sandbox

from ..base import HarnessContext, HarnessOptions, InProcessHarness, register_harness
from .loop import LegoResult, StopReason, run_lego
from .options import AXIS_NAMES, TURN_BUDGETS, LegoOptions, axes, config_id, sample_configs, space_size


@register_harness("lego")
class Lego(InProcessHarness):
    Options: ClassVar[type[HarnessOptions]] = LegoOptions

    def config_id(self, options: HarnessOptions) -> str:
        return f"{self.name}.{config_id(self._typed(options, LegoOptions))}"

    async def run(
        self, sandbox: Sandbox, ctx: HarnessContext, options: HarnessOptions, *, deadline_s: float | None = None
    ) -> LegoResult:
        return await run_lego(sandbox, ctx, self._typed(options, LegoOptions), deadline_s=deadline_s)


__all__ = [
    "AXIS_NAMES",
    "TURN_BUDGETS",
    "Lego",
    "LegoOptions",
    "LegoResult",
    "StopReason",
    "axes",
    "config_id",
    "run_lego",
    "sample_configs",
    "space_size",
]
