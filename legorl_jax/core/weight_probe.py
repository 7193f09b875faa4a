"""The served-weights check: a version is served only once the engine is seen
to compute what the learner computes.

With every published version the learner writes, in its `weights.json`, the
logprobs its own weights give a fixed probe sequence (`WeightProbe`). After
loading that version (and after any engine restart) a rollout host asks its
engine for the same sequence's prompt logprobs and compares (`compare`). A
reload that loaded nothing, a wrong delta or a dtype slip shows up here, at
the step it happens, instead of as training on another policy's samples.

The tolerance comes from the dtypes in play: the weights as stored, the
learner's compute dtype and the engine's. Any 16-bit one bounds the agreement
to what bfloat16 rounding allows; float32 throughout must agree closely.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

PROBE_TOKENS = 32
# Ids drawn from the first 1,024 only: every vocabulary has them (byte-level BPE's
# bytes and first merges), where ids past a tokenizer's own size, in a checkpoint
# whose embedding is padded, are refused by vLLM.
PROBE_ID_RANGE = 1024
PROBE_SEED = 0x5EED

# Max |learner - engine| over the probe's logprobs, per the least precise dtype in play.
# float32: kernels differ in summation order only (a few 1e-5 on the demo model);
# bfloat16: an 8-bit mantissa in every weight and activation (about 0.05 on the demo).
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.3, "float16": 0.1}


def probe_token_ids(vocab_size: int) -> list[int]:
    """The fixed probe sequence for a vocabulary of `vocab_size`."""
    rng = np.random.default_rng(PROBE_SEED)
    return [int(t) for t in rng.integers(0, min(vocab_size, PROBE_ID_RANGE), PROBE_TOKENS)]


@dataclasses.dataclass(frozen=True)
class WeightProbe:
    """The learner's logprob of each probe token after the first, and the dtypes it and the stored weights used."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    dtypes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "logprobs": list(self.logprobs), "dtypes": list(self.dtypes)}

    @classmethod
    def from_json(cls, raw: Any) -> WeightProbe:
        probe = cls(tuple(int(t) for t in raw["token_ids"]), tuple(float(x) for x in raw["logprobs"]),
                    tuple(str(d) for d in raw["dtypes"]))  # fmt: skip
        if len(probe.logprobs) != len(probe.token_ids) - 1 or not all(math.isfinite(x) for x in probe.logprobs):
            raise ValueError(
                f"a probe of {len(probe.token_ids)} tokens needs {len(probe.token_ids) - 1} finite logprobs"
            )
        return probe


def tolerance(dtypes: Iterable[str | None]) -> float:
    """The loosest tolerance of the dtypes in play (None: an engine's unknown default, taken as bfloat16)."""
    return max(TOLERANCE.get(d or "bfloat16", TOLERANCE["bfloat16"]) for d in dtypes)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    max_abs_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def compare(probe: WeightProbe, engine_logprobs: Sequence[float | None], engine_dtype: str | None) -> ProbeResult:
    """The engine's prompt logprobs of the probe (its first entry None) against the learner's."""
    ours = list(engine_logprobs)[1:]
    if len(ours) != len(probe.logprobs) or any(x is None or not math.isfinite(x) for x in ours):
        return ProbeResult(math.inf, tolerance((*probe.dtypes, engine_dtype)))
    diff = max(abs(float(a) - b) for a, b in zip(ours, probe.logprobs, strict=True))  # type: ignore[arg-type]
    return ProbeResult(diff, tolerance((*probe.dtypes, engine_dtype)))
