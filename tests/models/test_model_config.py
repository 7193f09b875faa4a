"""HF config.json parsing: supported fields round-trip, unsupported ones are named."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from legorl_jax.models import UnsupportedConfigError, from_hf_config, read_hf_config, to_hf_config
from legorl_jax.models.config import ModelConfig


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama3", "qwen3_moe"])
def test_config_round_trips_through_hf_dict(arch: str, tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    original = from_hf_config(read_hf_config(tiny_hf_checkpoint(arch)))
    again = from_hf_config(json.loads(json.dumps(to_hf_config(original, dtype="bfloat16"))))
    assert again == original


def test_architecture_specific_fields(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    qwen3 = from_hf_config(read_hf_config(tiny_hf_checkpoint("qwen3")))
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.tie_word_embeddings) == (True, False, 24, True)
    qwen2 = from_hf_config(read_hf_config(tiny_hf_checkpoint("qwen2")))
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_bias, qwen2.head_dim) == (False, True, False, 16)
    llama = from_hf_config(read_hf_config(tiny_hf_checkpoint("llama3")))
    assert llama.rope_scaling is not None and llama.rope_scaling.original_max_position_embeddings == 16
    moe = from_hf_config(read_hf_config(tiny_hf_checkpoint("qwen3_moe")))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)


def _qwen3(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e6,
    )  # fmt: skip
    return {**base, **changes}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6}), "rope_parameters.rope_type"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}), "low_freq_factor"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(model_type="mistral"), "model_type"),
        (
            dict(
                model_type="qwen3_moe",
                mlp_only_layers=[0],
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
            ),
            "mlp_only_layers",
        ),  # fmt: skip
        (
            dict(
                model_type="qwen3_moe",
                decoder_sparse_step=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
            ),
            "decoder_sparse_step",
        ),  # fmt: skip
        (dict(model_type="llama", pretraining_tp=2), "pretraining_tp"),
    ],
)
def test_unsupported_config_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=field):
        from_hf_config(_qwen3(**changes))


def test_inconsistent_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        from_hf_config(_qwen3(num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        from_hf_config(_qwen3(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=16))
    with pytest.raises(ValueError, match="hidden_size must be positive"):
        ModelConfig(architecture="qwen3", vocab_size=8, hidden_size=0, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=8)  # fmt: skip


def test_legacy_rope_fields_and_runtime_options() -> None:
    cfg = from_hf_config(_qwen3(rope_theta=5e5), param_dtype="bfloat16", compute_dtype="bfloat16", remat="full")
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None
    assert (cfg.param_dtype, cfg.compute_dtype, cfg.remat) == ("bfloat16", "bfloat16", "full")
    assert hash(cfg) == hash(cfg.replace())  # usable as a jit static argument
