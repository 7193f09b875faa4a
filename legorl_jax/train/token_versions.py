"""Per-token policy versions on the learner's side: decoded from a sequence's
run-length form, bounded by the staleness limit, and summarised as metrics.

A weight update that lands while a completion is in flight (keep mode) gives
that completion tokens from two policies. The importance correction needs no
change for it: each behaviour logprob is the one the engine computed when it
sampled that token, under the weights that sampled it, so the per-token
ratios of `rl/losses.py` (TIS, MIS) are already against the right policy per
token. Only the staleness bound reads versions, and it reads them per token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from protos.legorl.v1 import rollout_pb2 as pb

log = logging.getLogger(__name__)


class VersionRunsError(ValueError):
    """A sequence's version runs do not cover its trained tokens."""


def token_versions(seq: pb.TokenSequence) -> np.ndarray:
    """int64[L]: the version of each trained token, -1 on the others. A sequence
    without runs (from a server before per-token versions) gives every trained
    token its policy_version."""
    mask = np.asarray(seq.loss_mask, bool)
    out = np.full(len(mask), -1, np.int64)
    if not seq.version_runs:
        out[mask] = seq.policy_version
        return out
    lengths = np.asarray(seq.version_run_lengths, np.int64)
    if len(lengths) != len(seq.version_runs) or int(lengths.sum()) != int(mask.sum()):
        raise VersionRunsError(
            f"{len(seq.version_runs)} version runs of {len(lengths)} lengths summing to {int(lengths.sum())} "
            f"for {int(mask.sum())} trained tokens"
        )
    out[mask] = np.repeat(np.asarray(seq.version_runs, np.int64), lengths)
    return out


@dataclass
class VersionStats:
    """What the step's trained sequences say about the policies that sampled them."""

    trained: int = 0
    mixed: int = 0  # trained sequences whose sampled tokens come from more than one version
    span_max: int = 0  # the widest newest-minus-oldest version gap within one sequence
    stale_tokens: int = 0  # sampled tokens left out of the loss for being older than the bound
    bad_runs: int = 0  # sequences left out because their runs do not cover their sampled tokens

    def read(
        self, trajectory: pb.Trajectory, min_policy_version: int, include_side_calls: bool
    ) -> tuple[list[np.ndarray | None], bool]:
        """Each sequence's token versions (None: runs that do not cover it, left out and
        counted), and whether every sampled token is older than the bound (a stale trajectory)."""
        out: list[np.ndarray | None] = []
        newest = -1
        for seq in trajectory.sequences:
            try:
                versions = token_versions(seq)
            except VersionRunsError as exc:
                log.warning("%s: a sequence left out: %s", trajectory.task_id, exc)
                self.bad_runs += 1
                out.append(None)
                continue
            out.append(versions)
            newest = max(newest, int(versions.max(initial=-1)))
            if include_side_calls or not seq.side_call:
                self.stale_tokens += int(np.sum((versions >= 0) & (versions < min_policy_version)))
        return out, 0 <= newest < min_policy_version

    def add_trained(self, versions: np.ndarray) -> None:
        sampled = versions[versions >= 0]
        self.trained += 1
        if sampled.size:
            gap = int(sampled.max() - sampled.min())
            self.mixed += gap > 0
            self.span_max = max(self.span_max, gap)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/mixed_version_frac": self.mixed / self.trained if self.trained else 0.0,
            "rollout/version_span_max": float(self.span_max),
            "rollout/stale_tokens_dropped": float(self.stale_tokens),
            "sequences/bad_version_runs": float(self.bad_runs),
        }
