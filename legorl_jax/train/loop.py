"""`legorl train`: the main job.

Start-up loads the policy (or restores the newest Orbax checkpoint), publishes
its weights *before* the first rollout and loads them on every rollout server.
Each step then rolls out groups until `groups_per_step` of them carry reward
contrast (dynamic sampling), runs one GRPO update, checkpoints on the every-K
policy, publishes the new weights and loads them on the fleet. Evaluation runs
at step 0, every `tasks.eval_every` steps and at the end.

With `rl.max_policy_lag = k > 0`, rollouts for the next steps run while the
learner trains (up to k batches ahead); sequences sampled by a policy more
than k versions old are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import jax

from legorl_jax.config import REPO_ROOT, Config, dump_config
from legorl_jax.fleet import Fleet, GroupResult, GroupSpec
from legorl_jax.train.assemble import assemble, is_informative, rollout_metrics
from legorl_jax.train.groups import GroupSampler, HarnessChoice, harness_choice
from legorl_jax.train.publish import DirectoryPublisher, WeightSubscribers, publish_weights
from legorl_jax.train.rollout_log import RolloutLog
from legorl_jax.train.run_log import RunLog
from protos.legorl.v1 import rollout_pb2 as pb

log = logging.getLogger(__name__)

@dataclass
class Batch:
    groups: list[GroupResult]
    rollout_s: float
    policy_version: int


def run_directory(config: Config) -> Path:
    return Path(config.logging.run_dir) / config.logging.run_name


def task_ids(config: Config, split: str) -> list[str]:
    """The ids of the configured training or evaluation tasks (`split` "train" or "eval")."""
    from rollout_server.demo_families import demo_task_splits
    from rollout_server.tasks import load_tasks

    tasks = load_tasks(config.tasks.train if split == "train" else config.tasks.eval)
    if config.tasks.demo:
        tasks.extend(demo_task_splits(config.tasks.demo_variants)[split])
    return [t.name for t in tasks]


class Trainer:
    def __init__(self, config: Config, *, progress: bool | None = None) -> None:
        self.config = config
        self.run_dir = run_directory(config)
        self.progress = config.logging.progress if progress is None else progress
        self.version = 0
        self.step = 0
        self.rollouts: RolloutLog | None = None  # set by run(); `legorl eval` keeps no rollout log

    # ---------------------------------------------------------------- setup --

    def _model_dir(self) -> Path:
        if self.config.model.path is not None:
            return Path(self.config.model.path)
        from legorl_jax.train.demo_model import ensure_demo_model

        cache = Path(os.environ.get("LEGORL_CACHE", REPO_ROOT / ".cache"))
        return ensure_demo_model(cache / "demo_model", progress=self.progress)

    def _build_learner(self, model_dir: Path):
        from legorl_jax.models import from_hf
        from legorl_jax.train.sharding import learner_mesh
        from legorl_jax.train.step import Learner

        cfg = self.config
        mesh = learner_mesh(cfg.learner.mesh)
        model = from_hf(
            model_dir,
            dtype=cfg.model.param_dtype,
            compute_dtype=cfg.model.compute_dtype,
            remat=cfg.model.remat,
            attention_kernel=cfg.model.attention_kernel,
            mesh=mesh,
        )
        return Learner(model, cfg.rl, cfg.learner, mesh)

    @contextlib.asynccontextmanager
    async def fleet_session(self, first_weights: Path) -> AsyncIterator[Fleet]:
        """The configured fleet, or one rollout server in this process."""
        cfg = self.config.fleet
        server = None
        addresses = list(cfg.servers)
        if not addresses:
            from rollout_server.server import RolloutServer

            server = RolloutServer(self.config, first_weights, address="127.0.0.1:0")
            addresses = [await server.start()]
        try:
            async with Fleet(
                addresses, max_retries=cfg.max_retries, rpc_timeout_s=cfg.rpc_timeout_s, security=cfg.security
            ) as fleet:
                yield fleet
        finally:
            if server is not None:
                await server.stop(grace_s=30)

    # ------------------------------------------------------------- rollouts --

    def _spec(self, task_id: str, harness: HarnessChoice, group_size: int) -> GroupSpec:
        sampling = self.config.rl.sampling
        return GroupSpec(
            task=pb.TaskRef(task_id=task_id),
            harness=pb.HarnessConfig(name=harness.name, options_json=harness.options_json, config_id=harness.config_id),
            group_size=group_size,
            sampling=pb.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                seed=self.config.seed,
            ),
            policy_version=self.version,
            limits=pb.TrialLimits(
                agent_timeout_s=self.config.fleet.agent_timeout_s,
                verifier_timeout_s=self.config.fleet.verifier_timeout_s,
            ),
            labels=(("run", self.config.logging.run_name), ("step", str(self.step + 1))),
        )

    async def _collect(self, fleet: Fleet, sampler: GroupSampler) -> Batch:
        rl = self.config.rl
        started, version = time.monotonic(), self.version
        groups: list[GroupResult] = []
        informative = 0
        for _ in range(rl.max_sampling_rounds if rl.dynamic_sampling else 1):
            specs = [self._spec(*sampler.next(), rl.group_size) for _ in range(rl.groups_per_step - informative)]
            async for group in fleet.rollout(specs):
                groups.append(group)
                informative += is_informative(group)
            if informative >= rl.groups_per_step:
                break
        return Batch(groups, time.monotonic() - started, version)

    async def evaluate(self, fleet: Fleet, eval_ids: list[str], choices: list[HarnessChoice]) -> dict[str, float]:
        specs = [self._spec(task, choice, 1) for task in eval_ids for choice in choices]
        groups = [g async for g in fleet.rollout(specs)]
        metrics = rollout_metrics(groups)
        if self.rollouts is not None:
            await asyncio.to_thread(self.rollouts.write, self.step, "eval", [t for g in groups for t in g.trajectories])
        out = {"eval_pass_rate": metrics.get("pass_rate", 0.0), "eval_reward": metrics.get("reward/mean", 0.0)}
        out.update({f"eval_{k}": v for k, v in metrics.items() if k.startswith("pass_rate/")})
        return out

    # ----------------------------------------------------------------- loop --

    async def run(self) -> Path:
        from legorl_jax.train.checkpoint import Checkpointer

        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        model_dir = await asyncio.to_thread(self._model_dir)  # the demo model's build runs an event loop of its own
        learner = await asyncio.to_thread(self._build_learner, model_dir)
        checkpoints = Checkpointer(self.run_dir / "checkpoints", cfg.learner.checkpoint)
        rng = jax.random.key(cfg.seed)
        train_ids = task_ids(cfg, "train")
        eval_ids = task_ids(cfg, "eval")
        if not eval_ids:
            log.warning("no held-out tasks configured: evaluating on the training tasks")
            eval_ids = train_ids
        choices = [harness_choice(h) for h in cfg.harness_mix.harnesses]
        sampler = GroupSampler(train_ids, cfg.harness_mix.harnesses, cfg.seed)
        restored = checkpoints.restore_latest(learner)
        if restored is not None:
            self.step, self.version, rng = restored.step, restored.policy_version, restored.rng
            sampler.restore(restored.cursor.get("sampler", {}))
            log.info("resumed from checkpoint at step %d (policy version %d)", self.step, self.version)
        runlog = RunLog(self.run_dir, resume_step=self.step, tensorboard=cfg.logging.tensorboard)
        self.rollouts = RolloutLog(self.run_dir, model_dir, resume_step=self.step)
        weights_dir = cfg.fleet.weights_dir or self.run_dir / "weights"
        # The engines sample in the learner's compute dtype: publishing in it halves the bytes of f32 masters.
        publisher = DirectoryPublisher(
            weights_dir, keep=3, tokenizer_from=model_dir, dtype=cfg.model.compute_dtype,
            full_every=cfg.fleet.weights_full_every,
        )
        # Step-0 rollouts must see the learner's real weights: publish before any rollout.
        location = await asyncio.to_thread(publisher.publish, learner.model(), self.version)
        progress = _progress(cfg.total_steps, self.step, self.progress)
        try:
            async with self.fleet_session(Path(location.removeprefix("file://"))) as fleet:
                subscribers = self._subscribers(fleet)
                await subscribers.update_weights(self.version, location)
                if self.step == 0:
                    runlog.write({"step": 0, "kind": "eval", **await self.evaluate(fleet, eval_ids, choices)})
                await self._steps(
                    fleet, subscribers, sampler, learner, checkpoints, publisher, runlog, rng, eval_ids, choices,
                    progress,
                )
                if self.step % cfg.tasks.eval_every != 0:
                    runlog.write({"step": self.step, "kind": "eval", **await self.evaluate(fleet, eval_ids, choices)})
        finally:
            progress.close()
            checkpoints.wait()
            checkpoints.close()
            runlog.close()
        from legorl_jax.train.plot import plot_run

        plot_run(self.run_dir)
        return self.run_dir

    @staticmethod
    async def _next_batch(ahead: asyncio.Queue[Batch], producer: asyncio.Task[None]) -> Batch:
        """The next collected batch, or the producer's error if it died first."""
        get = asyncio.ensure_future(ahead.get())
        await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            producer.result()  # raises what killed it
        return get.result()

    def _subscribers(self, fleet: Fleet) -> WeightSubscribers:
        if self.config.fleet.weights_transport == "location":
            return fleet
        from legorl_jax.train.weight_stream import WeightStreamer

        return WeightStreamer(fleet.addresses, security=fleet.security, relay=self.config.fleet.weights_relay)

    async def _steps(
        self, fleet, subscribers, sampler, learner, checkpoints, publisher, runlog, rng, eval_ids, choices, progress
    ):
        cfg = self.config
        lag = cfg.rl.max_policy_lag
        ahead: asyncio.Queue[Batch] = asyncio.Queue(maxsize=max(lag, 1))
        # The batch for step s may start only once step s-1-lag is done, so every
        # sequence in it is at most `lag` versions old when trained on; the queue
        # alone lets a producer faster than the learner run lag+1 batches ahead.
        may_start = asyncio.Semaphore(lag + 1)
        producer = None
        if lag > 0:

            async def produce() -> None:
                while True:
                    await may_start.acquire()
                    await ahead.put(await self._collect(fleet, sampler))

            producer = asyncio.create_task(produce())
        try:
            while self.step < cfg.total_steps:
                batch = await (self._next_batch(ahead, producer) if producer else self._collect(fleet, sampler))
                assembled = assemble(batch.groups, cfg.rl.advantage, min_policy_version=self.version - lag)
                started = time.monotonic()
                if assembled.sequences:
                    metrics = await asyncio.to_thread(lambda: learner.train_step(learner.pack(assembled.sequences)))
                else:
                    metrics = {"skipped_update": 1.0}  # no group had reward contrast after every retry
                    learner.step += 1
                learner_s = time.monotonic() - started
                self.step = learner.step
                # The version moves once the fleet serves it: a rollout started meanwhile
                # (lag > 0) must not ask for weights no server has loaded yet.
                published = await publish_weights(publisher, subscribers, learner.model(), self.version + 1)
                self.version = published.version
                may_start.release()
                cursor = {"sampler": sampler.cursor}
                checkpoints.save(learner, policy_version=self.version, rng=rng, cursor=cursor)
                record = {
                    "step": self.step,
                    "kind": "train",
                    "policy_version": self.version,
                    **assembled.metrics,
                    **{k: v for k, v in metrics.items() if k != "step"},
                    "time/rollout_s": batch.rollout_s,
                    "time/learner_s": learner_s,
                    "time/publish_s": published.publish_s,
                    "time/reload_s": published.load_s,
                    "throughput/tokens_per_s": assembled.metrics.get("rollout/completion_tokens", 0.0)
                    / max(batch.rollout_s, 1e-9),
                }
                runlog.write(record)
                # Decoding every sampled span takes a while at scale: off the loop, where the next batch's
                # rollouts (lag > 0) are being collected.
                trajectories = [t for g in batch.groups for t in g.trajectories]
                await asyncio.to_thread(self.rollouts.write, self.step, "train", trajectories, assembled.sequences)
                runlog.show(record, progress.write)
                progress.update(1)
                progress.set_postfix(reward=f"{record.get('reward/mean', 0.0):.3f}")
                if self.step % cfg.tasks.eval_every == 0:
                    evaluation = await self.evaluate(fleet, eval_ids, choices)
                    runlog.write({"step": self.step, "kind": "eval", **evaluation})
                    progress.write(f"eval @ step {self.step}: pass rate {evaluation['eval_pass_rate']:.3f}")
            if checkpoints.latest_step() != learner.step:
                checkpoints.save(learner, policy_version=self.version, rng=rng, cursor={"sampler": sampler.cursor}, force=True)
        finally:
            if producer is not None:
                producer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await producer


def _progress(total: int, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)
