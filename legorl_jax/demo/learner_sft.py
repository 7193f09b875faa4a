"""The demo warm start through `legorl sft`'s learner: `demo/sft.py`'s training, with the step of
`train/step.py`'s `Learner` (the `nll` loss, `learner.share_prefixes`, fitted micro-batches).

Everything but the step is `demo/sft.py`'s (`train_steps`): the rows of each
step (one configuration's with `batch_by_config`), the buckets up to
`row_tokens`, the token budget, and the stop once the pass estimate reaches
the target. The demo's schedule (warm-up, cosine to a twentieth of the peak)
and weight decay are the learner's `OptimizerConfig` (`final_lr_fraction`).
On real CLI episodes both steps pack alike (the same rows, tokens computed and
loss) and take the same time within the noise of a loaded machine
(`scripts/bench_cli_sft.py`, docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable

from legorl_jax.core.config import LearnerConfig, MeshConfig, OptimizerConfig, RLConfig
from legorl_jax.demo.sft import (
    DEMO_LR_DECAY,
    SFTConfig,
    SFTData,
    SFTResult,
    step_layout,
    step_sequences,
    train_steps,
)
from legorl_jax.models import CausalLM
from legorl_jax.train.sft import sft_rl
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner


def demo_learner_config(config: SFTConfig, width: int) -> LearnerConfig:
    """The learner section that trains like `config` on demonstrations up to `width` tokens
    (padded): its buckets and token budget, prefix sharing and optimizer."""
    buckets, budget = step_layout(config, width)
    optimizer = OptimizerConfig(
        learning_rate=config.learning_rate,
        warmup_steps=max(config.warmup_steps, 1),
        schedule="cosine",
        total_steps=max(config.max_steps, config.warmup_steps + 1),
        final_lr_fraction=1 / DEMO_LR_DECAY,
        weight_decay=config.weight_decay,
        grad_clip_norm=config.grad_clip_norm,
    )
    return LearnerConfig(
        optimizer=optimizer, micro_batch_tokens=budget, length_buckets=buckets, share_prefixes=config.share_prefixes
    )


def train_sft_learner(
    model: CausalLM,
    data: SFTData,
    config: SFTConfig = SFTConfig(),
    *,
    on_step: Callable[[int, float, float | None], None] | None = None,
) -> tuple[CausalLM, SFTResult]:
    """`demo/sft.py`'s `train_sft` with the learner's step: returns the trained model (the
    learner's copy; `model` is left as it was) and the same `SFTResult`."""
    cfg = demo_learner_config(config, data.tokens.shape[1])
    learner = Learner(model, sft_rl(RLConfig()), cfg, learner_mesh(MeshConfig()))

    def update(picked: list[int]) -> float:
        return float(learner.update(learner.pack(step_sequences(data, picked))).metrics["loss"])

    result = train_steps(data, config, update, learner.model, on_step=on_step)
    return learner.model(), result
