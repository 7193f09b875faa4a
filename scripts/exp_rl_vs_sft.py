#!/usr/bin/env python
"""RL against SFT on a teacher's successes, at an equal number of episodes.

Four arms from the same warm start (the config's model), each given the same
--episodes budget:

  warm      the warm start itself (no episodes)
  sft       `legorl sft` on EPISODES verified episodes of the teacher
  rl        `legorl train`: EPISODES episodes sampled by the policy
            (steps × groups per step × group size, dynamic sampling off)
  sft_rl    `legorl sft` on half the budget of teacher episodes, then
            `legorl train` on the other half

The teacher is the scripted oracle (`legorl_jax/demo/oracle_rollouts.py`: the
task's own solve.sh played through the real lego harness and proxy, graded by
the verifier, token-exact in the student's tokenizer); it passes every episode it
keeps, so "its successes" are all its episodes. Teacher episodes and RL episodes
are drawn from the training tasks on the config's harness mix. Then `legorl eval`
measures every arm on the held-out tasks under the training configurations
(seen) and under --held-out configurations that no arm trained on: pass rate and
tool calls per episode. Each seed repeats everything (its own teacher draw, its
own RL sampling). Prints a markdown table and writes it with the command to
--out; the raw numbers beside it as JSON. See docs/rl_vs_sft.md.

  .venv/bin/python scripts/exp_rl_vs_sft.py --seeds 0 --episodes 32
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from exp_harness_diversity import (  # noqa: E402
    CONTROLLED as HARNESS_DIVERSITY_CONTROLLED,
)
from exp_harness_diversity import (  # noqa: E402
    ExperimentPlan,
    UsageError,
    _harness_list,
    _legorl,
    _mix_json,
    _pct,
    _sets,
    _spread,
    add_common_arguments,
    check_common_arguments,
    clear_runs,
    common_fields,
    latest_weights,
    legorl_eval,
    normalized,
    warm_start_model,
)

from legorl_jax.core.config import ConfigError, HarnessSpec, load_config  # noqa: E402
from legorl_jax.train.groups import harness_choice  # noqa: E402

ARMS = ("warm", "sft", "rl", "sft_rl")
# A lego configuration the demo model is not warm-started on and no arm trains on: it keeps
# the known bash_only+terse pair (a new tool set or prompt scores 0 from this start, see
# docs/harness_diversity.md) and changes the observation format and the turn budget.
HELD_OUT = [{"name": "lego", "options": {"tools": "bash_only", "prompt": "terse", "observation": "raw",
                                         "turn_budget": "short"}}]  # fmt: skip
# Config fields each run gets from the experiment's own arguments, never from --set.
CONTROLLED = (*HARNESS_DIVERSITY_CONTROLLED, "model.path", "sft.evaluate")


@dataclass(kw_only=True)
class Plan(ExperimentPlan):
    held_out: list[HarnessSpec]
    seen: list[HarnessSpec]
    episodes: int

    @property
    def episodes_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    def budget(self, arm: str) -> tuple[int, int]:
        """(teacher episodes, policy episodes) of an arm: their sum is --episodes for every trained arm."""
        half = self.episodes // 2
        return {"warm": (0, 0), "sft": (self.episodes, 0), "rl": (0, self.episodes), "sft_rl": (half, half)}[arm]

    def rl_steps(self, arm: str) -> int:
        return self.budget(arm)[1] // self.episodes_per_step

    def run_name(self, arm: str, seed: int) -> str:
        return f"{arm}-s{seed}"

    def teacher_dir(self, episodes: int, seed: int) -> Path:
        return self.runs_dir / f"teacher-e{episodes}-s{seed}"


def parse_args(argv: list[str]) -> Plan:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="run config of every arm")
    parser.add_argument(
        "--episodes",
        type=int,
        default=32,
        help="episodes per trained arm: teacher episodes for sft, policy episodes for rl, half each for sft_rl",
    )
    parser.add_argument(
        "--held-out",
        action="append",
        default=None,
        metavar="JSON",
        help="a held-out harness configuration, evaluated only (repeatable; default: one lego configuration)",
    )
    add_common_arguments(parser, seeds=[0, 1], runs_dir=REPO / "runs" / "rl_vs_sft")
    args = parser.parse_args(argv)
    check_common_arguments(args, CONTROLLED, ("--episodes", args.episodes, 2))
    per_step = args.groups_per_step * args.group_size
    if args.episodes % (2 * per_step):
        raise UsageError(
            f"--episodes {args.episodes}: a multiple of 2 × groups per step × group size ({2 * per_step}), "
            "so that rl and the RL half of sft_rl spend it in whole steps"
        )
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    seen = list(config.harness_mix.harnesses)
    held_out = (
        [s for i, h in enumerate(args.held_out) for s in _harness_list(h, f"--held-out #{i + 1}")]
        if args.held_out
        else [HarnessSpec.model_validate(h) for h in HELD_OUT]
    )
    trained = {normalized(s, "the config's harness_mix") for s in seen}
    if any(s.name != "lego" for s in seen):
        raise UsageError("the config's harness_mix: the oracle teacher plays lego configurations only")
    for i, spec in enumerate(held_out):
        if normalized(spec, f"--held-out #{i + 1}") in trained:
            raise UsageError(f"--held-out #{i + 1} ({spec.name} {json.dumps(spec.options)}): the arms train on it")
    plan = Plan(held_out=held_out, seen=seen, episodes=args.episodes, **common_fields(args))
    try:  # every run's config, checked before anything runs
        for arm, seed in ((a, s) for a in ("sft", "rl", "sft_rl") for s in plan.seeds):
            load_config(plan.config, sft_overrides(plan, arm, seed))
            if plan.rl_steps(arm):
                load_config(plan.config, rl_overrides(plan, arm, seed, Path("model")))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return plan


def sft_overrides(plan: Plan, arm: str, seed: int) -> list[str]:
    """The SFT phase of an arm: its own run directory; no evaluation of its own (the experiment's is the same
    for every arm)."""
    return [
        *plan.overrides,
        f"seed={seed}",
        "sft.evaluate=false",
        f"logging.run_dir={plan.runs_dir}",
        f"logging.run_name={plan.run_name(arm, seed)}-sft",
    ]


def rl_overrides(plan: Plan, arm: str, seed: int, model: Path) -> list[str]:
    """The RL phase of an arm from `model`: its share of the budget in whole steps, no extra sampling rounds."""
    steps = plan.rl_steps(arm)
    return [
        *plan.overrides,
        f"seed={seed}",
        f"model.path={model}",
        f"total_steps={steps}",
        f"rl.groups_per_step={plan.groups_per_step}",
        f"rl.group_size={plan.group_size}",
        "rl.dynamic_sampling=false",
        f"tasks.eval_every={steps}",
        f"logging.run_dir={plan.runs_dir}",
        f"logging.run_name={plan.run_name(arm, seed)}-rl",
    ]


def teacher_rollouts(plan: Plan, model: Path, episodes: int, seed: int) -> tuple[Path, dict[str, Any]]:
    """The oracle's episodes on the training tasks and mix (recorded once per size and seed)."""
    from legorl_jax.demo.oracle_rollouts import record_oracle_rollouts  # deferred: loads jax
    from rollout_server.demo_families import demo_task_splits
    from rollout_server.harnesses.lego import LegoOptions
    from rollout_server.tasks import load_tasks

    out = plan.teacher_dir(episodes, seed)
    if (out / "collect.json").is_file():
        return out, json.loads((out / "collect.json").read_text())
    config = load_config(plan.config, [*plan.overrides, f"seed={seed}"])
    tasks = load_tasks(config.tasks.train)
    if config.tasks.demo:
        tasks.extend(demo_task_splits(config.tasks.demo_variants)["train"])
    print(f"teacher: {episodes} oracle episodes -> {out}", flush=True)
    started = time.monotonic()
    manifest = record_oracle_rollouts(
        model,
        tasks,
        [LegoOptions.model_validate(s.options) for s in plan.seen],
        episodes=episodes,
        seed=seed,
        out_dir=out,
        max_context=config.engine.max_context or config.model.max_seq_len,
        max_tokens=config.rl.sampling.max_tokens,
    )
    print(f"  ({time.monotonic() - started:.0f} s, {manifest['kept']} kept)", flush=True)
    return out, manifest


