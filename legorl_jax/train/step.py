"""The sharded GRPO train step with exact gradient accumulation.

One optimizer step = one `PackedStep`: for each micro-batch a jitted
`micro_step` adds the gradient of Σ w·loss (the aggregation numerator) into a
device-resident accumulator; `apply_update` then divides once by the step's
normaliser, clips, and applies AdamW. Because the normaliser is fixed before the
first micro-batch, k micro-batches give the same update as one big batch, and
padding rows (weight 0) change nothing, whatever row count a micro-batch has.
`micro_step` compiles once per micro-batch shape: a bucket and one of the few row
counts `batching.row_counts` allows, plain or tree rows.

Every jitted function has explicit in/out shardings over the mesh, so the same
code runs on one CPU, 8 fake devices, a GPU host or a TPU pod slice.
Rematerialisation is the model's own policy (`from_hf(..., remat=model.remat)`),
applied per scanned layer; logprobs come from the model's chunked
`token_logprobs` at the rollout temperature, computed only at the targets the
packer lists as scored (`score_index`, 0 elsewhere), where the loss reads them.
Each micro-batch's score width is one more static shape (one of a few powers
of two per bucket, or none). `update` also hands back those
per-token logprobs (`StepResult`, left on device until asked for), which
`rollouts.jsonl` records beside the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from legorl_jax.core.config import LearnerConfig, RLConfig
from legorl_jax.models import CausalLM, batch_sharding, token_logprobs_with_aux
from legorl_jax.models.lora import describe
from legorl_jax.rl.batching import MicroBatch, PackedStep, TrainSequence, pack_step
from legorl_jax.rl.losses import PolicyInputs, policy_loss
from legorl_jax.rl.metrics import finalize, merge, micro_batch_metrics
from legorl_jax.train.coordination import digest
from legorl_jax.train.optim import build_optimizer, learning_rate_schedule
from legorl_jax.train.sharding import (
    Params,
    data_parallel_size,
    like_params,
    param_shardings,
    put_batch,
    replicated,
)

Array = jax.Array
BATCH_KEYS = (
    "tokens",
    "positions",
    "segment_ids",
    "loss_mask",
    "behavior_logprobs",
    "advantages",
    "loss_weight",
    "seq_ids",
)
# Only in some micro-batches (their different pytree gives them their own trace): tree rows of shared
# prefixes, and `score_index` when few targets are scored (the LM head then runs on those alone).
OPTIONAL_KEYS = ("kv_end", "pred_from", "score_index")
FLOAT_KEYS = ("loss_mask", "behavior_logprobs", "advantages", "loss_weight")


@dataclass(frozen=True)
class StepResult:
    """One update's metrics and the per-token logprobs the loss used (the policy before the update)."""

    metrics: dict[str, float]
    packed: PackedStep
    logprobs: list[Array]  # per micro-batch, [R, T-1] like its loss inputs

    def sequence_logprobs(self) -> list[np.ndarray | None]:
        """The learner's logprob of each trained token, per packed sequence in its own token order
        (`PackedStep.per_sequence`). Copied to host only when asked for."""
        host = [
            np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))
            for x in self.logprobs
        ]
        return self.packed.per_sequence(host)


