"""The fleet model against closed forms; the recorded-run reader on a tiny run."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from legorl_jax.fleet_sim import SimConfig, TrialTimes, read_run, simulate

T, L, P = 10.0, 3.0, 2.0  # trial, learner update, publish


def constant(trial_s: float = T, **kw) -> SimConfig:
    """Constant times; one host that fits every trial of a step at once."""
    base = SimConfig(
        harnesses={"h": TrialTimes(samples=(trial_s,))},
        group_size=4,
        groups_per_step=3,
        learner_s=(L,),
        publish_s=(P,),
        hosts=1,
        capacity_per_host=12,
        total_steps=5,
    )
    return replace(base, **kw)


def test_same_seed_same_run_and_another_seed_another():
    cfg = SimConfig(
        harnesses={"a": TrialTimes(mu=1.0, sigma=0.5), "b": TrialTimes(samples=(1.0, 5.0), weight=2.0)},
        p_uninformative=0.3,
        max_sampling_rounds=3,
        max_policy_lag=1,
        hosts=3,
        capacity_per_host=8,
        host_mtbf_s=200.0,
        host_down_s=20.0,
        total_steps=20,
    )
    assert simulate(cfg, seed=7) == simulate(cfg, seed=7)
    assert simulate(cfg, seed=7).step_s != simulate(cfg, seed=8).step_s


def test_lag_0_step_is_rollout_plus_update_plus_publish():
    result = simulate(constant())
    assert result.step_s == pytest.approx(T + L + P)
    assert result.learner_idle == pytest.approx(1 - L / (T + L + P))
    assert result.host_utilisation == pytest.approx(T / (T + L + P))
    assert (result.staleness_mean, result.staleness_max) == (0.0, 0)


@pytest.mark.parametrize(
    ("trial_s", "step_s"),
    [
        (T, T + (L + P) / 5),  # rollout-bound: a batch every T, the last update after the last batch
        (1.0, L + P + 1.0 / 5),  # learner-bound: only the first batch is waited for
    ],
)
def test_lag_1_overlaps_rollouts_with_the_update(trial_s: float, step_s: float):
    result = simulate(constant(trial_s, max_policy_lag=1))
    assert result.step_s == pytest.approx(step_s)
    assert result.staleness_max == 1


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_staleness_never_exceeds_the_lag(lag: int):
    cfg = constant(harnesses={"h": TrialTimes(mu=0.0, sigma=1.0)}, max_policy_lag=lag, total_steps=30)
    result = simulate(cfg, seed=3)
    assert 0 < result.staleness_mean <= result.staleness_max <= lag


def test_host_failures_slow_the_run_and_lose_no_trial():
    calm = constant(hosts=4, capacity_per_host=4, total_steps=30)
    failing = replace(calm, host_mtbf_s=60.0, host_down_s=15.0)
    before, after = simulate(calm), simulate(failing, seed=1)
    assert after.reissued_trials > 0
    assert after.step_s > before.step_s
    assert after.trained_groups == [4] * (3 * 30)


def test_groups_without_contrast_are_retried_then_wasted():
    result = simulate(constant(p_uninformative=1.0, max_sampling_rounds=3))
    # Every round re-asks all three groups; none is ever trained on, so each update is skipped.
    assert result.wasted_trials == 5 * 3 * 3 * 4
    assert result.trained_groups == []
    assert result.step_s == pytest.approx(3 * T + P)
    assert result.learner_idle == 1.0


def test_a_small_host_queues_groups():
    # Capacity for one group at a time: three groups run one after another.
    assert simulate(constant(capacity_per_host=4)).step_s == pytest.approx(3 * T + L + P)


def test_read_run(tmp_path: Path):
    trials = [
        ("g1", "lego", 1.0, 2.0, 0.0),
        ("g1", "lego", 3.0, 1.0, 1.0),
        ("g2", "cli", 5.0, 0.5, 1.0),
        ("g2", "cli", 4.0, 0.5, 1.0),
    ]
    rollouts = [
        {"kind": "train", "group": g, "harness": h, "reward": r, "metrics": {"agent_s": a, "verify_s": v}}
        for g, h, a, v, r in trials
    ] + [{"kind": "eval", "group": "g3", "harness": "lego", "reward": 0.0, "metrics": {"agent_s": 9, "verify_s": 9}}]
    step = {"kind": "train", "time/rollout_s": 6.0, "time/learner_s": 3.0, "time/publish_s": 0.5, "time/reload_s": 0.5}
    metrics = [
        {"kind": "eval", "time/run_s": 1.0},
        {**step, "time/run_s": 12.0},
        {**step, "time/run_s": 23.0},
        {"kind": "eval", "time/run_s": 30.0},
    ]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    run = read_run(tmp_path)
    assert run.trial_s == {"lego": [[3.0, 4.0]], "cli": [[5.5, 4.5]]}
    assert run.harness_groups == {"lego": 1, "cli": 1}
    assert run.p_uninformative == 0.5  # g2's rewards are all equal
    assert (run.step_s, run.learner_idle) == (10.0, 0.7)
    assert run.window == (2, 22.0)


def test_lognormal_fit_recovers_median_and_spread():
    fit = TrialTimes.lognormal_fit([math.e, math.e**3])
    assert (fit.mu, fit.sigma) == pytest.approx((2.0, 1.0))
