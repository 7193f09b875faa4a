"""Supervised warm start: cross-entropy on the assistant tokens of demonstrations, through
`legorl sft`'s step.

The step is `train/step.py`'s `Learner` with the `nll` loss (`train/sft.py`
`sft_rl`): a step's demonstrations are packed by the learner's packer
(`legorl_jax.rl.batching`): rows padded only to their length bucket, and,
with `share_prefixes`, demonstrations that start alike (one CLI's long system
prompt) laid out as a trie so the shared prefix is computed once per row.
Only prompt tokens are shared and padding is masked, so the loss is exactly
the padded one's. What is the demo's own is around the step: which rows a step
takes, the schedule, and the stop: training ends as soon as the policy would
reproduce a demonstration with the target probability when sampling at
temperature 1 (`pass_estimate`), so the warm-started model is able but
unreliable: it passes sometimes, and RL has room to raise the rate.
`max_steps` bounds the time either way.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field

from legorl_jax.core.config import LearnerConfig, MeshConfig, OptimizerConfig, RLConfig
from legorl_jax.demo.demonstrations import Demonstration
from legorl_jax.models import CausalLM, token_logprobs
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.sft import sft_rl
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

_LENGTH_QUANTUM = 128
# Bucket lengths: 512, 640, 768, 896, 1024, 1280, ... (a row padded by a fifth at most: a row's padding
# costs the step about what real tokens cost). Below 512 a bucket saves less than its extra compilation costs.
_BUCKET_BASES = (512, 640, 768, 896)
_EVAL_ROWS = 4  # rows per evaluation call; the accuracy pass holds their full logits
# Evaluation pads rows to powers of two: each width compiles two programs for a pass that runs a few
# times a build, so fewer widths beat less padding there.
_EVAL_BUCKET_BASES = (512,)
# The schedule decays to a twentieth of the peak: the copy mechanism the demonstrations need
# sets in late, and settles only once the steps get small.
DEMO_LR_DECAY = 20


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
    share_prefixes: bool = Field(
        True,
        description="Lay out a step's demonstrations that share a prompt prefix as a trie, the prefix computed "
        "once per row (exact: the loss is the unshared one).",
    )
    batch_by_config: bool = Field(
        False,
        description="Draw each step's rows from one harness configuration, so that with share_prefixes their "
        "common system prompt is computed once; otherwise rows of every configuration mix.",
    )
    row_tokens: int | None = Field(
        None,
        gt=0,
        description="Longest row a step packs into (its largest bucket): room for a shared prompt and several "
        "demonstrations' own tokens. None: the longest demonstration, padded to a multiple of 128.",
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Token slots (rows x bucket) per forward/backward call; a step runs as many calls as its "
        "rows need and sums their gradients. None: batch_size rows of the largest bucket.",
    )
    seed: int = 0


@dataclass(frozen=True)
class SFTData:
    """Demonstration sequences as rows padded to the longest: tokens int32[N, T], loss mask float32[N, T].

    Training and evaluation cut each row back to `lengths` and pad it only to its bucket (`sft_buckets`).
    """

    tokens: np.ndarray
    mask: np.ndarray
    episode: np.ndarray  # int32[N]: which demonstration (episode) a row belongs to
    groups: tuple[tuple[int, ...], ...]  # passing episodes of the same (task, configuration)
    lengths: np.ndarray  # int32[N]: real tokens of each row
    config: np.ndarray  # int32[N]: the row's harness configuration, numbered in order of appearance


def sft_buckets(width: int, row_tokens: int | None = None, bases: Sequence[int] = _BUCKET_BASES) -> list[int]:
    """Row lengths rows are padded to: 512, 640, 768, 896, 1024, ... (`bases` doubled) below
    `row_tokens`, then the padded `width` of the longest demonstration and `row_tokens` (default: the width)."""
    top = width if row_tokens is None else row_tokens
    if top < width:
        raise ValueError(f"sft.row_tokens={top} is shorter than the longest demonstration ({width} tokens padded)")
    ladder = {base << k for base in bases for k in range(top.bit_length())}
    return sorted({b for b in ladder if b < top} | {width, top})


def prepare(demos: Sequence[Demonstration], pad_id: int, *, max_len: int | None = None) -> SFTData:
    """Rows for every captured sequence, padded to a multiple of 128."""
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
    lengths = np.array([len(ids) for _, ids, _ in rows], np.int32)
    config_number: dict[str, int] = {}
    config = np.array([config_number.setdefault(demos[i].config_id, len(config_number)) for i, _, _ in rows], np.int32)
    return SFTData(tokens, masks, episode, tuple(tuple(g) for g in by_group.values()), lengths, config)


def step_sequences(data: SFTData, rows: Sequence[int]) -> list[TrainSequence]:
    """`rows` as the learner's packer takes them, cut to their real lengths."""
    return [
        TrainSequence(
            data.tokens[r, : data.lengths[r]],
            data.mask[r, : data.lengths[r]] > 0,
            np.zeros(data.lengths[r], np.float32),  # the packer wants behaviour logprobs; SFT has none
            advantage=1.0,
        )
        for r in rows
    ]


