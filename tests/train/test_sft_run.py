"""`legorl sft`: the learner with the nll loss on rollouts directories written by
`RolloutLog` from synthetic episodes on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from legorl_jax import cli
from legorl_jax.core.config import Config, ConfigError, load_config
from legorl_jax.models import from_hf, token_logprobs
from legorl_jax.models.demo_assets import build_tiny_hf_model
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.collect import Keep
from legorl_jax.train.loop import RunInputs, Trainer
from legorl_jax.train.rollout_log import ROLLOUTS_FILE, RolloutLog
from legorl_jax.train.run_log import read_metrics
from legorl_jax.train.sft import run_sft, sft_learner, sft_rl
from legorl_jax.train.sft_data import read_sft_data
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.tasks import DEMO_TASKS_DIR

PROMPT, ANSWER, TAIL = 6, 8, 4  # a prompt, the sampled answer (the loss mask), a tool result after it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _episode(rng: np.random.Generator, reward: float, *, sampled: bool = True) -> pb.Trajectory:
    """A prompt of random ids, then an answer the prompt decides (learnable), then unmasked tokens."""
    prompt = rng.integers(100, 140, PROMPT)
    answer = (prompt[:1] + np.arange(ANSWER) * 3) % 40 + 150
    ids = np.concatenate([prompt, answer, rng.integers(100, 140, TAIL)])
    mask = np.zeros(len(ids), np.uint32)
    mask[PROMPT : PROMPT + ANSWER] = sampled
    sequence = pb.TokenSequence(token_ids=ids.tolist(), loss_mask=mask.tolist(), behavior_logprobs=[-1.0] * len(ids))
    return pb.Trajectory(task_id="t", status=pb.TRIAL_STATUS_OK, reward=reward, sequences=[sequence])


def _rollouts(directory: Path, model_dir: Path, trajectories: list[pb.Trajectory]) -> Path:
    directory.mkdir(parents=True)
    RolloutLog(directory, model_dir, resume_step=0).write(0, "collect", trajectories)
    return directory


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    rng = np.random.default_rng(0)
    episodes = [_episode(rng, 1.0) for _ in range(12)] + [_episode(rng, 0.0) for _ in range(4)]
    directory = _rollouts(tmp_path_factory.mktemp("collect") / "rollouts", model_dir, episodes)
    (directory / "collect.json").write_text(json.dumps({"tokenizer": str(model_dir)}))  # the model's own
    return directory


def _config(tmp_path: Path, model_dir: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"logging.run_dir={tmp_path}",
            "logging.run_name=sft",
            "logging.tensorboard=false",
            "logging.progress=false",
            "learner.micro_batch_tokens=256",
            "learner.length_buckets=[32]",
            "learner.logprob_chunk_size=32",
            "learner.optimizer.learning_rate=0.01",
            "learner.checkpoint.every_steps=2",
            "sft.batch_size=4",
            "sft.evaluate=false",
            *overrides,
        ],
    )


def _inputs(model_dir: Path) -> RunInputs:
    def no_server(weights: Path):  # never started: these configs do not evaluate
        raise AssertionError("no rollout server in these tests")

    return RunInputs(model_dir=lambda: model_dir, task_ids=lambda split: [], local_server=no_server)


def _nll(model_dir: Path, sequences: list[TrainSequence]) -> float:
    """Mean NLL of the masked tokens under the HF directory's model."""
    model = from_hf(model_dir)
    tokens = np.stack([s.token_ids for s in sequences])
    mask = np.stack([s.loss_mask for s in sequences])[:, 1:]
    return float(-(np.asarray(token_logprobs(model, tokens)) * mask).sum() / mask.sum())


