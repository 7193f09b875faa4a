"""`legorl sft`: supervised fine-tuning on rollouts directories, through the RL learner.

The learner (`step.Learner`) trains with the `nll` loss (`rl/losses.py`): the
mean negative log-likelihood of the sampled tokens (`sft_data.py`'s loss
masks), at temperature 1, with no KL, MIS or advantage. So the packing into
buckets, shared prompt prefixes as tree rows, fitted micro-batches, sharding,
LoRA and Orbax checkpoints are `legorl train`'s own. The run directory is laid
out like a training run's (`config.yaml`, `metrics.jsonl`, TensorBoard,
`sft.json`: the rollouts directories, the filter and what was kept of them,
`checkpoints/`, `rollouts.jsonl` of the held-out evaluations); running the
same command again resumes from the last checkpoint. At the end the policy is
written as an HF directory, `model/` (adapters merged, the starting model's
tokenizer), a `model.path` for `legorl train`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import jax
import numpy as np

from legorl_jax.core.config import Config, ConfigError, LearnerConfig, RLConfig, SupervisedConfig, dump_config
from legorl_jax.core.files import replace_text
from legorl_jax.core.seeds import derive_seed
from legorl_jax.fleet import configured_fleet
from legorl_jax.models import read_hf_config, to_hf
from legorl_jax.train.checkpoint import Checkpointer
from legorl_jax.train.collect import Keep
from legorl_jax.train.evaluate import evaluate
from legorl_jax.train.groups import harness_choice
from legorl_jax.train.loop import RunInputs, policy_model, progress_bar, run_directory
from legorl_jax.train.rollout_log import RolloutLog
from legorl_jax.train.run_log import METRICS_FILE, SFT_MODEL_DIR, SFT_RUN_FILE, RunLog, read_metrics
from legorl_jax.train.sft_data import SFTEpisodes, check_tokenizer, read_sft_data
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

log = logging.getLogger(__name__)

COLUMNS = [
    ("step", "step", "{:>5.0f}"),
    ("epoch", "sft/epoch", "{:>6.2f}"),
    ("loss", "loss", "{:>8.4f}"),
    ("grad", "grad_norm", "{:>8.3f}"),
    ("lr", "learning_rate", "{:>9.2e}"),
    ("tokens", "batch/loss_tokens", "{:>7.0f}"),
    ("learn_s", "time/learner_s", "{:>7.2f}"),
]


def sft_rl(rl: RLConfig) -> RLConfig:
    """The run's RL section as SFT trains: the nll loss as a mean over the step's tokens, at
    temperature 1 (the model's own distribution), without the reference or the IS corrections."""
    sampling = rl.sampling.model_copy(update={"temperature": 1.0})
    return rl.model_copy(
        update={"loss": "nll", "aggregation": "token_mean", "kl_coef": 0.0, "mis_cap": None, "sampling": sampling}
    )


def sft_learner(learner: LearnerConfig, steps: int) -> LearnerConfig:
    """The learner section with the schedule spanning the SFT run, unless the config fixes its horizon."""
    optimizer = learner.optimizer
    if "total_steps" not in optimizer.model_fields_set or optimizer._horizon_from_run:
        optimizer = optimizer.model_copy(update={"total_steps": steps})
    return learner.model_copy(update={"optimizer": optimizer})


def sft_steps(sft: SupervisedConfig, sequences: int) -> int:
    return sft.steps or sft.epochs * math.ceil(sequences / sft.batch_size)


def step_rows(sequences: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The sequences of step `step` (from 1): epochs of seeded permutations cut into batches,
    the last batch of an epoch smaller. Only the step decides, so a resumed run goes on alike."""
    per_epoch = math.ceil(sequences / batch_size)
    epoch, index = divmod(step - 1, per_epoch)
    order = np.random.default_rng(derive_seed(seed, "sft", epoch)).permutation(sequences)
    return order[index * batch_size : (index + 1) * batch_size].tolist()


def _build_learner(config: Config, model_dir: Path, steps: int) -> Learner:
    mesh = learner_mesh(config.learner.mesh)
    return Learner(policy_model(config, model_dir, mesh), sft_rl(config.rl), sft_learner(config.learner, steps), mesh)


async def _held_out(config: Config, inputs: RunInputs, model_dir: Path, step: int, rollouts: RolloutLog | None) -> dict:
    """Held-out pass rates of `model_dir`, served by a rollout server in this process (the
    configured servers serve the weights `legorl train` publishes them, which SFT does not)."""
    choices = [harness_choice(h) for h in config.harness_mix.harnesses]
    async with configured_fleet(config.fleet.model_copy(update={"servers": []}), inputs.local_server, model_dir) as f:
        metrics = await evaluate(
            f, config, inputs.task_ids("eval"), choices, policy_version=0, step=step, rollouts=rollouts
        )
    return {"step": step, "kind": "eval", **metrics}


def _finished(run_dir: Path, steps: int, evaluating: bool) -> bool:
    """Whether a run reached its last step, wrote its model (`to_hf` writes config.json last)
    and, when it evaluates, recorded the final evaluation (the last thing it does)."""
    if not (run_dir / SFT_MODEL_DIR / "config.json").is_file():
        return False
    records = read_metrics(run_dir)
    trained = max((r["step"] for r in records if r.get("kind") == "train"), default=0) >= steps
    return trained and (not evaluating or any(r.get("kind") == "eval" and r["step"] == steps for r in records))


def run_sft(
    config: Config, inputs: RunInputs, directories: list[Path], keep: Keep, *, progress: bool = True
) -> tuple[Path, SFTEpisodes]:
    """Fine-tunes the config's model on the kept episodes of `directories`; returns the
    fine-tuned HF directory and what was trained on."""
    run_dir = run_directory(config)
    if (run_dir / METRICS_FILE).exists() and not (run_dir / SFT_RUN_FILE).exists():
        # Its checkpoints would be taken for this run's (the demo config names `legorl train`'s run "demo").
        raise ConfigError(f"logging.run_name: {run_dir} holds a run that is not an SFT run; name another")
    model_dir = inputs.model_dir()
    for directory in directories:
        check_tokenizer(directory, model_dir)
    data = read_sft_data(directories, keep, int(read_hf_config(model_dir)["vocab_size"]))
    steps = sft_steps(config.sft, len(data.sequences))
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_text(run_dir / "config.yaml", dump_config(config))
    source = {"rollouts": [str(d) for d in directories], "filter": dataclasses.asdict(keep), "steps": steps}
    (run_dir / SFT_RUN_FILE).write_text(json.dumps({**source, **data.summary()}, indent=2) + "\n")
    learner = _build_learner(config, model_dir, steps)
    checkpoint_dir = config.learner.checkpoint.directory or run_dir / "checkpoints"
    checkpoints = Checkpointer(checkpoint_dir, config.learner.checkpoint)
    restored = checkpoints.restore_latest(learner)
    rng = jax.random.key(config.seed) if restored is None else restored.rng
    if restored is not None:
        log.info("resumed from the checkpoint at step %d", restored.step)
    out = run_dir / SFT_MODEL_DIR
    evaluating = config.sft.evaluate and bool(inputs.task_ids("eval"))
    if restored is not None and _finished(run_dir, steps, evaluating):
        checkpoints.close()
        log.info("already fine-tuned: %s", out)
        return out, data
    kept = -1 if restored is None else restored.step  # without a checkpoint nothing earlier counts
    runlog = RunLog(run_dir, resume_step=kept, tensorboard=config.logging.tensorboard, columns=COLUMNS)
    # The evaluations' trajectories, as a training run keeps them.
    rollouts = (
        RolloutLog(run_dir, model_dir, resume_step=kept, tokens=config.logging.rollout_tokens) if evaluating else None
    )
    bar = progress_bar(steps, learner.step, progress, desc="sft")
    try:
        if restored is None and evaluating:
            runlog.write(asyncio.run(_held_out(config, inputs, model_dir, 0, rollouts)))
        while learner.step < steps:
            rows = step_rows(len(data.sequences), config.sft.batch_size, learner.step + 1, config.seed)
            started = time.monotonic()
            metrics = learner.update(learner.pack([data.sequences[r] for r in rows])).metrics
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(f"the SFT loss became {metrics['loss']} at step {learner.step}")
            record = {
                "step": learner.step,
                "kind": "train",
                "sft/epoch": learner.step * config.sft.batch_size / len(data.sequences),
                **{k: v for k, v in metrics.items() if k in ("loss", "grad_norm", "learning_rate")},
                **{k: v for k, v in metrics.items() if k.startswith("batch/")},
                "time/learner_s": time.monotonic() - started,
            }
            runlog.write(record)
            runlog.show(record, bar.write)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
            checkpoints.save(learner, policy_version=learner.step, rng=rng, force=learner.step == steps)
        to_hf(learner.model(), out, tokenizer_from=model_dir)
        if evaluating:
            runlog.write(asyncio.run(_held_out(config, inputs, out, learner.step, rollouts)))
    finally:
        bar.close()
        checkpoints.wait()
        checkpoints.close()
        runlog.close()
    return out, data
