"""Trajectory assembly: model calls -> token sequences the trainer consumes.

A call whose prompt extends an existing sequence (its prompt + completion)
token-exactly is appended to it: the new prompt ids with loss mask 0, the
sampled ids with mask 1, their behaviour logprobs and the policy version that
sampled each (the engine's per-token weight versions: an update that lands
mid-completion gives one completion two versions). Any other call starts a
new sequence, for one of these reasons: `first_call`, `side_call` (another
system prompt or tool set: title generation, sub-agents; flagged so the
trainer can include or exclude it), `restart` (the same conversation asked
again from scratch) or `history_rewritten`.

The main conversation is the first one that offered tools (else the first
one): harnesses such as OpenCode ask for a title before the real work starts,
so reasons and side flags are read off the whole trajectory, not fixed when
a sequence opens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

_INTERNAL = ("root_key", "has_tools", "has_history")  # CapturedSequence fields the trainer does not see


@dataclass
class CapturedSequence:
    index: int
    root_key: str
    has_tools: bool
    has_history: bool  # the opening call carried earlier assistant turns
    policy_version: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    # The policy version whose logprob each trained token carries; -1 on context tokens.
    token_versions: list[int] = field(default_factory=list)
    # Trained tokens whose version the engine did not report (older vLLM, an external
    # engine): they carry the version the server believed it served, not a measured one.
    unreported_versions: int = 0
    calls: list[int] = field(default_factory=list)

    def extend(
        self,
        ids: list[int] | tuple[int, ...],
        mask: list[int] | tuple[int, ...],
        logprobs: list[float] | tuple[float, ...],
    ) -> None:
        """Appends tokens; trained ones go through `extend_sampled`, so these carry no version."""
        self.token_ids.extend(ids)
        self.loss_mask.extend(mask)
        self.behavior_logprobs.extend(logprobs)
        self.token_versions.extend([-1] * len(ids))

    def extend_sampled(
        self,
        ids: list[int] | tuple[int, ...],
        logprobs: list[float] | tuple[float, ...],
        versions: tuple[int, ...] | None,
        believed: int,
    ) -> None:
        """Appends a completion's sampled tokens with the version that sampled each,
        or, where the engine did not say, `believed` for all of them (counted)."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.behavior_logprobs.extend(logprobs)
        if versions is None:
            self.unreported_versions += len(ids)
            versions = (believed,) * len(ids)
        self.token_versions.extend(versions)
        self.policy_version = min([self.policy_version, *versions])

    def train_on(self, positions: list[int], logprobs: list[float], version: int) -> None:
        """Turns context tokens into trained ones (loss mask 1), with the
        behaviour logprobs the engine recomputed for them under `version`."""
        for at, logprob in zip(positions, logprobs, strict=True):
            self.loss_mask[at] = 1
            self.behavior_logprobs[at] = logprob
            self.token_versions[at] = version


@dataclass
class CallRecord:
    index: int
    dialect: str
    stream: bool
    sequence: int
    merged: bool
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    tool_calls: int
    parse_error: str | None
    reused_turns: int
    unmatched_turns: int
    sampling: dict[str, Any]
    policy_version: int
    engine_latency_s: float
    incremental_render: bool = False  # the prompt was rendered from the session's memo of the last one
    recomputed_tokens: int = 0  # reused sampled tokens trained again with recomputed (prompt) logprobs
    latency_s: float = 0.0  # until the engine answered, then until the answer was sent or the harness hung up
    client_disconnected: bool = False  # the harness hung up on the stream before its last event
    # A chat teacher's message re-rendered with this model's template: its ids were not sampled by
    # this model, and its logprobs (0) are none of this model's.
    rerendered: bool = False


@dataclass
class CapturedTrajectory:
    sequences: list[CapturedSequence] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    cap_hit: str | None = None  # the first session cap the harness ran into

    @property
    def total_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def extendable(self, prompt: list[int]) -> CapturedSequence | None:
        """The sequence this prompt extends token-exactly, if any."""
        for seq in reversed(self.sequences):
            n = len(seq.token_ids)
            if n <= len(prompt) and prompt[:n] == seq.token_ids:
                return seq
        return None

    def _main_key(self) -> str | None:
        main = next((s for s in self.sequences if s.has_tools), self.sequences[0] if self.sequences else None)
        return main.root_key if main else None

    def is_side(self, seq: CapturedSequence) -> bool:
        return seq.root_key != self._main_key()

    def root_reason(self, seq: CapturedSequence) -> str:
        main = self._main_key()
        if seq.root_key != main:
            return "side_call"
        if seq is next(s for s in self.sequences if s.root_key == main):
            return "first_call"
        return "history_rewritten" if seq.has_history else "restart"

    def place(
        self, prompt: list[int], root_key: str, *, has_tools: bool, has_history: bool, policy_version: int
    ) -> tuple[CapturedSequence, bool]:
        """The sequence a call with this prompt belongs to (opened if none
        extends), with its prompt ids appended; and whether it merged."""
        seq = self.extendable(prompt)
        if seq is not None:
            seq.extend(
                prompt[len(seq.token_ids) :],
                [0] * (len(prompt) - len(seq.token_ids)),
                [0.0] * (len(prompt) - len(seq.token_ids)),
            )
            seq.policy_version = min(seq.policy_version, policy_version)
            return seq, True
        seq = CapturedSequence(len(self.sequences), root_key, has_tools, has_history, policy_version)
        seq.extend(prompt, [0] * len(prompt), [0.0] * len(prompt))
        self.sequences.append(seq)
        return seq, False

    def _sequence_json(self, seq: CapturedSequence) -> dict[str, Any]:
        # Shallow: asdict would deep-copy every token list just to serialise it.
        out = {f.name: getattr(seq, f.name) for f in fields(seq) if f.name not in _INTERNAL}
        return {**out, "root_reason": self.root_reason(seq), "side": self.is_side(seq)}

    def _call_json(self, call: CallRecord) -> dict[str, Any]:
        seq = self.sequences[call.sequence]
        return {
            **asdict(call),
            "root_reason": None if call.merged else self.root_reason(seq),
            "side": self.is_side(seq),
        }

    def metrics(self) -> dict[str, Any]:
        calls = len(self.calls)
        merged = sum(c.merged for c in self.calls)
        latencies = [c.latency_s for c in self.calls]
        return {
            "model_calls": calls,
            "merged_calls": merged,
            "merged_ratio": merged / calls if calls else 0.0,
            "sequences": len(self.sequences),
            "new_roots": dict(Counter(self.root_reason(s) for s in self.sequences)),
            "side_calls": sum(self.is_side(self.sequences[c.sequence]) for c in self.calls),
            "tool_calls": sum(c.tool_calls for c in self.calls),
            "parse_errors": sum(c.parse_error is not None for c in self.calls),
            "incremental_renders": sum(c.incremental_render for c in self.calls),
            "recomputed_calls": sum(c.recomputed_tokens > 0 for c in self.calls),
            "recomputed_tokens": sum(c.recomputed_tokens for c in self.calls),
            "prompt_tokens": sum(c.prompt_tokens for c in self.calls),
            "completion_tokens": sum(c.completion_tokens for c in self.calls),
            "sequence_tokens": self.total_tokens,
            "latency_s_mean": sum(latencies) / calls if calls else 0.0,
            "latency_s_max": max(latencies, default=0.0),
            "cap_hit": self.cap_hit,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "sequences": [self._sequence_json(s) for s in self.sequences],
            "calls": [self._call_json(c) for c in self.calls],
            "metrics": self.metrics(),
        }
