"""Tiny random-weight HF checkpoints for the embedded default and for tests.

`build_tiny_hf_model` writes what a real checkpoint directory holds
(`config.json`, `generation_config.json`, `model.safetensors`, tokenizer files)
for a model small enough to build in about a second on a CPU, so tests across
the project exercise the same loading paths as a real Qwen3 checkpoint without
downloading one. Weights come from `transformers`' own initialisation, seeded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from legorl_jax.models.tokenizer import ENDOFTEXT, IM_END, build_demo_tokenizer, copy_tokenizer_files

SUPPORTED_ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe")
_MAX_POSITIONS = 4096


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _arch_kwargs(
    arch: str,
    *,
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
) -> dict[str, Any]:
    """Config fields that differ between architectures."""
    if arch == "qwen2":
        # Qwen2's config has no head_dim field; it is always hidden / heads.
        if head_dim * num_heads != hidden_size:
            raise ValueError(
                f"qwen2 needs head_dim * num_heads == hidden_size, got {head_dim} * {num_heads} != {hidden_size}"
            )
        return {}
    if arch == "qwen3_moe":
        if num_experts_per_tok > num_experts:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) > num_experts ({num_experts})")
        return {
            "head_dim": head_dim,
            "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": intermediate_size,
            "norm_topk_prob": True,
        }
    return {"head_dim": head_dim}


def _special_ids(tokenizer: Any) -> tuple[int, int]:
    ids = []
    for token in (IM_END, ENDOFTEXT):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {token} token; the chat format needs it")
        ids.append(token_id)
    return ids[0], ids[1]


def build_tiny_hf_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen3",
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = _MAX_POSITIONS,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
) -> Path:
    """Write a random-weight HF checkpoint (float32 safetensors) plus tokenizer to `out_dir`.

    The tokenizer is the demo tokenizer unless `tokenizer_dir` names one to copy.
    `vocab_size` defaults to the tokenizer's length; a larger value pads the
    embedding as real checkpoints do; `max_position_embeddings` is the context
    the checkpoint says it was trained for (an engine's default context).
    `num_experts*` apply to `qwen3_moe` only.
    Same arguments, same weights.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    _check_positive(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
    )
    if vocab_size is not None:
        _check_positive(vocab_size=vocab_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    arch_kwargs = _arch_kwargs(
        arch,
        hidden_size=hidden_size,
        num_heads=num_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
    )

    # Deferred: torch and transformers take seconds to import, and only this builder needs them.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        build_demo_tokenizer(out)
    else:
        copy_tokenizer_files(tokenizer_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    im_end_id, endoftext_id = _special_ids(tokenizer)
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer ({len(tokenizer)} tokens)")

    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        dtype="float32",
        **arch_kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id, eos_token_id=[im_end_id, endoftext_id], pad_token_id=endoftext_id
    )
    model.save_pretrained(out)
    return out
