"""`rollouts.jsonl`: every trajectory a run sampled, readable.

One JSON object per trajectory (step, kind, task, harness configuration,
status, reward, the verifier's error, and the text of what the policy
sampled, span by span), so a curve that does not move can be explained by
reading what the agent did. Each record also carries its token sequences for
`legorl view`: token ids with each token's text, the sampled spans, the
behaviour and learner logprob of every sampled token and the advantage the
sequence was trained on. `logging.rollout_tokens` bounds the file: token
records for every sequence, for trained ones only, or for none (then a
sequence keeps its spans and summary). Cut back to the restored step on
resume, like the metrics file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from legorl_jax.train.run_log import cut_back
from protos.legorl.v1 import rollout_pb2 as pb

ROLLOUTS_FILE = "rollouts.jsonl"
# A byte-level BPE token can end mid-character; a UTF-8 character is at most 4 bytes.
_MAX_SPLIT_TOKENS = 4


def status_name(status: int) -> str:
    """A trial status as `rollouts.jsonl` writes it: `TRIAL_STATUS_OK` → "ok"."""
    return pb.TrialStatus.Name(status).removeprefix("TRIAL_STATUS_").lower()


class Trained(Protocol):
    """What the log needs of a learner sequence (`rl.batching.TrainSequence`);
    read-only, so frozen dataclasses match."""

    @property
    def token_ids(self) -> Any: ...
    @property
    def advantage(self) -> float: ...


def sampled_spans(token_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The runs of consecutive sampled (mask 1) tokens."""
    spans: list[list[int]] = []
    inside = False
    for token, bit in zip(token_ids, loss_mask, strict=True):
        if bit and not inside:
            spans.append([])
        if bit:
            spans[-1].append(token)
        inside = bool(bit)
    return spans


def span_bounds(loss_mask: list[int]) -> list[list[int]]:
    """[start, end) of each run of sampled tokens: the mask, run-length coded."""
    bounds: list[list[int]] = []
    for i, bit in enumerate(loss_mask):
        if bit and (i == 0 or not loss_mask[i - 1]):
            bounds.append([i, i + 1])
        elif bit:
            bounds[-1][1] = i + 1
    return bounds


def token_pieces(decode: Callable[[list[int]], str], token_ids: list[int], cache: dict[int, str]) -> list[str]:
    """Each token's text; the pieces join to the decoded sequence (byte-level BPE, as Qwen3's).

    A character split over tokens goes to the token that completes it, and a
    token keeps the whole characters it finishes, so no piece shows a
    replacement mark and a span's pieces hold every character it completes
    (a token can end one character and begin the next). A token's own text
    never changes, so `cache` keeps it: one decode per vocabulary entry
    instead of one per token logged.
    """
    pieces: list[str] = []
    pending: list[int] = []
    for token in token_ids:
        piece = cache.get(token)
        if piece is None:
            piece = cache[token] = decode([token])
        if not pending and "\ufffd" not in piece:
            pieces.append(piece)
            continue
        pending.append(token)
        text = decode(pending)
        if text.endswith("\ufffd") and len(pending) < _MAX_SPLIT_TOKENS:
            pieces.append("")
            continue
        pieces.append("")
        _share_out(decode, pending, text, pieces)
        pending = []
    if pending:
        _share_out(decode, pending, decode(pending), pieces)
    return pieces


def _share_out(decode: Callable[[list[int]], str], run: list[int], text: str, pieces: list[str]) -> None:
    """Gives each token of `run` (the last len(run) pieces) the whole characters it finishes.

    A prefix of the run decodes to whole characters and then a mark for the
    unfinished one; without the mark it is a prefix of the run's text, as
    UTF-8 resynchronises at each character. Should a tokenizer's clean-up
    break that, the whole text stays with the last token.
    """
    heads = [decode(run[:i]).rstrip("\ufffd") for i in range(1, len(run))] + [text]
    ordered = all(b.startswith(a) for a, b in zip(heads, heads[1:], strict=False))
    if not ordered:
        heads = [""] * (len(run) - 1) + [text]
    done = ""
    for i, head in enumerate(heads):
        pieces[len(pieces) - len(run) + i] = head[len(done) :]
        done = head


def trained_index(trajectories: Sequence[pb.Trajectory], trained: Sequence[Trained]) -> list[list[int | None]]:
    """For each trajectory's sequences, its index among the learner's sequences (None: not trained).

    The learner's sequences keep the trajectories' order and drop whole
    trajectories or single sequences, so one in-order walk matching token ids
    pairs them up.
    """
    out: list[list[int | None]] = []
    i = 0
    for trajectory in trajectories:
        row: list[int | None] = []
        for seq in trajectory.sequences:
            if i < len(trained) and list(trained[i].token_ids) == list(seq.token_ids):
                row.append(i)
                i += 1
            else:
                row.append(None)
        out.append(row)
    return out


def trained_advantages(trajectories: Sequence[pb.Trajectory], trained: Sequence[Trained]) -> list[list[float | None]]:
    """The advantage each trajectory's sequences were trained on (None: not trained)."""
    rows = trained_index(trajectories, trained)
    return [[None if i is None else float(trained[i].advantage) for i in row] for row in rows]