def test_sft_lowers_the_loss_and_writes_a_model_legorl_train_starts_from(
    tmp_path: Path, model_dir: Path, rollouts: Path
) -> None:
    config = _config(tmp_path, model_dir, "sft.epochs=4")
    out, data = run_sft(config, _inputs(model_dir), [rollouts], Keep(passing_only=True), progress=False)
    assert len(data.sequences) == 12 and data.kept == 12 and data.episodes == 16
    manifest = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert manifest["steps"] == 12 and manifest["sft/sequences"] == 12 and manifest["filter"]["passing_only"]
    train = [r for r in read_metrics(tmp_path / "sft") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))  # 4 epochs of 3 steps
    assert all(r["batch/loss_tokens"] == 4 * ANSWER for r in train)
    first, last = np.mean([r["loss"] for r in train[:3]]), np.mean([r["loss"] for r in train[-3:]])
    before, after = _nll(model_dir, data.sequences), _nll(out, data.sequences)
    print(f"sft: loss over the first epoch {first:.3f}, the last {last:.3f}; NLL {before:.3f} -> {after:.3f}")
    assert last < 0.8 * first and after < 0.8 * before
    assert (tmp_path / "sft" / "checkpoints" / "12").is_dir()
    # A `legorl train` config starts from it: its learner is built on the directory.
    trainer = Trainer(_config(tmp_path, out, "logging.run_name=rl"), _inputs(out))
    learner = trainer._build_learner(Path(trainer.config.model.path or ""))
    assert learner.step == 0 and learner.rl.loss == "ppo_clip"
    # `legorl train` never resumes an SFT run's checkpoints as its own, nor trains RL with nll.
    with pytest.raises(ConfigError, match=r"logging.run_name: .*holds a `legorl sft` run.*model.path=.*sft/model"):
        Trainer(_config(tmp_path, out), _inputs(out))
    with pytest.raises(ConfigError, match="rl.loss: nll is legorl sft's loss"):
        Trainer(_config(tmp_path, out, "logging.run_name=rl", "rl.loss=nll"), _inputs(out))
    # Run again: the last checkpoint and model are there, nothing is trained again.
    run_sft(config, _inputs(model_dir), [rollouts], Keep(passing_only=True), progress=False)
    assert len([r for r in read_metrics(tmp_path / "sft") if r["kind"] == "train"]) == 12


def test_more_steps_resume_from_the_last_checkpoint(tmp_path: Path, model_dir: Path, rollouts: Path) -> None:
    run_sft(_config(tmp_path, model_dir, "sft.steps=3"), _inputs(model_dir), [rollouts], Keep(), progress=False)
    run_sft(_config(tmp_path, model_dir, "sft.steps=5"), _inputs(model_dir), [rollouts], Keep(), progress=False)
    steps = [r["step"] for r in read_metrics(tmp_path / "sft") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5]  # the first run's last step is checkpointed: the second goes on from it


def test_the_loss_reads_only_the_masked_tokens(model_dir: Path, rollouts: Path) -> None:
    from legorl_jax.train.sharding import learner_mesh
    from legorl_jax.train.step import Learner

    config = _config(Path("/nonexistent"), model_dir)
    learner = Learner(
        from_hf(model_dir), sft_rl(config.rl), sft_learner(config.learner, 1), learner_mesh(config.learner.mesh)
    )
    sequences = read_sft_data([rollouts], Keep(), 1 << 20).sequences[:4]

    def loss(seqs: list[TrainSequence]) -> float:
        return float(learner.accumulate(learner.pack(seqs))[1])

    def with_token(position: int, token: int) -> list[TrainSequence]:
        s = sequences[0]
        ids = s.token_ids.copy()
        ids[position] = token
        return [TrainSequence(ids, s.loss_mask, s.behavior_logprobs, s.advantage), *sequences[1:]]

    base = loss(sequences)
    assert loss(with_token(PROMPT + ANSWER + 1, 3)) == base  # a tool result's token: no target of the loss
    assert loss(with_token(PROMPT + 2, 3)) != base  # a sampled token is one


def test_bad_inputs_are_named(tmp_path: Path, model_dir: Path, rollouts: Path) -> None:
    config, inputs = _config(tmp_path, model_dir), _inputs(model_dir)
    with pytest.raises(ConfigError, match="has no rollouts.jsonl"):
        run_sft(config, inputs, [tmp_path / "missing"], Keep(), progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ROLLOUTS_FILE).write_text("")
    with pytest.raises(ConfigError, match="no episodes in"):
        run_sft(config, inputs, [tmp_path / "empty"], Keep(), progress=False)
    rng = np.random.default_rng(1)
    unmasked = _rollouts(tmp_path / "unmasked", model_dir, [_episode(rng, 1.0, sampled=False)])
    with pytest.raises(ConfigError, match="no kept sequence has a sampled"):
        run_sft(config, inputs, [unmasked], Keep(), progress=False)
    with pytest.raises(ConfigError, match="0 of 16 episodes kept"):
        run_sft(config, inputs, [rollouts], Keep(min_reward=2.0), progress=False)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        read_sft_data([rollouts], Keep(), 100)
    foreign = _rollouts(tmp_path / "foreign", model_dir, [_episode(rng, 1.0)])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text("{}")
    (foreign / "collect.json").write_text(json.dumps({"tokenizer": str(tmp_path / "other")}))
    with pytest.raises(ConfigError, match="token ids are in the tokenizer of"):
        run_sft(config, inputs, [foreign], Keep(), progress=False)
    with pytest.raises(ConfigError, match=r"sft\.epoch"):
        _config(tmp_path, model_dir, "sft.epoch=2")
    assert not (tmp_path / "sft").exists()  # refused before anything was written
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text("")  # a `legorl train` run's directory
    with pytest.raises(ConfigError, match="logging.run_name: .* not an SFT run"):
        run_sft(_config(tmp_path, model_dir, "logging.run_name=rl"), inputs, [rollouts], Keep(), progress=False)