def evaluate(plan: Plan, model: Path, seed: int, log: Path) -> dict[str, float]:
    """`legorl eval` of `model` on the held-out tasks, under the seen and the held-out configurations."""
    overrides = [*plan.overrides, f"seed={seed}"]
    return legorl_eval(plan.config, overrides, model, [*plan.seen, *plan.held_out], plan.eval_samples, log)


@dataclass
class Result:
    """One arm at one seed: pass rate and tool calls per episode on the seen and the held-out configurations."""

    arm: str
    seed: int
    teacher_episodes: int
    policy_episodes: int
    seen_pass_rate: float
    held_out_pass_rate: float
    seen_tool_calls: float
    held_out_tool_calls: float
    wall_s: float = 0.0


def _mean_over(evaluation: dict[str, float], specs: list[HarnessSpec], name: str) -> float:
    """The mean over configurations of `eval_harness/<id>/<name>` (`eval_pass_rate/<id>` for the pass rate);
    every configuration evaluates on the same tasks, so this is the mean over their episodes. A configuration
    whose every trial failed in its environment has neither (NaN: the table shows it, nothing is taken for 0)."""
    ids = [harness_choice(s).config_id for s in specs]
    keys = [f"eval_pass_rate/{i}" if name == "pass_rate" else f"eval_harness/{i}/{name}" for i in ids]
    return statistics.mean(evaluation.get(k, float("nan")) for k in keys)


