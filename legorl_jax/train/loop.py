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

On several processes (`jax.distributed`, docs/multihost.md) this is one job:
process 0 builds the model, drives the fleet, evaluates and writes the run's
records; the others wait for its word (`coordination.ProcessGroup`), and all
of them load the same model, restore the same checkpoint, train on the same
batch, publish (process 0 writes) and checkpoint together.

The learner's long host-side work (building the learner, each update, each
publish) runs in a thread the trainer owns (`LearnerThread`): a stop cancels
the loop's wait on it, not the work, and `Trainer.busy` tells `legorl train`
that it still runs, so the command can leave without waiting for it. What such
an exit cuts short is redone on resume: the step goes back to the last
checkpoint, and a publish cut short left only a staging directory, never
`LATEST` on an unfinished version.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from legorl_jax.core.config import Config, ConfigError, dump_config
from legorl_jax.core.files import replace_text
from legorl_jax.core.seeds import derive_seed
from legorl_jax.fleet import Fleet, GroupResult, LocalServer, configured_fleet
from legorl_jax.models import CausalLM, from_hf
from legorl_jax.models.lora import add_adapters
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.assemble import assemble, is_informative
from legorl_jax.train.checkpoint import Checkpointer
from legorl_jax.train.coordination import ProcessGroup, digest, directory_digest
from legorl_jax.train.evaluate import evaluate
from legorl_jax.train.groups import GroupSampler, HarnessChoice, group_spec, harness_choice
from legorl_jax.train.harness_table import write_harness_table
from legorl_jax.train.plot import plot_run
from legorl_jax.train.publish import (
    DirectoryPublisher,
    PublishReport,
    PublishStats,
    WeightSubscribers,
    publish_weights,
)
from legorl_jax.train.rollout_log import RolloutLog
from legorl_jax.train.run_log import SFT_MODEL_DIR, SFT_RUN_FILE, RunLog
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner
from legorl_jax.train.weight_stream import WeightStreamer

log = logging.getLogger(__name__)
T = TypeVar("T")
_BAR = "train"  # the steps' bar's name; while a batch is collected it counts the groups too


@dataclass(frozen=True)
class _StepOrder:
    """Process 0's word on a step: the sequences every process trains on (none: the
    update is skipped) and whether the learner's logprobs are wanted back."""

    sequences: list[TrainSequence]
    keep_logprobs: bool


@dataclass(frozen=True)
class _SaveOrder:
    """Process 0's word on a step's checkpoint: what every process saves with it."""

    policy_version: int
    cursor: dict
    force: bool


@dataclass
class Batch:
    groups: list[GroupResult]
    rollout_s: float
    policy_version: int


def run_directory(config: Config) -> Path:
    return Path(config.logging.run_dir) / config.logging.run_name


@dataclass(frozen=True)
class RunInputs:
    """What the loop takes from outside the learner (`legorl_jax.wiring` builds
    it): the model directory to start from (built on first use, so a callable),
    the task ids of a split ("train" or "eval"), and a rollout server started
    in this process on given weights, yielding its address, for a config that
    lists no servers."""

    model_dir: Callable[[], Path]
    task_ids: Callable[[Literal["train", "eval"]], list[str]]
    local_server: LocalServer


@dataclass
class _Run:
    """What process 0 holds while it steps: the fleet and what publishes to it,
    the task sampler, the learner and its checkpoints, the logs, the evaluation set."""

    fleet: Fleet
    subscribers: WeightSubscribers
    sampler: GroupSampler
    learner: Learner
    checkpoints: Checkpointer
    publisher: DirectoryPublisher
    runlog: RunLog
    rng: jax.Array
    eval_ids: list[str]
    choices: list[HarnessChoice]
    progress: tqdm


class LearnerThread(ThreadPoolExecutor):
    """One thread for the learner's long host-side work, which knows whether any of it still runs
    (`busy`): cancelling an `await` on it stops the waiting, not the work."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="legorl-learner")
        self._unfinished: set[Future[Any]] = set()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future = super().submit(fn, *args, **kwargs)
        self._unfinished.add(future)
        future.add_done_callback(self._unfinished.discard)
        return future

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in list(self._unfinished))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the thread, in this task's context (as `asyncio.to_thread`)."""
        return await asyncio.get_running_loop().run_in_executor(self, contextvars.copy_context().run, fn, *args)


