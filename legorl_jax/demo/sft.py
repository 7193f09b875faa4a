"""Supervised warm start: cross-entropy on the assistant tokens of demonstrations.

Small on purpose: one demonstration sequence per batch row, padded to one
static length (a single compilation), AdamW from optax, a jitted nnx step.
Training stops as soon as the policy would reproduce a demonstration with the
target probability when sampling at temperature 1 (`pass_estimate`),
so the warm-started model is able but unreliable: it passes sometimes, and RL
has room to raise the rate. `max_steps` bounds the time either way.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field

from legorl_jax.demo.demonstrations import Demonstration
from legorl_jax.models import CausalLM, token_logprobs

_LENGTH_QUANTUM = 128
_EVAL_ROWS = 4  # rows per evaluation call; the accuracy pass holds their full logits


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_steps: int = Field(900, gt=0, description="Upper bound on optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Demonstration sequences per step.")
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip_norm: float = Field(1.0, gt=0)
    eval_every: int = Field(25, gt=0, description="Steps between pass-rate estimates (the stopping check).")
    eval_groups: int = Field(
        24,
        gt=0,
        description="(task, configuration) groups the stopping check estimates on: a seeded sample, "
        "since a forward pass over every demonstration costs as much as many training steps.",
    )
    # The estimate is a lower bound (other episodes pass too). The demo's warm start imitates a teacher that
    # acts a third of the time, so its estimate cannot pass 1/3: 0.25 means it copies the task's values well.
    target_pass: float = Field(
        0.25, gt=0, le=1, description="Stop once the estimated temperature-1 episode pass rate reaches this."
    )
    seed: int = 0


@dataclass(frozen=True)
class SFTData:
    """Demonstration sequences as padded rows: tokens int32[N, T], loss mask float32[N, T]."""

    tokens: np.ndarray
    mask: np.ndarray
    episode: np.ndarray  # int32[N]: which demonstration (episode) a row belongs to
    groups: tuple[tuple[int, ...], ...]  # passing episodes of the same (task, configuration)


def prepare(demos: Sequence[Demonstration], pad_id: int, *, max_len: int | None = None) -> SFTData:
    """Rows for every captured sequence, padded to a multiple of 128 (one jit shape)."""
    rows = [(i, ids, mask) for i, demo in enumerate(demos) for ids, mask in demo.sequences]
    if not rows:
        raise ValueError("no demonstration sequences to train on")
    longest = max(len(ids) for _, ids, _ in rows)
    if max_len is not None and longest > max_len:
        raise ValueError(f"a demonstration has {longest} tokens, more than max_len={max_len}")
    width = -(-longest // _LENGTH_QUANTUM) * _LENGTH_QUANTUM
    tokens = np.full((len(rows), width), pad_id, np.int32)
    masks = np.zeros((len(rows), width), np.float32)
    for r, (_, ids, mask) in enumerate(rows):
        tokens[r, : len(ids)] = ids
        masks[r, : len(mask)] = mask
    by_group: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, demo in enumerate(demos):
        if demo.reward == 1.0:  # the pass estimate counts only episodes that pass
            by_group[demo.group].append(i)
    episode = np.array([i for i, _, _ in rows], np.int32)
    return SFTData(tokens, masks, episode, tuple(tuple(g) for g in by_group.values()))


def _masked_logprobs(model: CausalLM, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log p of every next token, and the mask shifted onto the predicted positions."""
    return token_logprobs(model, tokens), mask[:, 1:]