class Learner:
    """Parameters, optimizer state and the jitted step functions of one policy.

    The reference policy for the KL term (only kept when `rl.kl_coef > 0`) is the
    policy the learner starts from. A model with adapters (`models/lora.py`) trains
    only them: `params` and the optimizer hold the adapters, the base weights are
    `frozen` (sharded like parameters, never donated, no gradient). Built from an abstract model (`nnx.eval_shape`:
    shapes, no arrays) the learner holds only shapes and shardings: its step
    functions can then be lowered and compiled, not run (`legorl plan`).
    """

    def __init__(
        self, model: CausalLM, rl: RLConfig, learner: LearnerConfig, mesh: Mesh, *, max_segments: int = 16
    ) -> None:
        self.rl, self.cfg, self.mesh, self.max_segments = rl, learner, mesh, max_segments
        # Pure dicts of arrays: what optax, orbax and jit shardings handle natively.
        self.lora_spec = describe(model)  # what a checkpoint records of the adapters
        self.lora = self.lora_spec is not None
        trainable = nnx.LoRAParam if self.lora else nnx.Param
        # The first filter a variable matches takes it: without adapters `frozen` is empty.
        self.graphdef, *states = nnx.split(model, trainable, nnx.Param, ...)
        params, frozen, rest = (state.to_pure_dict() for state in states)
        self.model_config = model.config
        self.param_sh = param_shardings(params, mesh)
        self.frozen_sh = param_shardings(frozen, mesh)
        # Copies, not aliases: updates donate (free) the learner's buffers, and the
        # caller's model (or the reference policy) must survive them.
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))

        def place(fn: Any, *args: Any) -> Any:  # jitted `fn` run, or only its output shapes when abstract
            return fn.eval_shape(*args) if abstract else fn(*args)

        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_sh)
        self.params = place(copy, params)
        self.frozen = frozen if abstract else jax.device_put(frozen, self.frozen_sh)
        self._rest = place(jax.jit(lambda r: r, out_shardings=replicated(mesh)), rest)
        self.tx = build_optimizer(learner.optimizer)
        self.schedule = learning_rate_schedule(learner.optimizer)
        self.opt_sh = like_params(jax.eval_shape(self.tx.init, self.params), self.params, self.param_sh, mesh)
        self.opt_state = place(jax.jit(self.tx.init, out_shardings=self.opt_sh), self.params)
        self.ref_params = place(copy, self.params) if rl.kl_coef > 0 else None
        ref_sh = self.param_sh if self.ref_params is not None else None
        self.step = 0
        rep = replicated(mesh)
        batch_sh = batch_sharding(mesh)  # a prefix: every array of the batch, tree rows or not
        abstract_acc = self._abstract_acc()
        self._acc_sh = {
            "grads": self.param_sh,
            "loss": rep,
            "metrics": jax.tree.map(lambda _: rep, abstract_acc["metrics"]),
        }
        self._zero_acc = jax.jit(
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_acc), out_shardings=self._acc_sh
        )
        self._micro = jax.jit(
            self._micro_step,
            in_shardings=(self.param_sh, self.frozen_sh, ref_sh, self._acc_sh, batch_sh, rep),
            out_shardings=(self._acc_sh, batch_sh),
            donate_argnums=(3,),
        )
        self._apply = jax.jit(
            self._apply_update,
            in_shardings=(self.param_sh, self.opt_sh, self.param_sh, rep),
            out_shardings=(self.param_sh, self.opt_sh, rep),
            donate_argnums=(0, 1),
        )

    # ---- host side -------------------------------------------------------------
    def pack(self, seqs: list[TrainSequence], *, fit_rows: bool = True) -> PackedStep:
        """Packs one step's sequences with this learner's buckets, budget and mesh width;
        `fit_rows=False` pads every micro-batch to the budget's rows (`pack_step`)."""
        return pack_step(
            seqs,
            buckets=self.cfg.length_buckets,
            micro_batch_tokens=self.cfg.micro_batch_tokens,
            aggregation=self.rl.aggregation,
            overlong=self.cfg.overlong,
            max_segments=self.max_segments,
            row_multiple=data_parallel_size(self.mesh),
            share_prefixes=self.cfg.share_prefixes,
            fit_rows=fit_rows,
        )

    def batch_digest(self, packed: PackedStep) -> str:
        """A digest of exactly what `update(packed)` feeds the devices: processes of
        one job compare it before training, so none trains on a batch of its own."""
        arrays = [
            getattr(mb, k)
            for mb in packed.micro_batches
            for k in BATCH_KEYS + OPTIONAL_KEYS
            if getattr(mb, k) is not None
        ]
        return digest(packed.normaliser, *arrays)

    def model(self) -> CausalLM:
        """The current policy as an NNX module sharing the learner's arrays: valid
        until the next `train_step`, which donates (frees) them."""
        return nnx.merge(self.graphdef, self.params, self.frozen, self._rest)

    def accumulate(self, packed: PackedStep) -> tuple[Params, Array, dict]:
        """Σ over micro-batches of (∇ numerator, numerator, metric sums): no update."""
        acc, _ = self._accumulate(packed)
        return acc["grads"], acc["loss"], acc["metrics"]

    def _accumulate(self, packed: PackedStep) -> tuple[dict, list[Array]]:
        """The accumulator after every micro-batch, and each micro-batch's token logprobs."""
        # MoE load-balancing loss is a per-micro-batch mean; this weight makes it a
        # coefficient-weighted mean over micro-batches once the numerator is
        # divided by the normaliser. Traced, so the coefficient costs no recompile.
        coef = self.model_config.router_aux_loss_coef
        aux_scale = jnp.float32(coef * packed.normaliser / len(packed.micro_batches))
        acc = self._zero_acc()
        logprobs = []
        # Traced under the mesh as context: a kernel XLA cannot partition (splash attention on TPU)
        # then runs per shard (legorl_jax/models/attention.py).
        with jax.set_mesh(self.mesh):
            for mb in packed.micro_batches:
                acc, lp = self._micro(self.params, self.frozen, self.ref_params, acc, self.device_batch(mb), aux_scale)
                logprobs.append(lp)
        return acc, logprobs

    def train_step(self, packed: PackedStep) -> dict[str, float]:
        """One optimizer update from one packed step; returns the step's metrics."""
        return self.update(packed).metrics

    def update(self, packed: PackedStep) -> StepResult:
        """One optimizer update from one packed step: its metrics, and the token logprobs
        the loss was computed from (kept on device until asked for)."""
        acc, logprobs = self._accumulate(packed)
        lr = float(self.schedule(self.step))
        self.params, self.opt_state, stats = self._apply(
            self.params, self.opt_state, acc["grads"], jnp.float32(packed.normaliser)
        )
        self.step += 1
        metrics = finalize(acc["metrics"])
        metrics.update(packed.stats)
        metrics.update(
            loss=float(acc["loss"]) / packed.normaliser,
            grad_norm=float(stats["grad_norm"]),
            update_ratio=float(stats["update_ratio"]),
            learning_rate=lr,
            step=self.step,
        )
        return StepResult(metrics, packed, logprobs)

    def device_batch(self, mb: MicroBatch) -> dict[str, Array]:
        """A host micro-batch as global arrays, rows split over data × fsdp."""
        keys = [k for k in BATCH_KEYS + OPTIONAL_KEYS if getattr(mb, k) is not None]
        return put_batch({k: getattr(mb, k) for k in keys}, self.mesh)

    def _abstract_acc(self) -> dict:
        """Shapes of the accumulator; its structure does not depend on the batch shape."""
        rows = data_parallel_size(self.mesh)
        batch = {k: jax.ShapeDtypeStruct((rows, 2), jnp.int32) for k in BATCH_KEYS}
        batch.update({k: jax.ShapeDtypeStruct((rows, 1), jnp.float32) for k in FLOAT_KEYS})
        batch["seq_ids"] = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
        with jax.set_mesh(self.mesh):
            grads, loss, metrics, _ = jax.eval_shape(
                self._micro_grads,
                self.params,
                self.frozen,
                self.ref_params,
                batch,
                jax.ShapeDtypeStruct((), jnp.float32),
            )
        return {"grads": grads, "loss": loss, "metrics": metrics}

    # ---- traced ----------------------------------------------------------------
    def _logprobs(self, params: Params, frozen: Params, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
        return token_logprobs_with_aux(
            nnx.merge(self.graphdef, params, frozen, self._rest),
            batch["tokens"],
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            kv_end=batch.get("kv_end"),
            pred_from=batch.get("pred_from"),
            score_index=batch.get("score_index"),
            temperature=self.rl.sampling.temperature,
            chunk_size=self.cfg.logprob_chunk_size,
        )

    def _micro_grads(
        self, params: Params, frozen: Params, ref_params: Params | None, batch: dict[str, Array], aux_scale: Array
    ) -> tuple[Params, Array, dict, Array]:
        ref_logprobs = None
        if ref_params is not None:
            ref_logprobs = jax.lax.stop_gradient(self._logprobs(ref_params, frozen, batch)[0])

        def numerator(p: Params) -> tuple[Array, tuple[dict, Array]]:
            logprobs, aux = self._logprobs(p, frozen, batch)
            inputs = PolicyInputs(
                logprobs,
                batch["behavior_logprobs"],
                batch["advantages"],
                batch["loss_mask"],
                batch["seq_ids"],
                batch["tokens"].shape[0] * self.max_segments,
            )
            per_token, token_metrics = policy_loss(inputs, self.rl, ref_logprobs)
            value = jnp.sum(per_token * batch["loss_weight"])
            if "router_aux_loss" in aux:
                value = value + aux["router_aux_loss"] * aux_scale
            return value, (micro_batch_metrics(inputs, token_metrics), logprobs)

        (value, (metrics, logprobs)), grads = jax.value_and_grad(numerator, has_aux=True)(params)
        return grads, value, metrics, logprobs

    def _micro_step(
        self,
        params: Params,
        frozen: Params,
        ref_params: Params | None,
        acc: dict,
        batch: dict[str, Array],
        aux_scale: Array,
    ) -> tuple[dict, Array]:
        grads, value, metrics, logprobs = self._micro_grads(params, frozen, ref_params, batch, aux_scale)
        acc = {
            "grads": jax.tree.map(jnp.add, acc["grads"], grads),
            "loss": acc["loss"] + value,
            "metrics": merge(acc["metrics"], metrics),
        }
        return acc, logprobs

    def _apply_update(
        self, params: Params, opt_state: optax.OptState, grads: Params, normaliser: Array
    ) -> tuple[Params, optax.OptState, dict[str, Array]]:
        grads = jax.tree.map(lambda g: g / normaliser, grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        # Adam scales every update to about the learning rate whatever the batch's signal, so a
        # step on one informative group moves the weights as far as a step on many: this ratio
        # (update norm over weight norm) shows how far each step moved the policy.
        update_ratio = optax.global_norm(updates) / jnp.maximum(optax.global_norm(params), 1e-12)
        stats = {"grad_norm": optax.global_norm(grads), "update_ratio": update_ratio}
        return optax.apply_updates(params, updates), opt_state, stats
