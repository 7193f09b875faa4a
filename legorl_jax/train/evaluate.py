"""Evaluation: one trial of each task per harness configuration at the policy
the fleet serves, reduced to pass rates and mean reward. The training loop
runs it every `tasks.eval_every` steps; `legorl eval` runs it once."""

from __future__ import annotations

import asyncio

from tqdm import tqdm

from legorl_jax.core.config import Config
from legorl_jax.core.seeds import derive_seed
from legorl_jax.fleet import Fleet
from legorl_jax.train.assemble import rollout_metrics
from legorl_jax.train.groups import HarnessChoice, group_spec
from legorl_jax.train.harness_metrics import passed
from legorl_jax.train.rollout_log import RolloutLog


async def evaluate(
    fleet: Fleet,
    config: Config,
    task_ids: list[str],
    choices: list[HarnessChoice],
    *,
    policy_version: int,
    step: int,
    rollouts: RolloutLog | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """`eval_pass_rate`, `eval_reward`, and per harness configuration its
    `eval_pass_rate/<config id>` and `eval_harness/<config id>/…`; the
    trajectories go to `rollouts` (as step `step`) when given. With `progress`, a
    bar on stderr counts the trials as they end."""
    specs = [
        group_spec(config, task, choice, 1, policy_version=policy_version, step=step,
                   seed=derive_seed(config.seed, "eval", step, index, choice.config_id))
        for index, task in enumerate(task_ids)
        for choice in choices
    ]  # fmt: skip
    # One trial per spec: seven CLIs' evaluation is 126 trials and minutes, which a bar makes visible.
    # Trials end seconds apart, so the bar redraws at each one (mininterval=0).
    groups, passes = [], 0
    bar = tqdm(total=len(specs), desc=f"eval @ step {step}", unit="trial", disable=not progress, leave=False,
               mininterval=0)  # fmt: skip
    with bar:
        async for group in fleet.rollout(specs):
            groups.append(group)
            passes += sum(map(passed, group.trajectories))
            bar.set_postfix(passed=passes, refresh=False)
            bar.update(len(group.trajectories))
    metrics = rollout_metrics(groups)
    if rollouts is not None:
        await asyncio.to_thread(rollouts.write, step, "eval", [t for g in groups for t in g.trajectories])
    out = {"eval_pass_rate": metrics.get("pass_rate", 0.0), "eval_reward": metrics.get("reward/mean", 0.0)}
    out.update({f"eval_{k}": v for k, v in metrics.items() if k.startswith(("pass_rate/", "harness/"))})
    return out