def sft_loss(model: CausalLM, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of the masked (assistant) tokens."""
    logp, target_mask = _masked_logprobs(model, tokens, mask)
    return -(logp * target_mask).sum() / jnp.maximum(target_mask.sum(), 1.0)


@nnx.jit
def _train_step(model: CausalLM, optimizer: nnx.Optimizer, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(sft_loss)(model, tokens, mask)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _row_logp(model: CausalLM, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Per row: summed log-likelihood of the masked tokens."""
    logp, target_mask = _masked_logprobs(model, tokens, mask)
    return (logp * target_mask).sum(-1)


@nnx.jit
def _row_hits(model: CausalLM, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Per row: masked tokens the argmax predicts (full logits: a few rows at a time only)."""
    hits = (jnp.argmax(model(tokens)[:, :-1], axis=-1) == tokens[:, 1:]).astype(jnp.float32)
    return (hits * mask[:, 1:]).sum(-1)


def _per_row(fn: Callable[..., jax.Array], model: CausalLM, data: SFTData) -> np.ndarray:
    out = []
    for start in range(0, len(data.tokens), _EVAL_ROWS):
        rows = slice(start, start + _EVAL_ROWS)
        out.append(np.asarray(fn(model, jnp.asarray(data.tokens[rows]), jnp.asarray(data.mask[rows]))))
    return np.concatenate(out).astype(np.float64)


def pass_estimate(model: CausalLM, data: SFTData, row_logp: np.ndarray | None = None) -> float:
    """Mean over (task, configuration) of P(sampling at temperature 1 reproduces one of its demonstrations).

    Token for token, summed over plans (disjoint events). A lower bound on the
    pass rate, since other successful episodes exist.
    """
    if row_logp is None:
        row_logp = _per_row(_row_logp, model, data)
    episode_logp = np.bincount(data.episode, weights=row_logp)
    return float(np.mean([sum(math.exp(episode_logp[e]) for e in group) for group in data.groups]))


def sample_groups(data: SFTData, count: int, seed: int) -> SFTData:
    """The rows of a seeded sample of `count` groups (all of them when there are fewer)."""
    if count >= len(data.groups):
        return data
    picked = np.random.default_rng(seed).choice(len(data.groups), size=count, replace=False)
    groups = [data.groups[i] for i in sorted(picked)]
    episodes = sorted({e for group in groups for e in group})
    renumber = {e: i for i, e in enumerate(episodes)}
    rows = np.flatnonzero(np.isin(data.episode, episodes))
    return SFTData(
        data.tokens[rows],
        data.mask[rows],
        np.array([renumber[e] for e in data.episode[rows]], np.int32),
        tuple(tuple(renumber[e] for e in group) for group in groups),
    )


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean NLL per assistant token
    token_accuracy: float  # share of assistant tokens the argmax predicts
    episode_pass_estimate: float  # see pass_estimate


def evaluate(model: CausalLM, data: SFTData) -> Evaluation:
    """Teacher-forced statistics over every demonstration."""
    row_logp = _per_row(_row_logp, model, data)
    total = max(float(data.mask[:, 1:].sum()), 1.0)
    return Evaluation(
        loss=float(-row_logp.sum() / total),
        token_accuracy=float(_per_row(_row_hits, model, data).sum() / total),
        episode_pass_estimate=pass_estimate(model, data, row_logp),
    )


def make_optimizer(model: CausalLM, config: SFTConfig) -> nnx.Optimizer:
    # Decaying to a twentieth of the peak: the copy mechanism the demonstrations need
    # sets in late, and settles only once the steps get small.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        config.learning_rate,
        max(config.warmup_steps, 1),
        max(config.max_steps, config.warmup_steps + 1),
        end_value=config.learning_rate / 20,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@dataclass
class SFTResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # training loss of every step
    pass_estimates: list[tuple[int, float]] = field(default_factory=list)  # (step, estimate) of every check
    reached_target: bool = False


def train_sft(
    model: CausalLM,
    data: SFTData,
    config: SFTConfig = SFTConfig(),
    *,
    on_step: Callable[[int, float, float | None], None] | None = None,
) -> SFTResult:
    """Train `model` in place until the pass estimate reaches the target or `max_steps` pass.

    Rows are drawn without replacement within an epoch, seeded. `on_step` sees
    (step, training loss, the pass estimate when one was computed this step).
    """
    optimizer = make_optimizer(model, config)
    rng = np.random.default_rng(config.seed)
    probe = sample_groups(data, config.eval_groups, config.seed)
    result = SFTResult(steps=0)
    order: list[int] = []
    for step in range(1, config.max_steps + 1):
        picked: list[int] = []
        while len(picked) < config.batch_size:
            if not order:
                order = list(rng.permutation(len(data.tokens)))
            picked.append(order.pop())
        loss = float(_train_step(model, optimizer, jnp.asarray(data.tokens[picked]), jnp.asarray(data.mask[picked])))
        if not math.isfinite(loss):
            raise FloatingPointError(f"SFT loss became {loss} at step {step}; lower the learning rate")
        result.losses.append(loss)
        result.steps = step
        estimate = None
        if step % config.eval_every == 0 or step == config.max_steps:
            estimate = pass_estimate(model, probe)
            result.pass_estimates.append((step, estimate))
        if on_step is not None:
            on_step(step, loss, estimate)
        if estimate is not None and estimate >= config.target_pass:
            result.reached_target = True
            break
    return result