def _rounded(value: float) -> float | None:
    # 4 decimals keep the file small; NaN (a token the learner did not train) is null.
    return round(float(value), 4) if math.isfinite(value) else None


class RolloutLog:
    def __init__(
        self,
        run_dir: Path,
        tokenizer_dir: Path,
        *,
        resume_step: int,
        tokens: Literal["all", "train", "none"] = "all",
    ) -> None:
        from transformers import AutoTokenizer  # deferred: seconds to import

        self.path = Path(run_dir) / ROLLOUTS_FILE
        self.tokens = tokens
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self._pieces: dict[int, str] = {}
        cut_back(self.path, resume_step)

    def wants_learner_logprobs(self) -> bool:
        """Whether `write` would keep learner logprobs (the learner need not copy them to host otherwise)."""
        return self.tokens != "none"

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids)
        assert isinstance(text, str)  # one sequence in, one text out (decode is typed for batches too)
        return text

    def _sequence(self, seq: pb.TokenSequence, advantage: float | None, learner: np.ndarray | None) -> dict[str, Any]:
        mask = list(seq.loss_mask)
        out: dict[str, Any] = {
            "spans": span_bounds(mask),
            "advantage": advantage,
            "policy_version": seq.policy_version,
            "side_call": seq.side_call,
            "model_calls": seq.num_model_calls,
            "root_reason": seq.root_reason,
            "recomputed_tokens": seq.recomputed_tokens,
            # [version, count] runs over the sampled tokens in order (two for a completion an update split).
            "versions": [[int(v), int(n)] for v, n in zip(seq.version_runs, seq.version_run_lengths, strict=False)],
            "unreported_version_tokens": seq.unreported_version_tokens,
            # A chat teacher's turns written with this model's template: its logprobs are 0, not this model's.
            "rerendered": seq.rerendered,
        }
        if self.tokens == "none" or (self.tokens == "train" and advantage is None):
            return out
        ids = list(seq.token_ids)
        # Only sampled tokens have logprobs: both lists run over them in order.
        sampled = np.asarray(mask, bool)
        out.update(
            ids=ids,
            pieces=token_pieces(self._decode, ids, self._pieces),
            logprobs=[round(lp, 4) for lp, bit in zip(seq.behavior_logprobs, mask, strict=False) if bit],
            learner_logprobs=None if learner is None else [_rounded(lp) for lp in np.asarray(learner)[sampled]],
        )
        return out

    def record(
        self,
        step: int,
        kind: str,
        trajectory: pb.Trajectory,
        advantages: list[float | None] | None = None,
        learner_logprobs: list[np.ndarray | None] | None = None,
    ) -> dict[str, Any]:
        """One trajectory's line; per sequence the advantage and learner logprobs (token order; None: not trained)."""
        texts = [
            self._tokenizer.decode(span)
            for seq in trajectory.sequences
            for span in sampled_spans(list(seq.token_ids), list(seq.loss_mask))
        ]
        advantages = advantages or [None] * len(trajectory.sequences)
        learner_logprobs = learner_logprobs or [None] * len(trajectory.sequences)
        m = trajectory.metrics
        return {
            "step": step,
            "kind": kind,
            "task": trajectory.task_id,
            "harness": trajectory.harness.config_id or trajectory.harness.name,
            "group": trajectory.group_id,
            "trial": trajectory.trial_index,
            "status": status_name(trajectory.status),
            "reward": trajectory.reward if trajectory.HasField("reward") else None,
            "error": trajectory.error or None,
            "metrics": {
                "model_calls": m.model_calls,
                "tool_calls": m.tool_calls,
                "history_rewrites": m.history_rewrites,
                "tool_parse_errors": m.tool_parse_errors,
                "verifier_no_reward": m.verifier_no_reward,
                "agent_s": round(m.phase_times.agent_s, 3),
                "verify_s": round(m.phase_times.verify_s, 3),
            },
            "sampled": texts,
            "sequences": [
                self._sequence(s, a, lp)
                for s, a, lp in zip(trajectory.sequences, advantages, learner_logprobs, strict=True)
            ],
        }

    def write(
        self,
        step: int,
        kind: str,
        trajectories: list[pb.Trajectory],
        trained: Sequence[Trained] = (),
        learner_logprobs: Sequence[np.ndarray | None] = (),
    ) -> None:
        """Appends one line per trajectory. `trained` (the learner's sequences) gives the advantages;
        `learner_logprobs`, when given, each trained sequence's logprobs in its token order (NaN: not trained)."""
        with self.path.open("a") as f:
            for trajectory, row in zip(trajectories, trained_index(trajectories, trained), strict=True):
                advantages = [None if i is None else float(trained[i].advantage) for i in row]
                learner = [None if i is None or not learner_logprobs else learner_logprobs[i] for i in row]
                f.write(json.dumps(self.record(step, kind, trajectory, advantages, learner)) + "\n")
