#!/usr/bin/env python
"""Does training across diverse harness configurations transfer to ones never seen?

At an equal trial budget (same steps, groups per step and group size, no dynamic
sampling), each arm trains from the same warm start on its own harness mix
through `legorl train`; then `legorl eval` measures every arm's final policy,
and the warm start itself, on held-out harness configurations that no arm
trained on, over the config's held-out tasks. Each seed repeats the whole
comparison. Prints a markdown table (held-out pass rate per arm and seed, mean
and spread) and writes it, with the exact command, to --out; the raw numbers go
beside it as JSON. See docs/harness_diversity.md.

  .venv/bin/python scripts/exp_harness_diversity.py --seeds 0 1 2 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from legorl_jax.core.config import ConfigError, HarnessSpec, load_config  # noqa: E402
from legorl_jax.train.groups import harness_choice  # noqa: E402
from rollout_server.harnesses import HarnessConfigError, UnknownHarnessError, get_harness  # noqa: E402

LEGORL = [sys.executable, "-m", "legorl_jax.cli"]
PROG = "exp_harness_diversity"


def _lego(**options: str) -> dict[str, Any]:
    return {"name": "lego", "options": options}


# Defaults over lego's declared axes. The demo model is warm-started on the first two
# configurations (configs/demo.yaml's mix) and keys on their tool set and prompt: a
# configuration that changes those scored 0 at the warm start, so the held-out ones keep
# a known pair and change the other axes. Each held-out configuration differs from every
# training one; the values that make it new (structured or raw observations, a window
# context, a short budget) are trained on in the diverse arm and not in the single one.
SINGLE = [_lego(tools="bash_only", prompt="terse")]
DIVERSE = [
    *SINGLE,
    _lego(tools="minimal", prompt="guided"),
    _lego(tools="minimal", prompt="guided", observation="raw", turn_budget="long"),
    _lego(tools="bash_only", prompt="terse", context="window", observation="structured", turn_budget="short"),
]
HELD_OUT = [
    _lego(tools="bash_only", prompt="terse", observation="structured"),
    _lego(tools="minimal", prompt="guided", context="window"),
    _lego(tools="bash_only", prompt="terse", observation="raw", turn_budget="short"),
]
DEFAULT_ARMS = {"single": SINGLE, "diverse": DIVERSE}

# Config fields each run gets from the experiment's own arguments, never from --set.
CONTROLLED = (
    "seed",
    "total_steps",
    "rl.groups_per_step",
    "rl.group_size",
    "rl.dynamic_sampling",
    "harness_mix",
    "tasks.eval_every",
    "logging.run_dir",
    "logging.run_name",
)


class UsageError(ValueError):
    """Arguments the experiment cannot run with; the message names the argument."""


@dataclass(kw_only=True)
class ExperimentPlan:
    """What every experiment script's plan holds (`add_common_arguments`, `common_fields`)."""

    config: str
    seeds: list[int]
    groups_per_step: int
    group_size: int
    eval_samples: int
    runs_dir: Path
    out: Path
    overrides: list[str] = field(default_factory=list)
    overwrite: bool = False


@dataclass(kw_only=True)
class Plan(ExperimentPlan):
    arms: dict[str, list[HarnessSpec]]
    held_out: list[HarnessSpec]
    steps: int

    @property
    def trials_per_run(self) -> int:
        """The training budget each arm gets per seed (dynamic sampling is off)."""
        return self.steps * self.groups_per_step * self.group_size

    def run_name(self, arm: str, seed: int) -> str:
        return f"{arm}-s{seed}"


def _harness_list(text: str, where: str) -> list[HarnessSpec]:
    try:
        raw = json.loads(text)
        items = raw if isinstance(raw, list) else [raw]
        specs = [HarnessSpec.model_validate(item) for item in items]
    except ValueError as exc:  # JSON and pydantic errors alike
        raise UsageError(f"{where}: {exc}") from None
    if not specs:
        raise UsageError(f"{where}: an empty harness list")
    return specs


def normalized(spec: HarnessSpec, where: str) -> tuple[str, str]:
    """A harness configuration with its defaults filled in, so that two spellings of one
    configuration compare equal; an unknown harness or bad option names `where`."""
    try:
        options = get_harness(spec.name).parse_options(spec.options)
    except (UnknownHarnessError, HarnessConfigError) as exc:
        raise UsageError(f"{where}: {exc}") from None
    return spec.name, json.dumps(options.model_dump(mode="json"), sort_keys=True)


