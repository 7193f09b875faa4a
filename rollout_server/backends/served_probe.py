"""The rollout host's half of the served-weights check (`legorl_jax.core.weight_probe`):
the engine's prompt logprobs of a version's probe against the learner's, which
that version's `weights.json` carries."""

from __future__ import annotations

from pathlib import Path

from legorl_jax.core.weight_layout import read_manifest
from legorl_jax.core.weight_probe import ProbeResult, compare
from rollout_server.backends.client import EngineClient


class ProbeFailed(RuntimeError):
    """The engine does not compute what the learner computes with the weights it was given."""


async def probe_engine(
    client: EngineClient, weights_dir: str | Path, engine_dtype: str | None, model: str | None = None
) -> ProbeResult | None:
    """How far the engine's logprobs of the probe are from the learner's (through the adapter
    `model` names, if any); None when `weights_dir` carries no probe (a plain HF directory: the base model)."""
    manifest = read_manifest(Path(weights_dir))
    if manifest is None or manifest.probe is None:
        return None
    probe = manifest.probe
    # Temperature 1, where every engine's prompt logprobs are the model's own distribution.
    (choice,) = await client.complete(
        list(probe.token_ids), model=model, max_tokens=1, temperature=1.0, prompt_logprobs=0
    )
    return compare(probe, choice.prompt_logprobs or [], engine_dtype)


def failure(result: ProbeResult, weights_dir: str | Path, how: str) -> str:
    return (
        f"the engine {how} {weights_dir} computes logprobs up to {result.max_abs_diff:.3g} away from the "
        f"learner's on the probe (tolerance {result.tolerance:g}): it does not serve those weights"
    )
