"""What flows in and out of the engine: a generation request with its
sampling parameters, the events it emits to its sink, and the engine's
per-row state (`Slot`), which the scheduler also reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None
    version: str = "default"  # the policy version label of the weights that sampled it (vLLM's weight_versions)


@dataclasses.dataclass(frozen=True)
class PromptEntry:
    """Logprob of one prompt token (given the tokens before it), its rank,
    and the best alternatives as (id, logprob) when asked for."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class PromptLogprobsEvent:
    entries: list[PromptEntry]  # one per prompt token after the first


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    stop_token: int | None = None


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    message: str


Event = TokenEvent | PromptLogprobsEvent | FinishEvent | ErrorEvent


@dataclasses.dataclass
class GenRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]


@dataclasses.dataclass
class Slot:
    request: GenRequest
    tokens: list[int]
    blocks: list[int]
    cached: int = 0
    prompt_entries: list[PromptEntry] | None = None
    registered: tuple[int, int | None] = (0, None)  # prefix-cache walk: (blocks walked, last block)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_entries is not None and self.cached < len(self.request.prompt)
