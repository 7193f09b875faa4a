"""Which groups to roll out next: tasks in shuffled epochs, a harness
configuration per group from the configured mix, in proportion to its weight.

The sampler's whole state is a small cursor (epoch, position) that goes into
every checkpoint, so a resumed run asks for the same tasks it would have.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
from dataclasses import dataclass

from legorl_jax.core.config import Config, HarnessSpec
from legorl_jax.fleet import GroupSpec
from protos.legorl.v1 import rollout_pb2 as pb


@dataclass(frozen=True)
class HarnessChoice:
    name: str
    options_json: str
    config_id: str


def harness_choice(spec: HarnessSpec) -> HarnessChoice:
    options_json = json.dumps(spec.options, sort_keys=True, separators=(",", ":"))
    readable = ",".join(f"{k}={v}" for k, v in sorted(spec.options.items()) if isinstance(v, str | int | float))
    if readable and len(readable) <= 48:
        config_id = f"{spec.name}[{readable}]"
    elif spec.options:
        config_id = f"{spec.name}~{hashlib.sha256(options_json.encode()).hexdigest()[:8]}"
    else:
        config_id = spec.name
    return HarnessChoice(spec.name, options_json, config_id)


def group_spec(
    config: Config,
    task_id: str,
    harness: HarnessChoice,
    group_size: int,
    *,
    policy_version: int,
    step: int,
    seed: int,
) -> GroupSpec:
    """A group of `group_size` trials of one task and harness configuration,
    sampled at `policy_version` from base `seed` (`core.seeds.derive_seed`) and labelled
    with the step it is for (`step` + 1)."""
    sampling = config.rl.sampling
    return GroupSpec(
        task=pb.TaskRef(task_id=task_id),
        harness=pb.HarnessConfig(name=harness.name, options_json=harness.options_json, config_id=harness.config_id),
        group_size=group_size,
        sampling=pb.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=seed,
        ),
        policy_version=policy_version,
        limits=pb.TrialLimits(
            agent_timeout_s=config.fleet.agent_timeout_s,
            verifier_timeout_s=config.fleet.verifier_timeout_s,
        ),
        labels=(("run", config.logging.run_name), ("step", str(step + 1))),
    )


class GroupSampler:
    """Yields (task_id, harness) pairs; every task once per epoch, in a seeded order."""

    def __init__(self, task_ids: list[str], harnesses: list[HarnessSpec], seed: int) -> None:
        if not task_ids:
            raise ValueError("no training tasks: set tasks.train or tasks.demo")
        self.task_ids = sorted(task_ids)
        self.choices = [harness_choice(h) for h in harnesses]
        self.weights = [h.weight for h in harnesses]
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> list[str]:
        order = list(self.task_ids)
        random.Random(f"{self.seed}/tasks/{epoch}").shuffle(order)
        return order

    def _harness(self, index: int) -> HarnessChoice:
        """The harness of the run's `index`-th group. Groups go in cycles of one per configuration,
        each cycle a systematic sample of the weights in a seeded order: equal weights give every
        configuration one group a cycle, so over a short run each trains about as often as its
        weight says (independent draws left seven CLIs 48 to 96 trials apart in 16 steps)."""
        n = len(self.choices)
        draw = random.Random(f"{self.seed}/harness/{index // n}")
        total, offset = sum(self.weights), draw.random()
        bounds = list(itertools.accumulate(w / total for w in self.weights))
        cycle = [self.choices[min(bisect.bisect_right(bounds, (offset + i) / n), n - 1)] for i in range(n)]
        draw.shuffle(cycle)
        return cycle[index % n]

    def next(self) -> tuple[str, HarnessChoice]:
        order = self._order(self.epoch)
        task = order[self.position]
        harness = self._harness(self.epoch * len(order) + self.position)
        self.position += 1
        if self.position == len(order):
            self.epoch, self.position = self.epoch + 1, 0
        return task, harness

    @property
    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, cursor: dict[str, int]) -> None:
        self.epoch = int(cursor.get("epoch", 0))
        self.position = int(cursor.get("position", 0)) % len(self.task_ids)