def test_the_command_names_a_bad_field_and_a_missing_directory(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sft", "--rollouts", str(tmp_path / "missing"), "--set", f"model.path={model_dir}"]
    assert cli.main([*args, "--set", "sft.batch_size=0"]) == 2
    assert "sft.batch_size" in capsys.readouterr().err
    assert cli.main([*args, "--set", f"logging.run_dir={tmp_path}"]) == 2
    assert "--rollouts:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["sft", "--help"])
    assert "--passing-only" in capsys.readouterr().out


def test_lora_sft_trains_the_adapters_and_writes_them_merged(tmp_path: Path, model_dir: Path, rollouts: Path) -> None:
    config = _config(tmp_path, model_dir, "sft.epochs=2", "model.lora={rank: 8, alpha: 16}")
    out, data = run_sft(config, _inputs(model_dir), [rollouts], Keep(passing_only=True), progress=False)
    assert (tmp_path / "sft" / "checkpoints" / "6").is_dir()
    before, after = _nll(model_dir, data.sequences), _nll(out, data.sequences)
    print(f"LoRA sft: NLL {before:.3f} -> {after:.3f}")
    assert after < before  # a plain HF directory: the adapters merged into the weights


def _legorl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "legorl_jax.cli", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.docker
@pytest.mark.slow
def test_collect_then_sft_with_held_out_evaluation_then_train_from_its_model(tmp_path: Path) -> None:
    """The whole path on real lego episodes: a tiny teacher's, fine-tuned on with the held-out
    evaluations at start and end, and `legorl train` one step from the model it wrote."""
    model = build_tiny_hf_model(tmp_path / "teacher", seed=0, max_position_embeddings=8192)
    tasks = [str(DEMO_TASKS_DIR / t) for t in ("edit-config", "count-errors")]
    common = [
        "--config", "configs/demo.yaml", "--set", "tasks.demo=false", "--set", f"tasks.eval=[{tasks[1]}]",
        "--set", "harness_mix.harnesses=[{name: lego}]", "--set", "rl.sampling.max_tokens=24",
        "--set", f"logging.run_dir={tmp_path / 'runs'}", "--no-progress",
    ]  # fmt: skip
    collected = _legorl(
        "collect", "--model", str(model), "--out", str(tmp_path / "episodes"), "--tasks", *tasks, "--samples", "2",
        *common[:-1],
    )  # fmt: skip
    assert collected.returncode == 0, collected.stderr[-3000:]
    sft = _legorl(
        "sft", "--rollouts", str(tmp_path / "episodes"), *common, "--set", f"model.path={model}",
        "--set", "logging.run_name=sft", "--set", "sft.batch_size=2",
    )  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    out = tmp_path / "runs" / "sft" / "model"
    records = read_metrics(tmp_path / "runs" / "sft")
    assert [(r["step"], r["kind"]) for r in records] == [
        (0, "eval"),
        (1, "train"),
        (2, "train"),
        (2, "eval"),
    ]
    assert records[0]["eval_harness/lego/trials"] == 1 and f"model.path={out}" in sft.stdout
    trained = _legorl(
        "train", *common, "--set", f"model.path={out}", "--set", "logging.run_name=rl", "--set", "total_steps=1",
        "--set", f"tasks.train=[{tasks[0]}]", "--set", "rl.group_size=2", "--set", "rl.groups_per_step=1",
        "--set", "rl.dynamic_sampling=false",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "rl") if r["kind"] == "train"] == [1]
