"""Sessions: one per trial. The key is the harness's API key and URL prefix;
a session holds the trainer's sampling, its caps, the sampled turns (for
message-level matching) and the trajectory being assembled."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from legorl_jax.core.config import SamplingConfig, SessionCaps
from rollout_server.proxy.conversation import Message, fingerprint
from rollout_server.proxy.errors import ProxyError
from rollout_server.proxy.parsed_items import ItemMemo
from rollout_server.proxy.render import PrefixMemo, SampledTurn
from rollout_server.proxy.trajectory import CapturedTrajectory


class SessionSpec(BaseModel):
    """What the trainer (or the admin API) decides for a session."""

    model_config = ConfigDict(extra="forbid")

    sampling: SamplingConfig = SamplingConfig()
    caps: SessionCaps | None = Field(None, description="None takes the proxy's configured caps.")
    labels: dict[str, str] = Field({}, description="Free-form tags echoed in the trajectory (task, harness, ...).")
    policy_version: int = Field(0, ge=0, description="Weights version the engine serves for this session.")
    seed: int | None = Field(
        None,
        ge=1,
        lt=2**63,
        description="Base seed: each model call samples with a seed derived from it and the call's ordinal, so an "
        "episode is reproducible; None: unseeded.",
    )
    enable_thinking: bool | None = Field(
        None, description="Chat-template thinking flag; None follows the harness's request (on when it is silent)."
    )
    recompute_logprobs: bool = Field(
        False,
        description="When a call's history was rewritten (a new sequence that reuses sampled turns), also "
        "ask the engine for the prompt's logprobs, so the reused sampled tokens are trained in the new sequence.",
    )


@dataclass
class Session:
    key: str
    spec: SessionSpec
    created: float = field(default_factory=time.monotonic)
    trajectory: CapturedTrajectory = field(default_factory=CapturedTrajectory)
    turns: list[SampledTurn] = field(default_factory=list)
    calls_started: int = 0
    prefix: PrefixMemo = field(default_factory=PrefixMemo)  # the last render, for incremental rendering
    # The last conversation as sent to each dialect's routes, parsed: an item parses differently in each.
    parsed: dict[str, ItemMemo] = field(default_factory=dict)
    _by_call_id: dict[str, SampledTurn] = field(default_factory=dict)
    _by_fingerprint: dict[str, list[SampledTurn]] = field(default_factory=dict)

    def add_turn(self, turn: SampledTurn) -> None:
        self.turns.append(turn)
        for call in turn.output.tool_calls:
            self._by_call_id[call.id] = turn
        self._by_fingerprint.setdefault(fingerprint(turn.output.content, turn.output.tool_calls), []).append(turn)

    def match_turns(self, messages: list[Message]) -> dict[int, SampledTurn]:
        """Assistant messages (by position) matched to the turns that produced
        them: by tool-call id first, else by content and parsed arguments.
        Matches keep their order, so a repeated answer maps to the right turn."""
        matched: dict[int, SampledTurn] = {}
        floor = -1
        for i, message in enumerate(messages):
            if message.role != "assistant":
                continue
            turn = next((self._by_call_id[c.id] for c in message.tool_calls if c.id in self._by_call_id), None)
            if turn is None or turn.index <= floor:
                candidates = self._by_fingerprint.get(fingerprint(message.content, message.tool_calls), [])
                turn = next((t for t in candidates if t.index > floor), None)
            if turn is not None:
                matched[i] = turn
                floor = turn.index
        return matched

    def check_caps(self) -> None:
        """Refuses a new call once a cap is reached, and marks the trajectory."""
        caps = self.spec.caps
        assert caps is not None, "SessionStore.create fills in the caps"
        name = None
        if self.calls_started >= caps.max_model_calls:
            name = "max_model_calls"
        elif self.trajectory.total_tokens >= caps.max_total_tokens:
            name = "max_total_tokens"
        elif time.monotonic() - self.created >= caps.max_wall_s:
            name = "max_wall_s"
        if name is not None:
            hit = f"{name} ({getattr(caps, name)})"
            self.trajectory.cap_hit = self.trajectory.cap_hit or hit
            # Say which setting refused and where it is set, so that a user whose real session
            # outgrew it can raise it without reading the source.
            raise ProxyError(
                "cap_exceeded",
                f"session limit reached: {hit}; raise proxy.{name} (--set proxy.{name}=N), "
                "or this session's caps in the admin API (POST /admin/sessions)",
            )


class StoreFull(Exception):
    """The store holds `max_sessions` live sessions; a new one waits for a delete."""


class SessionStore:
    """All live sessions of one proxy; the rollout server shares it in-process.

    A session lives until it is deleted, so its trajectory is never lost
    before its owner reads it; `max_sessions` bounds the memory an owner that
    never deletes can take (the admin API answers 429 past it)."""

    def __init__(self, default_caps: SessionCaps | None = None, max_sessions: int | None = None) -> None:
        self.default_caps = default_caps or SessionCaps()
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}

    def create(self, spec: SessionSpec, key: str | None = None) -> Session:
        key = key or "lr-" + secrets.token_urlsafe(24)
        if key in self._sessions:
            raise ValueError(f"session {key!r} already exists")
        if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            raise StoreFull(
                f"{len(self._sessions)} live sessions, the most this proxy keeps (proxy.max_sessions): "
                "delete finished ones (DELETE /admin/sessions/<key>) or raise proxy.max_sessions "
                "(--set proxy.max_sessions=N)"
            )
        if spec.caps is None:
            spec = spec.model_copy(update={"caps": self.default_caps})
        session = Session(key, spec)
        self._sessions[key] = session
        return session

    def get(self, key: str | None) -> Session | None:
        return self._sessions.get(key) if key else None

    def delete(self, key: str) -> Session | None:
        return self._sessions.pop(key, None)

    def __len__(self) -> int:
        return len(self._sessions)
