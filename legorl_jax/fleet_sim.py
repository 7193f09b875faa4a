"""A discrete-event model of the training loop and its rollout fleet (`legorl_jax.train.loop`, `legorl_jax.fleet`).

Per step the loop collects groups in rounds until `groups_per_step` are informative (dynamic sampling),
updates the learner, publishes and loads the new weights; with `max_policy_lag = k` a producer collects
up to k batches ahead, a batch starting only once the step k+1 before it is done. Groups take
`group_size` slots on the host with the most free ones and hold them until the whole group ends; a failed
host's unfinished trials are re-issued elsewhere. Pure Python (no jax): seeded and deterministic.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import random
import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path


@dataclass(frozen=True)
class TrialTimes:
    """One harness's trial durations (s): whole recorded groups resampled (`groups`: the trials of a group, on
    one task, take alike), else single trials (`samples`), else lognormal(`mu`, `sigma`)."""

    weight: float = 1.0
    groups: tuple[tuple[float, ...], ...] = ()
    samples: tuple[float, ...] = ()
    mu: float = 0.0
    sigma: float = 0.0

    def draw(self, rng: random.Random, n: int) -> list[float]:
        """Durations of `n` trials of one group (or of its re-issued part)."""
        if self.groups:
            group = rng.choice(self.groups)
            return [group[i % len(group)] for i in rng.sample(range(max(n, len(group))), n)]
        if self.samples:
            return [rng.choice(self.samples) for _ in range(n)]
        return [rng.lognormvariate(self.mu, self.sigma) for _ in range(n)]

    @classmethod
    def lognormal_fit(cls, samples: Iterable[float], weight: float = 1.0) -> TrialTimes:
        logs = [math.log(max(s, 1e-3)) for s in samples]
        return cls(weight=weight, mu=statistics.fmean(logs), sigma=statistics.pstdev(logs))


@dataclass(frozen=True)
class SimConfig:
    """What the model takes. Tuples of times are resampled each step (one value: a constant)."""

    harnesses: dict[str, TrialTimes]
    group_size: int = 8
    groups_per_step: int = 8
    p_uninformative: float = 0.0  # chance a group has no reward contrast (all rewards equal)
    max_sampling_rounds: int = 1
    trial_overhead_s: float = 0.0  # per trial, outside agent_s + verify_s (sandbox setup, teardown, RPC)
    learner_s: tuple[float, ...] = (1.0,)
    publish_s: tuple[float, ...] = (0.0,)  # publish + fan-out + reload: the learner waits for it
    max_policy_lag: int = 0
    hosts: int = 1
    capacity_per_host: int = 8
    host_mtbf_s: float = math.inf  # mean time between failures of one host
    host_down_s: float = 60.0  # how long a failed host stays out
    total_steps: int = 10


@dataclass(frozen=True)
class SimResult:
    step_s: float  # mean wall time per step (the whole run over its steps, first rollout included)
    learner_idle: float  # 1 - learner update time / run time
    host_utilisation: float  # trial-running slot time / all slot time
    staleness_mean: float  # token-weighted (tokens spread evenly over a trial) versions behind at train time
    staleness_max: int  # versions behind of the oldest trained token
    wasted_trials: int  # trials of groups dropped for no reward contrast
    reissued_trials: int  # trials lost to a host failure and run again
    trained_groups: list[int] = field(repr=False)  # trials per trained group: group_size each when none is lost


@dataclass
class _Host:
    capacity: int
    busy: int = 0
    alive: bool = True
    attempts: set[_Attempt] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.capacity - self.busy


@dataclass(eq=False)
class _Group:
    batch: _Batch
    harness: TrialTimes
    done: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each trial back


@dataclass(eq=False)
class _Attempt:
    """One request of a group's missing trials to a host: its slots are held until all of them end."""

    group: _Group
    host: _Host
    slots: int
    started: float
    ends: list[tuple[float, float]] = field(default_factory=list)
    live: bool = True


@dataclass(eq=False)
class _Batch:
    pending: int = 0
    rounds: int = 0
    informative: list[_Group] = field(default_factory=list)


