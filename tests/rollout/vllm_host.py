"""Plumbing of the vLLM-host suite (test_vllm_host*.py): a rollout server kept
running on its own event-loop thread (so one vLLM serves a whole module), and
transformers' float32 logprobs of a checkpoint, the reference vLLM must match."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from legorl_jax.core.config import Config
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.server import RolloutServer

_T = TypeVar("_T")


class BackgroundServer:
    """A RolloutServer whose event loop runs on a thread of its own: tests drive it over
    gRPC from their own loops (`asyncio.run`) and read its parts (engine, sessions)."""

    def __init__(self, config: Config, model_dir: Path, start_timeout_s: float = 600.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-server", daemon=True)
        self._thread.start()
        self.server = RolloutServer(config, model_dir)
        try:
            self.address = self.call(self.server.start(), start_timeout_s)
        except BaseException:
            self.close()
            raise

    def call(self, coro: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self, grace_s: float = 30.0) -> None:
        try:
            self.call(self.server.stop(grace_s=grace_s), grace_s + 120.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30.0)
            self.loop.close()

    def model_calls(self) -> tuple[int, int]:
        """(started, answered) model calls of the trials running now, read from their proxy
        sessions; a call started and not answered is at the engine."""
        assert self.server.service is not None
        sessions = list(self.server.service.host.sessions._sessions.values())  # the store has no public iteration
        return sum(s.calls_started for s in sessions), sum(len(s.trajectory.calls) for s in sessions)


class Reference:
    """A checkpoint's next-token logprobs as transformers computes them in float32."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(self, ids: Sequence[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i = 1 .. len(ids) - 1."""
        torch = self._torch
        tokens = torch.tensor([list(ids)], dtype=torch.long)
        with torch.no_grad():
            logits = self.model(tokens).logits[0].float()
        out = torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
        return [float(x) for x in out]


def max_abs_diff(a: Sequence[float | None], b: Sequence[float | None]) -> float:
    """Largest |a - b| over paired entries; inf for a length mismatch or a missing/non-finite one."""
    if len(a) != len(b) or not a:
        return math.inf
    diffs = [abs(x - y) if x is not None and y is not None else math.inf for x, y in zip(a, b, strict=True)]
    return max(d if math.isfinite(d) else math.inf for d in diffs)


def sampled_logprob_diff(
    sequence: pb.TokenSequence, reference: Reference, sampled: slice = slice(None)
) -> tuple[int, float]:
    """How many trained tokens `sequence` has (those `sampled` picks of them, in order), and
    the largest gap between their behaviour logprobs and the reference's logprobs of the same
    tokens in the same context."""
    ids = list(sequence.token_ids)
    expected = reference.logprobs(ids)
    at = [i for i, m in enumerate(sequence.loss_mask) if m and i > 0][sampled]
    got = [float(sequence.behavior_logprobs[i]) for i in at]
    return len(at), max_abs_diff(got, [expected[i - 1] for i in at])