def add_common_arguments(parser: argparse.ArgumentParser, *, seeds: list[int], runs_dir: Path) -> None:
    """The arguments every experiment script takes: seeds, the RL budget's shape, evaluation, outputs, --set."""
    parser.add_argument("--seeds", type=int, nargs="+", default=seeds)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=1, help="trials per held-out task and configuration")
    parser.add_argument("--runs-dir", default=str(runs_dir))
    parser.add_argument("--out", default=None, help="markdown table (default: RUNS_DIR/results.md)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run directories of an earlier run")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE", help="config override (all runs)"
    )


def common_fields(args: argparse.Namespace) -> dict[str, Any]:
    """A plan's fields from `add_common_arguments`' values."""
    runs_dir = Path(args.runs_dir)
    return {
        "config": args.config,
        "seeds": args.seeds,
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "eval_samples": args.eval_samples,
        "runs_dir": runs_dir,
        "out": Path(args.out) if args.out else runs_dir / "results.md",
        "overrides": args.overrides,
        "overwrite": args.overwrite,
    }


def check_common_arguments(args: argparse.Namespace, controlled: tuple[str, ...], *more: tuple[str, int, int]) -> None:
    """`add_common_arguments`' values (and `more`: flag, value, least) checked; config fields the
    experiment sets itself (`controlled`) refused in --set."""
    for override in args.overrides:
        path = override.partition("=")[0].strip()
        if any(path == c or path.startswith(c + ".") for c in controlled):
            raise UsageError(f"--set {override}: the experiment sets {path} itself (see --help)")
    for flag, value, least in (
        *more,
        ("--groups-per-step", args.groups_per_step, 1),
        ("--group-size", args.group_size, 2),
        ("--eval-samples", args.eval_samples, 1),
    ):
        if value < least:
            raise UsageError(f"{flag}: at least {least}, got {value}")
    if len(set(args.seeds)) != len(args.seeds):
        raise UsageError(f"--seeds: repeated seed in {args.seeds}")


def parse_args(argv: list[str]) -> Plan:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="run config of every arm")
    parser.add_argument(
        "--arm",
        action="append",
        default=None,
        metavar="NAME=JSON",
        help="an arm: its name and training mix as a JSON harness list (repeatable, at least two; "
        "default: single = one lego configuration, diverse = four across lego's axes)",
    )
    parser.add_argument(
        "--held-out",
        action="append",
        default=None,
        metavar="JSON",
        help="a held-out harness configuration (repeatable; default: three lego configurations no arm trains on)",
    )
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    add_common_arguments(parser, seeds=[0, 1, 2], runs_dir=REPO / "runs" / "harness_diversity")
    args = parser.parse_args(argv)

    arms: dict[str, list[HarnessSpec]] = {}
    for item in args.arm or []:
        name, sep, mix = item.partition("=")
        if not sep or not name.strip() or not name.replace("-", "").replace("_", "").isalnum():
            raise UsageError(f"--arm {item!r}: expected NAME=JSON with NAME of letters, digits, - or _")
        if name in arms:
            raise UsageError(f"--arm {name}: given twice")
        arms[name] = _harness_list(mix, f"--arm {name}")
    if not arms:
        arms = {name: [HarnessSpec.model_validate(h) for h in mix] for name, mix in DEFAULT_ARMS.items()}
    if len(arms) < 2:
        raise UsageError("--arm: at least two arms to compare")
    held_out = (
        [s for i, h in enumerate(args.held_out) for s in _harness_list(h, f"--held-out #{i + 1}")]
        if args.held_out
        else [HarnessSpec.model_validate(h) for h in HELD_OUT]
    )
    seen: dict[tuple[str, str], str] = {}
    for arm, mix in arms.items():
        for i, spec in enumerate(mix):
            seen.setdefault(normalized(spec, f"--arm {arm} #{i + 1}"), arm)
    held_keys: set[tuple[str, str]] = set()
    for i, spec in enumerate(held_out):
        key = normalized(spec, f"--held-out #{i + 1}")
        if key in seen:
            raise UsageError(
                f"--held-out #{i + 1} ({spec.name} {json.dumps(spec.options)}): arm {seen[key]!r} trains on it"
            )
        if key in held_keys:
            raise UsageError(f"--held-out #{i + 1} ({spec.name} {json.dumps(spec.options)}): given twice")
        held_keys.add(key)
    check_common_arguments(args, CONTROLLED, ("--steps", args.steps, 1))
    plan = Plan(arms=arms, held_out=held_out, steps=args.steps, **common_fields(args))
    try:  # every run's config, checked before anything runs
        load_config(plan.config, plan.overrides)
        for arm, seed in ((a, s) for a in plan.arms for s in plan.seeds):
            load_config(plan.config, train_overrides(plan, arm, seed))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return plan