class _Sim:
    def __init__(self, cfg: SimConfig, seed: int) -> None:
        self.cfg, self.rng = cfg, random.Random(seed)
        self.now, self._seq = 0.0, itertools.count()
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.hosts = [_Host(cfg.capacity_per_host) for _ in range(cfg.hosts)]
        self.waiting: deque[tuple[_Group, int]] = deque()
        self.names = list(cfg.harnesses)
        self.weights = [cfg.harnesses[n].weight for n in self.names]
        self.version, self.switches = 0, [0.0]  # switches[v]: when the fleet began serving version v
        self.permits, self.collecting = cfg.max_policy_lag + 1, False
        self.held: _Batch | None = None  # a collected batch waiting for room in the queue
        self.ready: deque[_Batch] = deque()
        self.learner_busy = False
        self.steps = self.wasted = self.reissued = 0
        self.learner_total = self.trial_slot_s = 0.0
        self.staleness: list[tuple[float, float]] = []  # (token-weighted staleness, trial time)
        self.max_staleness = 0
        self.trained: list[int] = []
        if math.isfinite(cfg.host_mtbf_s):
            for host in self.hosts:
                self._schedule_failure(host)

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self._seq), fn))

    def run(self) -> SimResult:
        self._produce()
        while self.steps < self.cfg.total_steps:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        slots = self.now * self.cfg.hosts * self.cfg.capacity_per_host
        weighted = sum(s * d for s, d in self.staleness)
        return SimResult(
            step_s=self.now / self.steps,
            learner_idle=1.0 - self.learner_total / self.now,
            host_utilisation=self.trial_slot_s / slots,
            staleness_mean=weighted / max(sum(d for _, d in self.staleness), 1e-12),
            staleness_max=self.max_staleness,
            wasted_trials=self.wasted,
            reissued_trials=self.reissued,
            trained_groups=self.trained,
        )

    # -- the fleet ---------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        # Every waiter re-checks when a slot frees (asyncio.Condition, FIFO): a smaller request may pass a larger.
        still: deque[tuple[_Group, int]] = deque()
        for group, slots in self.waiting:
            live = [h for h in self.hosts if h.alive]
            best = max(live, key=lambda h: h.free) if live else None
            if best is not None and (best.free >= slots or best.busy == 0):
                self._start(group, best, slots)
            else:
                still.append((group, slots))
        self.waiting = still

    def _start(self, group: _Group, host: _Host, slots: int) -> None:
        attempt = _Attempt(group, host, slots, self.now)
        host.busy += slots
        host.attempts.add(attempt)
        for span in group.harness.draw(self.rng, slots):
            self.at(span + self.cfg.trial_overhead_s, partial(self._trial_end, attempt))

    def _trial_end(self, attempt: _Attempt) -> None:
        if not attempt.live:
            return
        attempt.ends.append((attempt.started, self.now))
        self.trial_slot_s += self.now - attempt.started
        if len(attempt.ends) < attempt.slots:
            return
        self._release(attempt)
        attempt.group.done.extend(attempt.ends)
        self._group_end(attempt.group)
        self._dispatch()

    def _release(self, attempt: _Attempt) -> None:
        attempt.live = False
        attempt.host.busy -= attempt.slots
        attempt.host.attempts.discard(attempt)

    def _schedule_failure(self, host: _Host) -> None:
        self.at(self.rng.expovariate(1.0 / self.cfg.host_mtbf_s), partial(self._fail, host))

    def _fail(self, host: _Host) -> None:
        host.alive = False  # the next failure is scheduled when it is back
        for attempt in list(host.attempts):
            # Trials already back were streamed to the fleet and stay; the rest are re-issued.
            self._release(attempt)
            attempt.group.done.extend(attempt.ends)
            missing = attempt.slots - len(attempt.ends)
            self.trial_slot_s += missing * (self.now - attempt.started)  # busy, though the work is lost
            self.reissued += missing
            self.waiting.append((attempt.group, missing))

        def recover() -> None:
            host.alive = True
            self._schedule_failure(host)
            self._dispatch()

        self.at(self.cfg.host_down_s, recover)
        self._dispatch()

    # -- the loop ------------------------------------------------------------------------------------------------

    def _produce(self) -> None:
        if self.collecting or self.held is not None or self.permits == 0:
            return
        self.permits -= 1
        self.collecting = True
        self._round(_Batch())

    def _round(self, batch: _Batch) -> None:
        batch.rounds += 1
        batch.pending = self.cfg.groups_per_step - len(batch.informative)
        for _ in range(batch.pending):
            harness = self.cfg.harnesses[self.rng.choices(self.names, self.weights)[0]]
            self.waiting.append((_Group(batch, harness), self.cfg.group_size))
        self._dispatch()

    def _group_end(self, group: _Group) -> None:
        batch = group.batch
        batch.pending -= 1
        if self.rng.random() < self.cfg.p_uninformative:
            self.wasted += self.cfg.group_size
        else:
            batch.informative.append(group)
        if batch.pending:
            return
        rounds = self.cfg.max_sampling_rounds
        if len(batch.informative) < self.cfg.groups_per_step and batch.rounds < rounds:
            self._round(batch)
            return
        self.collecting = False
        # The queue holds max(lag, 1) batches; a producer finding it full waits with its batch in hand.
        if len(self.ready) < max(self.cfg.max_policy_lag, 1):
            self.ready.append(batch)
            self._produce()
        else:
            self.held = batch
        self._train()

    def _train(self) -> None:
        if self.learner_busy or not self.ready:
            return
        batch = self.ready.popleft()
        if self.held is not None:
            self.ready.append(self.held)
            self.held = None
            self._produce()
        self.learner_busy = True
        for group in batch.informative:
            self.trained.append(len(group.done))
            for start, end in group.done:
                self._staleness(start, end)
        # No informative group after every round: the loop skips the update, but still publishes.
        learner_s = self.rng.choice(self.cfg.learner_s) if batch.informative else 0.0
        self.learner_total += learner_s
        self.at(learner_s, lambda: self.at(self.rng.choice(self.cfg.publish_s), self._published))

    def _staleness(self, start: float, end: float) -> None:
        """Versions behind at train time, for tokens spread evenly over [start, end] (the fleet switches
        version when a publish ends)."""
        oldest = bisect.bisect_right(self.switches, start) - 1
        self.max_staleness = max(self.max_staleness, self.version - oldest)
        span = end - start
        if span <= 0:
            self.staleness.append((self.version - oldest, 0.0))
            return
        behind = 0.0
        for v in range(oldest, bisect.bisect_left(self.switches, end)):
            lo = max(start, self.switches[v])
            hi = min(end, self.switches[v + 1]) if v + 1 < len(self.switches) else end
            behind += max(hi - lo, 0.0) * (self.version - v)
        self.staleness.append((behind / span, span))

    def _published(self) -> None:
        self.version += 1
        self.switches.append(self.now)
        self.steps += 1
        self.learner_busy = False
        self.permits += 1
        self._produce()
        self._train()


