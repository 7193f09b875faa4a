"""Tiny random HF checkpoints for the model tests (built with transformers, saved to tmp dirs; no downloads).

Weights are re-drawn with a large spread (norm scales and biases included) so
that a wrong layout, a missing norm or a mis-rotated head changes the logits
far beyond the 1e-4 tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 256
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (transformers config class, causal LM class, config kwargs)
TINY_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # head_dim 24 != hidden / heads: Qwen3 decouples them.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e4)),
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            # A short original context puts the test positions across all three
            # Llama 3 frequency bands.
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            router_aux_loss_coef=0.01,
            tie_word_embeddings=False,
        ),
    ),
}


def build_tiny_hf(name: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    config_cls, model_cls, extra = TINY_ARCHS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    return out


def hf_logits(path: Path, tokens: Any) -> Any:
    """float32 numpy logits from transformers (torch CPU) for int tokens [B, T]."""
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def padded_batch(seqs: list[Any]) -> tuple[Any, list[int]]:
    """Right-pad int sequences into one int32 [N, max_len] batch (causal
    attention makes trailing padding invisible to earlier tokens), so a test
    runs one forward pass instead of compiling one per length."""
    import numpy as np

    out = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, [len(s) for s in seqs]