def result_from_eval(plan: Plan, arm: str, seed: int, evaluation: dict[str, float], wall_s: float) -> Result:
    teacher, policy = plan.budget(arm)
    return Result(
        arm,
        seed,
        teacher,
        policy,
        _mean_over(evaluation, plan.seen, "pass_rate"),
        _mean_over(evaluation, plan.held_out, "pass_rate"),
        _mean_over(evaluation, plan.seen, "tool_calls_per_episode"),
        _mean_over(evaluation, plan.held_out, "tool_calls_per_episode"),
        wall_s,
    )


def build_table(plan: Plan, results: list[Result]) -> str:
    """Markdown: per arm the pass rate (%) on seen and held-out configurations per seed, mean and spread, and
    tool calls per episode (mean over seeds)."""
    by_arm = {arm: {r.seed: r for r in results if r.arm == arm} for arm in ARMS}
    missing = [f"{arm}/s{s}" for arm in ARMS for s in plan.seeds if s not in by_arm[arm]]
    if missing:
        raise ValueError(f"no result for {', '.join(missing)}")
    seeds = ", ".join(str(s) for s in plan.seeds)
    lines = [
        f"| arm | teacher + policy episodes | seen: pass % (seeds {seeds}) | seen: mean | seen: spread "
        f"| held-out: pass % (seeds {seeds}) | held-out: mean | held-out: spread | tool calls/episode seen "
        "| tool calls/episode held-out | wall min (mean) |",
        "|" + " --- |" * 11,
    ]
    for arm in ARMS:
        runs = [by_arm[arm][s] for s in plan.seeds]
        seen = [r.seen_pass_rate for r in runs]
        held = [r.held_out_pass_rate for r in runs]
        cells = [
            arm,
            f"{runs[0].teacher_episodes} + {runs[0].policy_episodes}",
            " / ".join(map(_pct, seen)),
            _pct(statistics.mean(seen)),
            _spread(seen),
            " / ".join(map(_pct, held)),
            _pct(statistics.mean(held)),
            _spread(held),
            f"{statistics.mean(r.seen_tool_calls for r in runs):.2f}",
            f"{statistics.mean(r.held_out_tool_calls for r in runs):.2f}",
            f"{statistics.mean(r.wall_s for r in runs) / 60:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(plan: Plan, results: list[Result], teachers: list[dict[str, Any]], command: str, wall_s: float) -> str:
    kept = ", ".join(f"{m['kept']} of {m['trials']} ({m['passed']} passed)" for m in teachers)
    return (
        "# RL against SFT on a teacher's successes\n\n"
        f"Command: `{command}`\n\n"
        f"Budget per trained arm: {plan.episodes} episodes (RL: {plan.groups_per_step} groups × "
        f"{plan.group_size} trials per step, dynamic sampling off). Teacher: the scripted oracle; its recorded "
        f"episodes per seed and size: {kept or 'none'}. Evaluation: {plan.eval_samples} trial(s) per held-out task "
        f"and configuration. Wall time {wall_s / 60:.1f} min.\n\n"
        f"Seen (training) configurations: `{_mix_json(plan.seen)}`\n\n"
        f"Held-out configurations: `{_mix_json(plan.held_out)}`\n\n" + build_table(plan, results)
    )


def run_arm(plan: Plan, arm: str, seed: int, warm: Path, logs: Path, teachers: list[dict[str, Any]]) -> Path:
    """Trains one arm at one seed; returns the policy to evaluate."""
    teacher_episodes, _ = plan.budget(arm)
    model = warm
    if teacher_episodes:
        rollouts, manifest = teacher_rollouts(plan, warm, teacher_episodes, seed)
        if manifest not in teachers:
            teachers.append(manifest)
        name = f"{plan.run_name(arm, seed)}-sft"
        sets = _sets(sft_overrides(plan, arm, seed))
        _legorl(["sft", "--config", plan.config, "--rollouts", str(rollouts), "--no-progress", *sets],
                logs / f"{name}.log")  # fmt: skip
        model = plan.runs_dir / name / "model"
    if plan.rl_steps(arm):
        name = f"{plan.run_name(arm, seed)}-rl"
        sets = _sets(rl_overrides(plan, arm, seed, model))
        _legorl(["train", "--config", plan.config, "--no-progress", *sets], logs / f"{name}.log")
        model = latest_weights(plan.runs_dir / name)
    return model


def main(argv: list[str]) -> int:
    try:
        plan = parse_args(argv)
    except UsageError as exc:
        print(f"exp_rl_vs_sft: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    runs = [plan.runs_dir / f"{plan.run_name(a, s)}-{p}" for a in ARMS for s in plan.seeds for p in ("sft", "rl")]
    runs += [plan.teacher_dir(e, s) for e in (plan.episodes, plan.episodes // 2) for s in plan.seeds]
    if not clear_runs(runs, plan.overwrite, "exp_rl_vs_sft"):
        return 2
    logs = plan.runs_dir / "logs"
    warm = warm_start_model(plan.config, plan.overrides)
    results: list[Result] = []
    teachers: list[dict[str, Any]] = []
    for seed in plan.seeds:
        for arm in ARMS:
            print(f"== seed {seed}, arm {arm}", flush=True)
            arm_started = time.monotonic()
            model = run_arm(plan, arm, seed, warm, logs, teachers)
            evaluation = evaluate(plan, model, seed, logs / f"{plan.run_name(arm, seed)}.eval.log")
            result = result_from_eval(plan, arm, seed, evaluation, time.monotonic() - arm_started)
            results.append(result)
            print(
                f"  {arm} s{seed}: seen {_pct(result.seen_pass_rate)} %, held-out {_pct(result.held_out_pass_rate)} %"
                f", tool calls {result.seen_tool_calls:.2f} / {result.held_out_tool_calls:.2f}",
                flush=True,
            )
            # Partial results survive an interrupted run.
            plan.out.parent.mkdir(parents=True, exist_ok=True)
            plan.out.with_suffix(".json").write_text(json.dumps([r.__dict__ for r in results], indent=2))
    command = shlex.join(["python", "scripts/exp_rl_vs_sft.py", *argv])
    text = report(plan, results, teachers, command, time.monotonic() - started)
    plan.out.write_text(text)
    print(text)
    print(f"written to {plan.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
