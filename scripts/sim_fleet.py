"""The fleet model (`legorl_jax/fleet_sim.py`) checked against recorded demo runs, then projected to Qwen3-8B on v5p-64.

    python scripts/sim_fleet.py [--runs runs] [--steps 40] [--seeds 3]

Calibration: each recorded run's own trial durations (whole groups resampled), dynamic-sampling rate, learner and
publish + reload times, one in-process server of its `capacity_per_server`; simulated mean step and learner idle
against the measured ones. Projection: assumptions in `docs/scale-out.md` ("A simulation of the loop").
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from legorl_jax.fleet_sim import SimConfig, SimResult, TrialTimes, read_run, simulate

CALIBRATION_RUNS = ("demo_embedded", "demo_lora_lr2e-3", "demo_vllm")
# How each was recorded (`./scripts/demo` arguments besides its run name).
RECORD = {
    "demo_embedded": "--config configs/demo.yaml",
    "demo_lora_lr2e-3": "--config configs/demo_lora.yaml",
    "demo_vllm": "--config configs/demo_vllm.yaml",
}
# A demo run at rl.max_policy_lag=1, total_steps=6 (configs/demo.yaml otherwise), when there is one.
LAG_RUNS = {"demo_lag1": 1}
# Sandbox setup, teardown and the RPC: outside a record's agent_s + verify_s. Fitted on demo_embedded (its step
# time matched within 2 %), then used unchanged on the other runs.
TRIAL_OVERHEAD_S = 1.5
# Qwen3-8B on v5p-64: docs/learner_hardware.md's planned step for configs/qwen3_8b_v5p.yaml (16.8M tokens).
LEARNER_S = 119.0
# Weight sync per step, docs/scale-out.md: a full bf16 publish + fetch + reload (33 s), or a delta over the relay
# chain, where the hosts' own write + reload remain (~8 s).
FULL_SYNC_S, DELTA_SYNC_S = 33.0, 8.0
TRIAL_MEDIAN_S = 150.0  # docs/scale-out.md: 4k generated tokens at ~40 tokens/s per sequence + ~60 s of tools
HOSTS = (8, 32, 128)
LAGS = (0, 1, 2)
CAPACITY = 32  # trials in flight per server in the table (docs/scale-out.md: 24-48 for Qwen3-8B on one H100)
CAPACITY_LADDER = (8, 16, 32, 64, 128)


def averaged(cfg: SimConfig, seeds: int) -> dict[str, float]:
    runs: list[SimResult] = [simulate(cfg, seed) for seed in range(seeds)]
    return {
        "step_s": statistics.fmean(r.step_s for r in runs),
        "idle": statistics.fmean(r.learner_idle for r in runs),
        "util": statistics.fmean(r.host_utilisation for r in runs),
        "stale_mean": statistics.fmean(r.staleness_mean for r in runs),
        "stale_max": max(r.staleness_max for r in runs),
        "wasted": statistics.fmean(r.wasted_trials for r in runs) / cfg.total_steps,
    }


def calibrate(runs_dir: Path, seeds: int) -> dict[str, float]:
    """Prints simulated vs measured per recorded run; returns each run's lognormal sigma of trial durations."""
    print(
        "| run | lag | measured step (s) | simulated | error | measured learner idle | simulated | p(uninformative) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    sigmas: dict[str, float] = {}
    lags = {name: 0 for name in CALIBRATION_RUNS} | {n: lag for n, lag in LAG_RUNS.items() if (runs_dir / n).is_dir()}
    for name, lag in lags.items():
        rec = read_run(runs_dir / name)
        # Lag 0: the sum of a step's recorded parts, over all steps. Lag >= 1 overlaps them: the wall time of the
        # steps before the second evaluation, simulated over as many steps.
        steps, step_s, idle = len(rec.learner_s), rec.step_s, rec.learner_idle
        if lag:
            assert rec.window is not None, f"{name}: no time/run_s to measure overlapped steps by"
            steps, window_s = rec.window
            step_s, idle = window_s / steps, 1 - sum(rec.learner_s[:steps]) / window_s
        harnesses = {
            h: TrialTimes(weight=rec.harness_groups[h], groups=tuple(map(tuple, groups)))
            for h, groups in rec.trial_s.items()
        }
        cfg = SimConfig(
            harnesses=harnesses,
            group_size=4,
            groups_per_step=8,
            p_uninformative=rec.p_uninformative,
            max_sampling_rounds=2,
            trial_overhead_s=TRIAL_OVERHEAD_S,
            learner_s=tuple(rec.learner_s),
            publish_s=tuple(rec.publish_s),
            max_policy_lag=lag,
            hosts=1,
            capacity_per_host=8,
            total_steps=steps if lag else 500,  # lag 0: long, so the resampling's mean is the recorded one
        )
        sim = averaged(cfg, 100 * seeds if lag else seeds)
        error = sim["step_s"] / step_s - 1
        print(
            f"| {name} | {lag} | {step_s:.1f} | {sim['step_s']:.1f} | {error:+.1%} | {idle:.3f} "
            f"| {sim['idle']:.3f} | {rec.p_uninformative:.2f} |"
        )
        sigmas[name] = TrialTimes.lognormal_fit(t for groups in rec.trial_s.values() for g in groups for t in g).sigma
    return sigmas


def project(sigma: float, p_uninformative: float, rounds: int, publish_s: float, steps: int, seeds: int) -> None:
    trials = TrialTimes(mu=math.log(TRIAL_MEDIAN_S), sigma=sigma)

    def config(hosts: int, lag: int, capacity: int) -> SimConfig:
        # configs/qwen3_8b_v5p.yaml: G = 8, B = 64, dynamic sampling (the default: 4 rounds).
        return SimConfig(
            harnesses={"all": trials},
            group_size=8,
            groups_per_step=64,
            p_uninformative=p_uninformative,
            max_sampling_rounds=rounds,
            learner_s=(LEARNER_S,),
            publish_s=(publish_s,),
            max_policy_lag=lag,
            hosts=hosts,
            capacity_per_host=capacity,
            total_steps=steps,
        )

    print(
        f"\ntrials lognormal, median {TRIAL_MEDIAN_S:.0f} s, sigma {sigma:.2f}; p(uninformative) {p_uninformative:.2f},"
        f" {rounds} sampling round(s); sync {publish_s:.0f} s; learner {LEARNER_S} s; capacity {CAPACITY} per server"
    )
    print("| servers | lag | step (s) | learner idle | host util | staleness mean / max | wasted trials/step "
          "| capacity for idle <= 10 % |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for hosts in HOSTS:
        for lag in LAGS:
            sim = averaged(config(hosts, lag, CAPACITY), seeds)
            enough = next(
                (c for c in CAPACITY_LADDER if averaged(config(hosts, lag, c), seeds)["idle"] <= 0.10),
                None,
            )
            print(
                f"| {hosts} | {lag} | {sim['step_s']:.0f} | {sim['idle']:.0%} | {sim['util']:.0%} "
                f"| {sim['stale_mean']:.2f} / {sim['stale_max']} | {sim['wasted']:.0f} "
                f"| {enough if enough is not None else f'none up to {CAPACITY_LADDER[-1]}'} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="directory holding the recorded demo runs")
    parser.add_argument("--steps", type=int, default=40, help="simulated steps per projected run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds averaged per figure")
    args = parser.parse_args()
    missing = [name for name in CALIBRATION_RUNS if not (args.runs / name / "metrics.jsonl").is_file()]
    if missing:
        recipes = "\n".join(f"  ./scripts/demo {RECORD[name]} --set logging.run_name={name}" for name in missing)
        raise SystemExit(
            f"sim_fleet: no recorded run {', '.join(missing)} under {args.runs}; record them with\n{recipes}"
        )
    sigmas = calibrate(args.runs, args.seeds)
    p_uninformative = statistics.fmean(read_run(args.runs / name).p_uninformative for name in CALIBRATION_RUNS)
    # As configured (the embedded demo's tail, retry rounds, full sync); then the vLLM demo's shorter tail; then
    # that without retry rounds and with delta sync: what is left when the rounds' tails are gone.
    project(sigmas["demo_embedded"], p_uninformative, 4, FULL_SYNC_S, args.steps, args.seeds)
    project(sigmas["demo_vllm"], p_uninformative, 4, FULL_SYNC_S, args.steps, args.seeds)
    project(sigmas["demo_vllm"], p_uninformative, 1, DELTA_SYNC_S, args.steps, args.seeds)


if __name__ == "__main__":
    main()