class _NoSubscribers:
    """The other processes' side of a publish: they help gather the weights; process 0 loads them on the fleet."""

    def __init__(self) -> None:
        self.probe_diffs: dict[str, float] = {}

    async def update_weights(self, version: int, location: str) -> dict[str, int]:
        return {}


def policy_model(config: Config, model_dir: Path, mesh: Mesh) -> CausalLM:
    """The model the learner trains: the checkpoint, with the config's adapters when it has them."""
    model = from_hf(
        model_dir,
        dtype=config.model.param_dtype,
        compute_dtype=config.model.compute_dtype,
        remat=config.model.remat,
        attention_kernel=config.model.attention_kernel,
        mesh=mesh,
    )
    lora = config.model.lora
    if lora is not None:
        adapted = add_adapters(
            model, rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets), seed=config.seed, mesh=mesh
        )
        log.info("LoRA rank %d on %d projections; the base stays frozen", lora.rank, len(adapted))
    return model


class Trainer:
    def __init__(self, config: Config, inputs: RunInputs, *, progress: bool | None = None) -> None:
        self.config = config
        self.inputs = inputs
        self.run_dir = run_directory(config)
        if config.rl.loss == "nll":
            raise ConfigError("rl.loss: nll is legorl sft's loss (no advantage, no ratio); RL trains with another")
        if (self.run_dir / SFT_RUN_FILE).exists():  # its checkpoints would be resumed as this run's
            raise ConfigError(
                f"logging.run_name: {self.run_dir} holds a `legorl sft` run; name another "
                f"(to start from its model, set model.path={self.run_dir / SFT_MODEL_DIR})"
            )
        # A gs:// URL stays a string: a Path would turn it into a local `gs:/...` directory.
        self.checkpoint_dir: str | Path = config.learner.checkpoint.directory or self.run_dir / "checkpoints"
        self.progress = config.logging.progress if progress is None else progress
        self.version = 0
        self.step = 0
        self.rollouts: RolloutLog | None = None  # set by run() on process 0
        self.group: ProcessGroup | None = None  # set by run()
        self.worker = LearnerThread()  # a fresh one each run()

    @property
    def busy(self) -> bool:
        """Whether an update or a publish (or the learner's build) still runs: after a stop, one
        whose wait was cancelled."""
        return self.worker.busy

    # ---------------------------------------------------------------- setup --

    def _build_learner(self, model_dir: Path):
        mesh = learner_mesh(self.config.learner.mesh)
        return Learner(policy_model(self.config, model_dir, mesh), self.config.rl, self.config.learner, mesh)

    def fleet_session(self, model_dir: Path) -> contextlib.AbstractAsyncContextManager[Fleet]:
        """The configured fleet, or one rollout server in this process serving the run's
        model directory (the published versions come and go: keep-N prunes them, and an
        engine restarted after that needs its tokenizer and served name still there)."""
        return configured_fleet(self.config.fleet, self.inputs.local_server, model_dir)

    # ------------------------------------------------------------- rollouts --

    async def _collect(self, fleet: Fleet, sampler: GroupSampler, bar: tqdm) -> Batch:
        rl = self.config.rl
        started, version = time.monotonic(), self.version
        groups: list[GroupResult] = []
        informative = asked = 0
        for round_ in range(rl.max_sampling_rounds if rl.dynamic_sampling else 1):
            # Seeded by place (step, round, index): a run with the same seed samples the same groups.
            specs = [
                group_spec(self.config, *sampler.next(), rl.group_size, policy_version=self.version, step=self.step,
                           seed=derive_seed(self.config.seed, "train", self.step, round_, index))
                for index in range(rl.groups_per_step - informative)
            ]  # fmt: skip
            asked += len(specs)
            ended = await rolled_out(fleet.rollout(specs), bar, len(groups), asked)
            # In the order asked for, not the order the groups ended in: the same seed, the same batch.
            place = {id(spec): i for i, spec in enumerate(specs)}
            ended.sort(key=lambda group: place[id(group.spec)])
            groups.extend(ended)
            informative += sum(map(is_informative, ended))
            if informative >= rl.groups_per_step:
                break
        bar.set_description(_BAR)
        return Batch(groups, time.monotonic() - started, version)

    async def _evaluate(self, run: _Run) -> float:
        """Evaluates the policy the fleet serves into the run log; returns its pass rate."""
        metrics = await evaluate(
            run.fleet,
            self.config,
            run.eval_ids,
            run.choices,
            policy_version=self.version,
            step=self.step,
            rollouts=self.rollouts,
            progress=self.progress,
        )
        run.runlog.write({"step": self.step, "kind": "eval", **metrics})
        return metrics["eval_pass_rate"]

    # ----------------------------------------------------------------- loop --

    async def run(self) -> Path:
        """Trains to `total_steps` and returns the run directory (every process returns it)."""
        group = self.group = ProcessGroup()
        self.worker = LearnerThread()
        if group.count > 1:
            log.info("%s: %d local devices of %d", group, jax.local_device_count(), jax.device_count())
        try:
            return await _first_failure(self._run(group), group.watch())
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            # The others wait on process 0's word, or it on theirs: say the run is over, or they wait
            # for a heartbeat timeout.
            group.report_failure(reason)
            await group.abort(reason)
            raise
        finally:
            self.worker.shutdown(wait=False)  # what still runs goes on: `busy` says so

    async def _model_dir(self, group: ProcessGroup) -> Path:
        """The starting model, built by process 0 first; the others then find it (shared
        storage) or build their own, and every process must hold the same files."""
        # In a thread: building the demo model runs an event loop of its own.
        model_dir = await asyncio.to_thread(self.inputs.model_dir) if group.is_leader else None
        await group.share("model ready")
        if model_dir is None:
            model_dir = await asyncio.to_thread(self.inputs.model_dir)
        if group.count > 1:
            await asyncio.to_thread(group.agree, f"the starting model ({model_dir})", directory_digest(model_dir))
        return model_dir

    async def _run(self, group: ProcessGroup) -> Path:
        cfg = self.config
        if group.is_leader:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            replace_text(self.run_dir / "config.yaml", dump_config(cfg))
        model_dir = await self._model_dir(group)
        learner = await self.worker.run(self._build_learner, model_dir)
        checkpoints = Checkpointer(self.checkpoint_dir, cfg.learner.checkpoint)
        rng = jax.random.key(cfg.seed)
        restored = checkpoints.restore_latest(learner)
        cursor: dict = {}
        if restored is not None:
            self.step, self.version, rng, cursor = restored.step, restored.policy_version, restored.rng, restored.cursor
            log.info("resumed from checkpoint at step %d (policy version %d)", self.step, self.version)
        if group.count > 1:
            state = digest(self.step, self.version, np.asarray(jax.random.key_data(rng)), sorted(cursor.items()))
            await asyncio.to_thread(group.agree, "the restored step, policy version, RNG and sampler cursor", state)
        weights_dir = cfg.fleet.weights_dir or self.run_dir / "weights"
        # The engines sample in the learner's compute dtype: publishing in it halves the bytes of f32 masters.
        publisher = DirectoryPublisher(
            weights_dir,
            keep=3,
            tokenizer_from=model_dir,
            dtype=cfg.model.compute_dtype,
            full_every=cfg.fleet.weights_full_every,
            # A LoRA run sends hosts its adapters alone, to load onto the base they booted from.
            adapter_base=model_dir if cfg.model.lora is not None and cfg.model.lora.publish == "adapter" else None,
        )
        # Step-0 rollouts must see the learner's real weights: publish before any rollout.
        location = await self.worker.run(publisher.publish, learner.model(), self.version)
        if not group.is_leader:
            try:
                await self._follow(learner, checkpoints, publisher, rng)
            finally:
                checkpoints.wait()
                checkpoints.close()
            await group.share("finished")  # leave with process 0: JAX's shutdown waits only so long
            return self.run_dir
        train_ids = self.inputs.task_ids("train")
        eval_ids = self.inputs.task_ids("eval")
        if not eval_ids:
            log.warning("no held-out tasks configured: evaluating on the training tasks")
            eval_ids = train_ids
        choices = [harness_choice(h) for h in cfg.harness_mix.harnesses]
        sampler = GroupSampler(train_ids, cfg.harness_mix.harnesses, cfg.seed)
        sampler.restore(cursor.get("sampler", {}))
        # Without a checkpoint nothing of an earlier attempt counts, its step-0 evaluation included.
        kept = self.step if restored is not None else -1
        runlog = RunLog(self.run_dir, resume_step=kept, tensorboard=cfg.logging.tensorboard)
        self.rollouts = RolloutLog(self.run_dir, model_dir, resume_step=kept, tokens=cfg.logging.rollout_tokens)
        progress = progress_bar(cfg.total_steps, self.step, self.progress)
        try:
            async with self.fleet_session(model_dir) as fleet:
                subscribers = self._subscribers(fleet)
                await subscribers.update_weights(self.version, location)
                run = _Run(
                    fleet,
                    subscribers,
                    sampler,
                    learner,
                    checkpoints,
                    publisher,
                    runlog,
                    rng,
                    eval_ids,
                    choices,
                    progress,
                )
                if self.step == 0:
                    await self._evaluate(run)
                await self._steps(run)
        finally:
            progress.close()
            checkpoints.wait()
            checkpoints.close()
            runlog.close()
        plot_run(self.run_dir)
        table = write_harness_table(self.run_dir)
        if table is not None:
            log.info("held-out results per harness (%s):\n%s", table, table.read_text(encoding="utf-8"))
        await group.share("finished")
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

    def _train(
        self, learner: Learner, sequences: list[TrainSequence], keep_logprobs: bool
    ) -> tuple[dict[str, float], list[np.ndarray | None]]:
        """One update: its metrics, and its per-token logprobs when asked for (the rollout log keeps them)."""
        packed = learner.pack(sequences)
        assert self.group is not None
        if self.group.count > 1:
            self.group.agree(f"step {learner.step + 1}'s packed batch", learner.batch_digest(packed))
        result = learner.update(packed)
        return result.metrics, result.sequence_logprobs() if keep_logprobs else []

    async def _update(
        self, learner: Learner, publisher: DirectoryPublisher, subscribers: WeightSubscribers, step: _StepOrder
    ) -> tuple[dict[str, float], list[np.ndarray | None], float, PublishReport]:
        """What every process does with a step's batch: train (or skip), then publish the new version."""
        started = time.monotonic()
        learner_logprobs: list[np.ndarray | None] = []  # per trained sequence, for rollouts.jsonl
        if step.sequences:
            metrics, learner_logprobs = await self.worker.run(self._train, learner, step.sequences, step.keep_logprobs)
        else:
            metrics = {"skipped_update": 1.0}  # no group had reward contrast after every retry
            learner.step += 1
        learner_s = time.monotonic() - started
        published = await publish_weights(
            publisher, subscribers, learner.model(), self.version + 1, executor=self.worker
        )
        # Only now: a step stopped before its weights are out is not done.
        self.step, self.version = learner.step, published.version
        return metrics, learner_logprobs, learner_s, published

    async def _follow(
        self, learner: Learner, checkpoints: Checkpointer, publisher: DirectoryPublisher, rng: jax.Array
    ) -> None:
        """A process other than 0: each step, the batch and the checkpoint process 0 orders."""
        assert self.group is not None
        while self.step < self.config.total_steps:
            step: _StepOrder = await self.group.share("step")
            await self._update(learner, publisher, _NoSubscribers(), step)
            save: _SaveOrder = await self.group.share("checkpoint")
            checkpoints.save(learner, policy_version=save.policy_version, rng=rng, cursor=save.cursor, force=save.force)

    def _subscribers(self, fleet: Fleet) -> WeightSubscribers:
        if self.config.fleet.weights_transport == "location":
            return fleet
        return WeightStreamer(fleet.addresses, security=fleet.security, relay=self.config.fleet.weights_relay)

    async def _steps(self, run: _Run) -> None:
        cfg, learner, sampler = self.config, run.learner, run.sampler
        rollouts = self.rollouts
        assert rollouts is not None and self.group is not None  # run() sets both before stepping
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
                    await ahead.put(await self._collect(run.fleet, sampler, run.progress))

            producer = asyncio.create_task(produce())
        try:
            while self.step < cfg.total_steps:
                batch = await (
                    self._next_batch(ahead, producer) if producer else self._collect(run.fleet, sampler, run.progress)
                )
                assembled = assemble(batch.groups, cfg.rl.advantage, min_policy_version=self.version - lag)
                keep = rollouts.wants_learner_logprobs()
                order = await self.group.share("step", _StepOrder(assembled.sequences, keep))
                metrics, learner_logprobs, learner_s, published = await self._update(
                    learner, run.publisher, run.subscribers, order
                )
                may_start.release()
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
                    **_publish_metrics(run.publisher.last, published),
                    "throughput/tokens_per_s": assembled.metrics.get("rollout/completion_tokens", 0.0)
                    / max(batch.rollout_s, 1e-9),
                }
                run.runlog.write(record)
                # Decoding every sampled span takes a while at scale: off the loop, where the next batch's
                # rollouts (lag > 0) are being collected.
                trajectories = [t for g in batch.groups for t in g.trajectories]
                await asyncio.to_thread(
                    rollouts.write, self.step, "train", trajectories, assembled.sequences, learner_logprobs
                )
                run.runlog.show(record, run.progress.write)
                run.progress.update(1)
                run.progress.set_postfix(reward=f"{record.get('reward/mean', 0.0):.3f}")
                if self.step % cfg.tasks.eval_every == 0 or self.step == cfg.total_steps:
                    pass_rate = await self._evaluate(run)
                    run.progress.write(f"eval @ step {self.step}: pass rate {pass_rate:.3f}")
                # Last: a checkpoint at this step means every log line of the step is on disk, and a
                # run killed before it resumes one step back with those lines cut away.
                save = await self.group.share(
                    "checkpoint", _SaveOrder(self.version, {"sampler": sampler.cursor}, self.step == cfg.total_steps)
                )
                run.checkpoints.save(
                    learner, policy_version=save.policy_version, rng=run.rng, cursor=save.cursor, force=save.force
                )
        finally:
            if producer is not None:
                producer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await producer


