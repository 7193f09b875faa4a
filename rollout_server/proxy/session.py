"""Sessions: one per trial. The key is the harness's API key and URL prefix;
a session holds the trainer's sampling, its caps, the sampled turns (for
message-level matching) and the trajectory being assembled."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from legorl_jax.core.config import SamplingConfig, SessionCaps
from rollout_server.proxy.conversation import Message, fingerprint
from rollout_server.proxy.errors import ProxyError
from rollout_server.proxy.parsed_items import ItemMemo
from rollout_server.proxy.render import PrefixMemo, SampledTurn
from rollout_server.proxy.trajectory import CapturedTrajectory

log = logging.getLogger(__name__)


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
    expires: bool = False  # made by the admin API: ended by idle expiry (`SessionStore.sweep`), not by a trial
    last_active: float = field(default_factory=time.monotonic)  # the last use of its key
    busy: int = 0  # engine calls under way: a session is never idle while one runs
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

    A trial's session lives until its trial deletes it, so its trajectory is
    never lost before its owner reads it. A session of the admin API
    (`expires`) also ends when its key goes unused for `idle_timeout_s`: its
    owner may be gone for good. Its trajectory is then kept, for as long
    again, to be fetched once (the admin that comes back late still gets the
    data it paid for); after that it is lost, said in a WARNING and to a later
    fetch, never dropped unsaid. `max_sessions` bounds the memory an owner
    that never deletes can take (the admin API answers 429 past it)."""

    def __init__(
        self,
        default_caps: SessionCaps | None = None,
        max_sessions: int | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.default_caps = default_caps or SessionCaps()
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[str, Session] = {}
        self._expired: dict[str, tuple[Session, float]] = {}  # key → (the session, trajectory only; when it expired)
        self._ended: OrderedDict[str, str] = OrderedDict()  # key → why it is gone, the latest max_sessions
        self._sweeper: asyncio.Task[None] | None = None

    def create(self, spec: SessionSpec, key: str | None = None, *, expires: bool = False) -> Session:
        key = key or "lr-" + secrets.token_urlsafe(24)
        if key in self._sessions or key in self._expired:
            raise ValueError(f"session {key!r} already exists")
        if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            raise StoreFull(
                f"{len(self._sessions)} live sessions, the most this proxy keeps (proxy.max_sessions): "
                "delete finished ones (DELETE /admin/sessions/<key>) or raise proxy.max_sessions "
                "(--set proxy.max_sessions=N)"
            )
        if spec.caps is None:
            spec = spec.model_copy(update={"caps": self.default_caps})
        session = Session(key, spec, expires=expires)
        self._sessions[key] = session
        self._ended.pop(key, None)
        if expires:
            self._start_sweeping()
        return session

    def get(self, key: str | None) -> Session | None:
        """The live session of `key`; a use of the key, so it is not idle."""
        session = self._sessions.get(key) if key else None
        if session is not None:
            session.last_active = time.monotonic()
        return session

    def delete(self, key: str) -> Session | None:
        return self._sessions.pop(key, None)

    def take_expired(self, key: str) -> Session | None:
        """The expired session of `key` (its trajectory) once; it is freed."""
        held = self._expired.pop(key, None)
        if held is None:
            return None
        self._end(key, "it expired after going idle and its trajectory was fetched once already")
        return held[0]

    def gone(self, key: str | None) -> str | None:
        """Why `key` names no live session, when it named an expired one."""
        if not key:
            return None
        if key in self._expired:
            return (
                "it expired after going idle; its trajectory waits to be fetched (GET /admin/sessions/<key>/trajectory)"
            )
        return self._ended.get(key)

    def sweep(self, now: float | None = None) -> None:
        """Expires the admin API's sessions idle for `idle_timeout_s` and
        frees the expired trajectories nobody fetched for as long again."""
        limit = self.idle_timeout_s
        if limit is None:
            return
        now = time.monotonic() if now is None else now
        idle = [s for s in self._sessions.values() if s.expires and not s.busy and now - s.last_active >= limit]
        for session in idle:
            del self._sessions[session.key]
            # Only the trajectory and what labels it are kept: turns and render memos are freed now.
            kept = Session(session.key, session.spec, session.created, expires=True, trajectory=session.trajectory)
            self._expired[session.key] = (kept, now)
            log.warning(
                "proxy session %s expired after %g s idle (proxy.session_idle_timeout_s); its trajectory "
                "(%d calls) is kept %g s more for one fetch (GET /admin/sessions/<key>/trajectory)",
                session.spec.labels or "(no labels)",
                limit,
                len(session.trajectory.calls),
                limit,
            )
        for key, (session, expired) in list(self._expired.items()):
            if now - expired >= limit:
                del self._expired[key]
                log.warning(
                    "proxy session %s: its trajectory (%d calls) was not fetched within %g s of its expiry "
                    "and is lost (proxy.session_idle_timeout_s)",
                    session.spec.labels or "(no labels)",
                    len(session.trajectory.calls),
                    limit,
                )
                self._end(key, f"it expired after going idle and its trajectory, not fetched within {limit:g} s "
                          "(proxy.session_idle_timeout_s), is lost")  # fmt: skip

    def _end(self, key: str, why: str) -> None:
        self._ended[key] = why
        while len(self._ended) > (self.max_sessions or 4096):  # a bound on the memory of keys gone
            self._ended.popitem(last=False)

    def _start_sweeping(self) -> None:
        """Sweeps in the background of the running event loop, from the first expiring session on."""
        if self.idle_timeout_s is None or (self._sweeper is not None and not self._sweeper.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a direct caller): `sweep` is theirs to call
            return
        self._sweeper = loop.create_task(self._sweep_forever(), name="proxy-session-sweep")

    async def _sweep_forever(self) -> None:
        assert self.idle_timeout_s is not None
        period = min(max(self.idle_timeout_s / 4, 0.05), 30.0)  # expiry is at most a quarter late
        while self._sessions or self._expired:
            await asyncio.sleep(period)
            self.sweep()

    def __len__(self) -> int:
        return len(self._sessions)
