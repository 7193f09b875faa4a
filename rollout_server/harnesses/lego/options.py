"""The lego harness's configuration space: declared axes plus fixed knobs.

Each axis is a `Literal` field, so the space is read off the model itself and
`axes()` can never disagree with what validation accepts. A run trains on a
diverse subset of configurations (`sample_configs`), labelled in metrics by
`config_id`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import typing
from typing import Literal

from pydantic import Field

from ..base import HarnessConfigError, HarnessOptions

TURN_BUDGETS: dict[str, int] = {"short": 6, "medium": 12, "long": 24}

AXIS_NAMES: tuple[str, ...] = ("tools", "prompt", "context", "observation", "turn_budget")


class LegoOptions(HarnessOptions):
    # --- axes -------------------------------------------------------------
    tools: Literal["bash_only", "edit_tools", "minimal"] = Field(
        "edit_tools",
        description="bash_only: bash, finish by answering; edit_tools: bash + view_file + write_file + "
        "str_replace + submit; minimal: POSIX-sh run + submit.",
    )
    prompt: Literal["terse", "guided", "plan_first"] = Field(
        "guided", description="System prompt style; plan_first adds a tool-less planning call first."
    )
    context: Literal["full", "window", "summarize"] = Field(
        "full",
        description="full: whole history; window: task + last window_turns turns; summarize: when the "
        "history passes context_budget_chars, the model summarises it and the loop restarts from the summary.",
    )
    observation: Literal["raw", "truncated", "structured"] = Field(
        "truncated",
        description="raw: output as is (cut at max_observation_chars); truncated: head + tail at "
        "truncate_chars; structured: exit code plus stdout/stderr sections, each head + tail.",
    )
    turn_budget: Literal["short", "medium", "long"] = Field(
        "medium", description=f"Agent model calls allowed: {TURN_BUDGETS}."
    )
    # --- knobs outside the sampled space ----------------------------------
    stream: bool = Field(False, description="Stream chat completions (SSE) instead of one JSON answer.")
    window_turns: int = Field(4, ge=1, description="Turns kept by context=window.")
    context_budget_chars: int = Field(24_000, ge=1_000, description="History size that triggers summarising.")
    truncate_chars: int = Field(2_000, ge=200, description="Observation size for truncated/structured.")
    max_observation_chars: int = Field(30_000, ge=1_000, description="Hard cap on any observation.")
    tool_timeout_s: float = Field(60.0, gt=0, description="Wall-clock limit of one tool execution.")
    request_timeout_s: float = Field(600.0, gt=0, description="Limit on one model call.")
    max_retries: int = Field(0, ge=0, le=5, description="SDK retries on 5xx/connection errors.")

    @property
    def max_turns(self) -> int:
        return TURN_BUDGETS[self.turn_budget]


def axes() -> dict[str, tuple[str, ...]]:
    """Every axis and its options, in declaration order."""
    return {name: typing.get_args(LegoOptions.model_fields[name].annotation) for name in AXIS_NAMES}


def config_id(options: LegoOptions) -> str:
    """Readable and stable: the axis values, plus a digest of any knob changed from its default."""
    label = ".".join(str(getattr(options, name)) for name in AXIS_NAMES)
    knobs = {k: v for k, v in options.model_dump(mode="json", exclude_defaults=True).items() if k not in AXIS_NAMES}
    if knobs:
        label += "~" + hashlib.sha1(json.dumps(knobs, sort_keys=True).encode()).hexdigest()[:6]
    return label


def space_size() -> int:
    size = 1
    for options in axes().values():
        size *= len(options)
    return size


def sample_configs(k: int, rng: random.Random, base: LegoOptions | None = None) -> list[LegoOptions]:
    """k distinct configurations that use every option of every axis as evenly as k allows.

    Each axis gets a column of k values made of shuffled repeats of its options
    (balanced, so any k >= 3 covers every option); rows that collide with an
    earlier one are replaced by an unused configuration drawn at random.
    `base` supplies the non-axis knobs.
    """
    if not 1 <= k <= space_size():
        raise HarnessConfigError(f"lego: k must be in [1, {space_size()}], got {k}")
    space = axes()
    columns = {name: _balanced_column(opts, k, rng) for name, opts in space.items()}
    rows = [tuple(columns[name][i] for name in space) for i in range(k)]
    seen: set[tuple[str, ...]] = set()
    for i, row in enumerate(rows):
        if row in seen:
            unused = [r for r in itertools.product(*space.values()) if r not in seen]
            row = rows[i] = rng.choice(unused)
        seen.add(row)
    knobs = (base or LegoOptions()).model_dump(exclude=set(AXIS_NAMES))
    return [LegoOptions.model_validate({**knobs, **dict(zip(space, row, strict=True))}) for row in rows]


def _balanced_column(options: tuple[str, ...], k: int, rng: random.Random) -> list[str]:
    column: list[str] = []
    while len(column) < k:
        block = list(options)
        rng.shuffle(block)
        column.extend(block)
    return column[:k]