def _masked_logprobs(model: CausalLM, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log p of every next token, and the mask shifted onto the predicted positions."""
    return token_logprobs(model, tokens), mask[:, 1:]


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
    """`fn` of every row, a few rows at a time, rows of like length together and padded to their bucket."""
    order = np.argsort(data.lengths, kind="stable")
    out = np.zeros(len(order), np.float64)
    for start in range(0, len(order), _EVAL_ROWS):
        rows = order[start : start + _EVAL_ROWS]
        width = next(
            b for b in sft_buckets(data.tokens.shape[1], bases=_EVAL_BUCKET_BASES) if b >= data.lengths[rows].max()
        )
        tokens, mask = jnp.asarray(data.tokens[rows, :width]), jnp.asarray(data.mask[rows, :width])
        out[rows] = np.asarray(fn(model, tokens, mask))
    return out


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
        data.lengths[rows],
        data.config[rows],
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


@dataclass
class SFTResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # training loss of every step
    pass_estimates: list[tuple[int, float]] = field(default_factory=list)  # (step, estimate) of every check
    reached_target: bool = False


def _step_rows(data: SFTData, config: SFTConfig) -> Iterator[list[int]]:
    """Every step's rows, endlessly: rows with an assistant token (one without adds nothing to
    the loss) drawn without replacement within an epoch, seeded. With `batch_by_config` a step
    takes rows of one configuration only, the last of each configuration's epoch fewer."""
    trainable = np.flatnonzero(data.mask.any(axis=1))
    if not len(trainable):
        raise ValueError("no demonstration sequence has an assistant token to train on")
    rng = np.random.default_rng(config.seed)
    size = config.batch_size
    if not config.batch_by_config:
        order: list[int] = []
        while True:
            picked: list[int] = []
            while len(picked) < size:
                if not order:
                    order = list(trainable[rng.permutation(len(trainable))])
                picked.append(order.pop())
            yield picked
    while True:
        batches = []
        for c in np.unique(data.config[trainable]):
            rows = rng.permutation(trainable[data.config[trainable] == c])
            batches += [rows[i : i + size].tolist() for i in range(0, len(rows), size)]
        yield from (batches[b] for b in rng.permutation(len(batches)))


def step_layout(config: SFTConfig, width: int) -> tuple[list[int], int]:
    """The buckets a step's rows are padded to, for demonstrations up to `width` tokens (padded),
    and the token budget of one call."""
    buckets = sft_buckets(width, config.row_tokens)
    budget = config.micro_batch_tokens or config.batch_size * buckets[-1]
    if budget < buckets[-1]:
        raise ValueError(f"sft.micro_batch_tokens={budget} holds no row of the largest bucket ({buckets[-1]} tokens)")
    return buckets, budget


def train_steps(
    data: SFTData,
    config: SFTConfig,
    update: Callable[[list[int]], float],
    policy: Callable[[], CausalLM],
    *,
    on_step: Callable[[int, float, float | None], None] | None = None,
) -> SFTResult:
    """The warm start around a step: `update` takes each step's rows (`_step_rows`) through one
    optimizer step and returns its loss; the pass estimate of `policy()` every `eval_every`
    steps stops training once it reaches the target, else `max_steps` do."""
    probe = sample_groups(data, config.eval_groups, config.seed)
    result = SFTResult(steps=0)
    for step, picked in zip(range(1, config.max_steps + 1), _step_rows(data, config), strict=False):
        loss = update(picked)
        if not math.isfinite(loss):
            raise FloatingPointError(f"SFT loss became {loss} at step {step}; lower the learning rate")
        result.losses.append(loss)
        result.steps = step
        estimate = None
        if step % config.eval_every == 0 or step == config.max_steps:
            estimate = pass_estimate(policy(), probe)
            result.pass_estimates.append((step, estimate))
        if on_step is not None:
            on_step(step, loss, estimate)
        if estimate is not None and estimate >= config.target_pass:
            result.reached_target = True
            break
    return result


def learner_config(config: SFTConfig, width: int) -> LearnerConfig:
    """The learner section that trains like `config` on demonstrations up to `width` tokens
    (padded): its buckets and token budget, prefix sharing, and the demo's schedule (warm-up,
    cosine to a twentieth of the peak) and weight decay."""
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


def train_sft(
    model: CausalLM,
    data: SFTData,
    config: SFTConfig = SFTConfig(),
    *,
    on_step: Callable[[int, float, float | None], None] | None = None,
) -> tuple[CausalLM, SFTResult]:
    """Train a copy of `model` with `legorl sft`'s step until the pass estimate reaches the
    target or `max_steps` pass (`train_steps`); returns the trained model and what happened
    (`model` is left as it was). `on_step` sees (step, training loss, the pass estimate when one
    was computed this step)."""
    cfg = learner_config(config, data.tokens.shape[1])
    learner = Learner(model, sft_rl(RLConfig()), cfg, learner_mesh(MeshConfig()))

    def update(picked: list[int]) -> float:
        return float(learner.update(learner.pack(step_sequences(data, picked))).metrics["loss"])

    result = train_steps(data, config, update, learner.model, on_step=on_step)
    return learner.model(), result