def _mix_json(specs: list[HarnessSpec]) -> str:
    return json.dumps([s.model_dump(mode="json") for s in specs], separators=(",", ":"))


def train_overrides(plan: Plan, arm: str, seed: int) -> list[str]:
    """One arm's run: its mix, the shared budget (no extra sampling rounds), one evaluation at the end."""
    return [
        *plan.overrides,
        f"seed={seed}",
        f"total_steps={plan.steps}",
        f"rl.groups_per_step={plan.groups_per_step}",
        f"rl.group_size={plan.group_size}",
        "rl.dynamic_sampling=false",
        f"harness_mix.harnesses={_mix_json(plan.arms[arm])}",
        f"tasks.eval_every={plan.steps}",
        f"logging.run_dir={plan.runs_dir}",
        f"logging.run_name={plan.run_name(arm, seed)}",
    ]


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _env() -> dict[str, str]:
    """Every run compiles the same learner and engine programs: keep them across runs."""
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "xla-experiments"))
    return env


def _legorl(args: list[str], log: Path) -> str:
    """Runs `legorl ARGS`, its output teed into `log`; returns stdout, or exits naming the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ legorl {shlex.join(args)}", flush=True)
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.run([*LEGORL, *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=sink, text=True)
        sink.write(proc.stdout)
    print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
    if proc.returncode != 0:
        sys.exit(f"legorl {args[0]} failed (exit {proc.returncode}); its output: {log}")
    return proc.stdout


def held_out_eval(plan: Plan, model: Path, seed: int, log: Path) -> dict[str, float]:
    """`legorl eval` of `model` on the held-out configurations: its JSON result."""
    return legorl_eval(plan.config, [*plan.overrides, f"seed={seed}"], model, plan.held_out, plan.eval_samples, log)


def legorl_eval(
    config: str, overrides: list[str], model: Path, harnesses: list[HarnessSpec], samples: int, log: Path
) -> dict[str, float]:
    """`legorl eval` of `model` on the config's held-out tasks under `harnesses`: its JSON result."""
    specs = [a for s in harnesses for a in ("--harness", s.model_dump_json())]
    args = ["eval", "--config", config, "--model", str(model), "--samples", str(samples), *specs]
    stdout = _legorl([*args, *_sets(overrides)], log)
    lines = stdout.splitlines()
    # The result is the last thing printed, a JSON object opening on a line of its own.
    start = max((i for i, line in enumerate(lines) if line == "{"), default=None)
    if start is None:
        sys.exit(f"legorl eval printed no result; its output: {log}")
    return json.loads("\n".join(lines[start:]))


def latest_weights(run_dir: Path) -> Path:
    weights = run_dir / "weights"
    return weights / (weights / "LATEST").read_text().strip()


def warm_start_model(config: str, overrides: list[str]) -> Path:
    """The model every arm starts from (built once into the cache if it is the demo model)."""
    from legorl_jax.wiring import model_dir  # deferred: loads jax

    return model_dir(load_config(config, overrides), progress=True)


@dataclass
class Result:
    """One evaluated policy: an arm's (or the warm start's) held-out figures at one seed."""

    arm: str
    seed: int
    pass_rate: float
    per_harness: dict[str, float]
    train_trials: int = 0
    seen_pass_rate: float | None = None  # the loop's last evaluation, on the arm's own mix


def result_from_eval(arm: str, seed: int, evaluation: dict[str, float]) -> Result:
    prefix = "eval_pass_rate/"
    per_harness = {k.removeprefix(prefix): v for k, v in evaluation.items() if k.startswith(prefix)}
    return Result(arm, seed, evaluation["eval_pass_rate"], per_harness)