def simulate(cfg: SimConfig, seed: int = 0) -> SimResult:
    """Runs the model for `cfg.total_steps` steps."""
    return _Sim(cfg, seed).run()


# -- recorded runs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRun:
    """What a run directory's `rollouts.jsonl` and `metrics.jsonl` give the model."""

    trial_s: dict[str, list[list[float]]]  # harness -> its train groups -> agent_s + verify_s of each trial
    harness_groups: dict[str, int]  # harness -> train groups
    p_uninformative: float
    learner_s: list[float]
    publish_s: list[float]  # publish_s + reload_s
    rollout_s: list[float]
    # (steps, seconds) from the first evaluation's record to the last train record before the next one, by
    # `time/run_s`: the wall time of overlapped steps (lag >= 1), where rollout_s + learner_s double-count.
    window: tuple[int, float] | None

    @property
    def step_s(self) -> float:
        """Measured mean step: rollout + update + publish + reload (eval and logging left out)."""
        return statistics.fmean(
            r + lr + p for r, lr, p in zip(self.rollout_s, self.learner_s, self.publish_s, strict=True)
        )

    @property
    def learner_idle(self) -> float:
        return 1.0 - sum(self.learner_s) / (self.step_s * len(self.learner_s))


def read_run(run_dir: Path) -> RecordedRun:
    durations: dict[str, list[float]] = defaultdict(list)
    rewards: dict[str, list[float]] = defaultdict(list)
    harness_of: dict[str, str] = {}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "train":
            continue
        metrics = record["metrics"]
        durations[record["group"]].append(metrics["agent_s"] + metrics["verify_s"])
        rewards[record["group"]].append(record["reward"])
        harness_of[record["group"]] = record["harness"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in steps if m.get("kind") == "train"]
    window = None
    evals = [i for i, m in enumerate(steps) if m.get("kind") == "eval"]
    if len(evals) >= 2 and all("time/run_s" in m for m in steps):
        last = steps[evals[1] - 1]
        window = (evals[1] - evals[0] - 1, last["time/run_s"] - steps[evals[0]]["time/run_s"])
    trial_s: dict[str, list[list[float]]] = defaultdict(list)
    for group, harness in harness_of.items():
        trial_s[harness].append(durations[group])
    return RecordedRun(
        trial_s=dict(trial_s),
        harness_groups=dict(Counter(harness_of.values())),
        p_uninformative=sum(len(set(r)) == 1 for r in rewards.values()) / len(rewards),
        learner_s=[m["time/learner_s"] for m in train],
        publish_s=[m["time/publish_s"] + m["time/reload_s"] for m in train],
        rollout_s=[m["time/rollout_s"] for m in train],
        window=window,
    )
