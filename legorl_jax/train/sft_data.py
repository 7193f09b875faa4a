"""What `legorl sft` trains on: the sequences of rollouts directories.

A rollouts directory (`legorl collect`'s, or a run directory of `legorl
train`) holds `rollouts.jsonl`, one record per trajectory (`rollout_log.py`).
Each sequence's token ids and sampled spans give a `TrainSequence` whose loss
mask is the spans: the tokens the model produced, never the prompt, tool
results or template tokens. Episodes are kept as `legorl collect` keeps them
(`collect.Keep`: graded ones, optionally only passing or above a reward).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from legorl_jax.core.config import ConfigError
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.collect import MANIFEST_FILE, Keep
from legorl_jax.train.rollout_log import ROLLOUTS_FILE
from legorl_jax.train.run_log import read_jsonl


@dataclass(frozen=True)
class SFTEpisodes:
    sequences: list[TrainSequence]
    episodes: int  # records read, over every directory
    kept: int  # episodes the filter kept
    without_tokens: int  # kept sequences written without token ids (`logging.rollout_tokens`): not trainable

    def summary(self) -> dict[str, float]:
        return {
            "sft/episodes": float(self.episodes),
            "sft/episodes_kept": float(self.kept),
            "sft/sequences": float(len(self.sequences)),
            "sft/loss_tokens": float(sum(int(s.loss_mask.sum()) for s in self.sequences)),
        }


def train_sequence(record: dict[str, Any]) -> TrainSequence | None:
    """A recorded sequence as the learner takes it (the mask from its sampled spans);
    None without token ids or without a sampled token."""
    ids = record.get("ids")
    spans = record.get("spans") or []
    if ids is None or not spans:
        return None
    mask = np.zeros(len(ids), bool)
    for start, end in spans:
        mask[start:end] = True
    # No behaviour logprobs or advantage: the nll loss reads neither.
    return TrainSequence(np.asarray(ids, np.int32), mask, np.zeros(len(ids), np.float32), advantage=1.0)


def check_tokenizer(directory: Path, model_dir: Path) -> None:
    """Refuses a collected directory whose ids are in another tokenizer than the model's: `collect.json`
    names the tokenizer; its `tokenizer.json` must be the model's (when both are still there to compare)."""
    manifest = Path(directory) / MANIFEST_FILE
    if not manifest.is_file():
        return
    theirs = Path(json.loads(manifest.read_text()).get("tokenizer") or "") / "tokenizer.json"
    ours = Path(model_dir) / "tokenizer.json"
    if theirs.is_file() and ours.is_file() and theirs.read_bytes() != ours.read_bytes():
        raise ConfigError(
            f"--rollouts: {directory}'s token ids are in the tokenizer of {theirs.parent}, not of the model "
            f"({model_dir}): fine-tune a model with that tokenizer"
        )


def read_sft_data(directories: list[Path], keep: Keep, vocab_size: int) -> SFTEpisodes:
    """Every kept episode's trainable sequences, directory by directory in file order.
    Errors (a `ConfigError` naming --rollouts) when nothing would be trained on."""
    sequences: list[TrainSequence] = []
    episodes = kept = without_tokens = 0
    for directory in directories:
        path = Path(directory) / ROLLOUTS_FILE
        if not path.is_file():
            raise ConfigError(f"--rollouts: {directory} has no {ROLLOUTS_FILE} (not a rollouts directory)")
        records = read_jsonl(path)
        episodes += len(records)
        for record in records:
            if not keep.admits_outcome(record.get("status", ""), record.get("reward")):
                continue
            kept += 1
            for seq in record.get("sequences", []):
                trainable = train_sequence(seq)
                without_tokens += trainable is None and bool(seq.get("spans"))
                if trainable is not None:
                    sequences.append(trainable)
    named = ", ".join(map(str, directories))
    if not episodes:
        raise ConfigError(f"--rollouts: no episodes in {named}")
    if not sequences:
        why = (
            f"{without_tokens} sampled sequences were written without token ids (logging.rollout_tokens)"
            if without_tokens
            else "no kept sequence has a sampled (loss-mask) token"
        )
        raise ConfigError(f"--rollouts: nothing to train on in {named}: {kept} of {episodes} episodes kept, {why}")
    top = max(int(s.token_ids.max()) for s in sequences)
    if top >= vocab_size:
        raise ConfigError(
            f"--rollouts: token id {top} is outside the model's vocabulary ({vocab_size}): "
            "the episodes were tokenized for another model (see collect.json's tokenizer)"
        )
    return SFTEpisodes(sequences, episodes, kept, without_tokens)