def train_summary(run_dir: Path) -> tuple[int, float | None]:
    """Trials the run spent training, and its last evaluation's pass rate on its own mix."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    trials = sum(int(r.get("rollout/trials", 0)) for r in records if r.get("kind") == "train")
    evals = [r["eval_pass_rate"] for r in records if r.get("kind") == "eval"]
    return trials, (evals[-1] if evals else None)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a (1 seed)"
    return f"sd {_pct(statistics.stdev(values))}, {_pct(min(values))}–{_pct(max(values))}"


def build_table(plan: Plan, results: list[Result]) -> str:
    """Markdown: held-out pass rate (%) per arm and seed with mean and spread, then per held-out configuration."""
    arms = ["warm start", *plan.arms]
    by_arm = {arm: {r.seed: r for r in results if r.arm == arm} for arm in arms}
    missing = [f"{arm}/s{s}" for arm in arms for s in plan.seeds if s not in by_arm[arm]]
    if missing:
        raise ValueError(f"no result for {', '.join(missing)}")
    seeds = " | ".join(f"seed {s}" for s in plan.seeds)
    lines = [
        f"| arm | training configs | trials per run | {seeds} | mean | spread | seen configs (mean) |",
        "|" + " --- |" * (6 + len(plan.seeds)),
    ]
    for arm in arms:
        runs = [by_arm[arm][s] for s in plan.seeds]
        rates = [r.pass_rate for r in runs]
        seen = [r.seen_pass_rate for r in runs if r.seen_pass_rate is not None]
        configs = "–" if arm == "warm start" else str(len(plan.arms[arm]))
        trials = "0" if arm == "warm start" else "/".join(sorted({str(r.train_trials) for r in runs}))
        cells = [arm, configs, trials, *map(_pct, rates), _pct(statistics.mean(rates)), _spread(rates)]
        cells.append(_pct(statistics.mean(seen)) if seen else "–")
        lines.append("| " + " | ".join(cells) + " |")
    config_ids = sorted({c for r in results for c in r.per_harness})
    # Long option sets get a digest for an id in metrics: the table spells them out.
    labels = {
        harness_choice(s).config_id: " ".join([s.name, *(f"{k}={v}" for k, v in sorted(s.options.items()))])
        for s in plan.held_out
    }
    lines += ["", "| held-out configuration | " + " | ".join(arms) + " |", "|" + " --- |" * (1 + len(arms))]
    for config_id in config_ids:
        means = [statistics.mean(by_arm[a][s].per_harness.get(config_id, 0.0) for s in plan.seeds) for a in arms]
        lines.append(f"| `{labels.get(config_id, config_id)}` | " + " | ".join(map(_pct, means)) + " |")
    return "\n".join(lines) + "\n"


def report(plan: Plan, results: list[Result], command: str, wall_s: float) -> str:
    mixes = "\n".join(f"- `{arm}`: `{_mix_json(mix)}`" for arm, mix in plan.arms.items())
    return (
        "# Harness diversity: held-out pass rate (%)\n\n"
        f"Command: `{command}`\n\n"
        f"Budget per run: {plan.steps} steps × {plan.groups_per_step} groups × {plan.group_size} trials "
        f"= {plan.trials_per_run} training trials (dynamic sampling off); evaluation: "
        f"{plan.eval_samples} trial(s) per held-out task and configuration. Wall time {wall_s / 60:.1f} min.\n\n"
        f"Arms:\n{mixes}\n\nHeld out: `{_mix_json(plan.held_out)}`\n\n" + build_table(plan, results)
    )


def clear_runs(runs: list[Path], overwrite: bool, prog: str) -> bool:
    """Removes the run directories of an earlier run with `overwrite`; without it, says which
    one exists and returns False."""
    existing = [r for r in runs if r.exists()]
    if existing and not overwrite:
        print(f"{prog}: {existing[0]} exists: pass --overwrite or another --runs-dir", file=sys.stderr)
        return False
    for run in existing:
        shutil.rmtree(run)
    return True


def main(argv: list[str]) -> int:
    try:
        plan = parse_args(argv)
    except UsageError as exc:
        print(f"exp_harness_diversity: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    runs = [plan.runs_dir / plan.run_name(a, s) for a in plan.arms for s in plan.seeds]
    if not clear_runs(runs, plan.overwrite, PROG):
        return 2
    logs = plan.runs_dir / "logs"
    warm = warm_start_model(plan.config, plan.overrides)
    results: list[Result] = []
    for seed in plan.seeds:
        warm_eval = held_out_eval(plan, warm, seed, logs / f"warm-s{seed}.log")
        results.append(result_from_eval("warm start", seed, warm_eval))
        for arm in plan.arms:
            name = plan.run_name(arm, seed)
            _legorl(
                ["train", "--config", plan.config, "--no-progress", *_sets(train_overrides(plan, arm, seed))],
                logs / f"{name}.train.log",
            )
            run_dir = plan.runs_dir / name
            result = result_from_eval(
                arm, seed, held_out_eval(plan, latest_weights(run_dir), seed, logs / f"{name}.eval.log")
            )
            result.train_trials, result.seen_pass_rate = train_summary(run_dir)
            results.append(result)
    command = shlex.join(["python", "scripts/exp_harness_diversity.py", *argv])
    text = report(plan, results, command, time.monotonic() - started)
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(text)
    plan.out.with_suffix(".json").write_text(json.dumps([r.__dict__ for r in results], indent=2))
    print(text)
    print(f"written to {plan.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
