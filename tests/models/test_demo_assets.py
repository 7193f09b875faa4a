"""Tiny random-weight HF checkpoints load and generate with `transformers`."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl_jax.models.demo_assets import build_tiny_hf_model
from legorl_jax.models.tokenizer import TOKENIZER_FILES, build_demo_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


def _tensor_names(model_dir: Path) -> set[str]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_qwen3_checkpoint_loads_and_generates(tmp_path: Path, tok_dir: Path) -> None:
    out = build_tiny_hf_model(tmp_path / "m", tokenizer_dir=tok_dir)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (VOCAB, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # Tied embeddings: no lm_head tensor on disk, as in Qwen3 0.6B-4B.
    assert "lm_head.weight" not in _tensor_names(out)
    assert "model.layers.1.self_attn.q_norm.weight" in _tensor_names(out)
    assert all(filecmp.cmp(tok_dir / name, out / name, shallow=False) for name in TOKENIZER_FILES)

    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_len = prompt["input_ids"].shape[1]
    generated = model.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert generated.shape == (1, prompt_len + 6)
    assert torch.equal(generated[:, :prompt_len], prompt["input_ids"])
    assert isinstance(tok.decode(generated[0, prompt_len:]), str)


@pytest.mark.parametrize(
    ("arch", "cls", "tied"),
    [
        ("qwen2", "Qwen2ForCausalLM", True),
        ("llama", "LlamaForCausalLM", False),
        ("qwen3_moe", "Qwen3MoeForCausalLM", True),
    ],
)
def test_other_architectures(tmp_path: Path, tok_dir: Path, arch: str, cls: str, tied: bool) -> None:
    out = build_tiny_hf_model(tmp_path, arch=arch, tokenizer_dir=tok_dir, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == cls
    assert ("lm_head.weight" in _tensor_names(out)) is not tied
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, VOCAB)
    assert torch.isfinite(logits).all()
    if arch == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in _tensor_names(out)
        assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_seed_fixes_the_weights(tmp_path: Path, tok_dir: Path) -> None:
    first = _weights(build_tiny_hf_model(tmp_path / "a", tokenizer_dir=tok_dir, seed=3))
    again = _weights(build_tiny_hf_model(tmp_path / "b", tokenizer_dir=tok_dir, seed=3))
    other = _weights(build_tiny_hf_model(tmp_path / "c", tokenizer_dir=tok_dir, seed=4))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_default_tokenizer_and_padded_vocab(tmp_path: Path) -> None:
    out = build_tiny_hf_model(tmp_path, vocab_size=1024 + 64)
    assert len(AutoTokenizer.from_pretrained(out)) == 1024
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [1024 + 64, 64]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"arch": "gpt2"}, "arch must be one of"),
        ({"num_heads": 4, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"arch": "qwen2", "head_dim": 32}, "head_dim \\* num_heads == hidden_size"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"arch": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({"vocab_size": 100}, "smaller than the tokenizer"),
    ],
)
def test_bad_arguments(tmp_path: Path, tok_dir: Path, kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        build_tiny_hf_model(tmp_path, tokenizer_dir=tok_dir, **kwargs)


def test_tokenizer_dir_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        build_tiny_hf_model(tmp_path / "out", tokenizer_dir=tmp_path / "empty")
