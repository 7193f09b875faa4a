"""Architecture config of the policy network, read from an HF `config.json`.

One frozen (hashable, so usable as a jit static argument) dataclass covers the
Qwen3 family: Qwen3 dense, Qwen3-MoE, Qwen2/2.5 and Llama 3. Anything the JAX
model would silently compute differently from the serving model is rejected
with an error naming the config field, because architecture drift does not
crash: it only makes the model dumber.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from legorl_jax.core.errors import InputError

Architecture = Literal["qwen3", "qwen3_moe", "qwen2", "llama"]
DType = Literal["float32", "bfloat16"]
Remat = Literal["none", "full", "dots_saveable"]
AttentionKernel = Literal["auto", "xla", "cudnn", "splash", "blockwise"]  # see legorl_jax/models/attention.py

_HF_CLASS = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}
# Written back on export so vLLM / transformers see the same special tokens.
_PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


class UnsupportedConfigError(ValueError, InputError):
    """An HF config field has a value this implementation does not reproduce."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"unsupported model config: {field}={value!r}: {why}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (from HF) plus runtime choices (dtypes, remat, attention kernel)."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (num_experts == 0 means a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    # Runtime: dtype of stored params, dtype of activations/matmuls, remat policy, attention kernel.
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    remat: Remat = "none"
    attention_kernel: AttentionKernel = "auto"
    # HF keys carried through import/export unchanged (token ids, context length).
    passthrough: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model config: num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}"
            )
        if not self.is_moe and self.intermediate_size <= 0:
            raise ValueError("model config: intermediate_size must be positive")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _reject(cfg: dict[str, Any], field: str, bad: Any, why: str) -> None:
    if cfg.get(field, None) == bad:
        raise UnsupportedConfigError(field, bad, why)


def _rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older files use
    # top-level `rope_theta` plus an optional `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise UnsupportedConfigError(f"{field}.{exc.args[0]}", None, "llama3 rope scaling needs it") from None
        return theta, scaling
    raise UnsupportedConfigError(f"{field}.rope_type", kind, "only 'default' and 'llama3' RoPE are implemented")


def from_hf_config(cfg: dict[str, Any], **runtime: Any) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json`.

    `runtime` sets param_dtype / compute_dtype / remat / attention_kernel.
    """
    arch = cfg.get("model_type")
    if arch not in _HF_CLASS:
        raise UnsupportedConfigError("model_type", arch, f"supported: {sorted(_HF_CLASS)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError("hidden_act", cfg["hidden_act"], "only silu is implemented")
    _reject(cfg, "use_sliding_window", True, "sliding-window attention is not implemented")
    if arch == "llama" and cfg.get("pretraining_tp", 1) != 1:
        raise UnsupportedConfigError("pretraining_tp", cfg["pretraining_tp"], "only 1 is implemented")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedConfigError("layer_types", layer_types, "only full_attention layers are implemented")
    theta, scaling = _rope(cfg)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    moe: dict[str, Any] = {}
    if arch == "qwen3_moe":
        if cfg.get("mlp_only_layers"):
            raise UnsupportedConfigError("mlp_only_layers", cfg["mlp_only_layers"], "stacked layers must all be MoE")
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedConfigError(
                "decoder_sparse_step", cfg["decoder_sparse_step"], "stacked layers must all be MoE"
            )
        moe = dict(
            num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        )
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and no o bias; Qwen3 and Llama put
        # `attention_bias` on all four projections.
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "llama" else False,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        passthrough=tuple((k, cfg[k]) for k in _PASSTHROUGH if cfg.get(k) is not None),
        **moe,
        **runtime,
    )


def to_hf_config(config: ModelConfig, *, dtype: DType) -> dict[str, Any]:
    """The HF `config.json` dict that transformers and vLLM load as this model."""
    out: dict[str, Any] = {
        "architectures": [_HF_CLASS[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if config.rope_scaling is not None:
        out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
    if config.architecture == "qwen2":
        out["use_sliding_window"] = False
    else:
        out["attention_bias"] = config.qkv_bias
    if config.architecture == "llama":
        out["mlp_bias"] = config.mlp_bias
    if config.is_moe:
        out.update(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            router_aux_loss_coef=config.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    out.update(dict(config.passthrough))
    return out