async def _first_failure(work: Coroutine[Any, Any, T], watch: Coroutine[Any, Any, None]) -> T:
    """`work`'s result, unless `watch` raises first: then `work` is cancelled (its cleanup runs)
    and `watch`'s error raised."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        if watcher.done() and watcher.exception() is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            watcher.result()
        return await task  # the watch ended quietly (a single process): the work goes on
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def rolled_out(groups: AsyncIterator[GroupResult], bar: tqdm, done: int, asked: int) -> list[GroupResult]:
    """The groups as they end, counted on the bar (`done` of `asked` ended before): a step's
    rollouts can take minutes, with nothing else to show."""
    ended: list[GroupResult] = []
    bar.set_description(f"{_BAR} (rollouts: {done}/{asked} groups)")
    async for group in groups:
        ended.append(group)
        bar.set_description(f"{_BAR} (rollouts: {done + len(ended)}/{asked} groups)")
    return ended


def progress_bar(total: int, done: int, enabled: bool, desc: str = _BAR) -> tqdm:
    """The steps' progress bar (`legorl train`, `legorl sft`)."""
    return tqdm(total=total, initial=done, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True)


def _publish_metrics(stats: PublishStats | None, published: PublishReport) -> dict[str, float]:
    """What publishing a version sent: the fraction of stored elements that changed
    (1.0 for a full checkpoint) and the bytes a server serving the version before
    fetches; and how far the engines' probe logprobs were from the learner's
    (`weights/probe_max_abs_diff`). Only process 0 writes and loads, so elsewhere
    there is nothing to report."""
    metrics = {}
    if stats is not None and stats.version == published.version:
        metrics = {"weights/changed_frac": stats.changed_fraction, "weights/bytes": float(stats.nbytes)}
    probe = published.probe_max_abs_diff()
    if probe is not None:
        metrics["weights/probe_max_abs_diff"] = probe
    return metrics
