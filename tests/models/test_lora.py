"""LoRA adapters: logits equal `transformers` + `peft` with the exported adapter, and
the merged export equals the unmerged forward."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_hf import VOCAB, hf_logits

from legorl_jax.cli import main
from legorl_jax.models import from_hf, to_hf
from legorl_jax.models.lora import LoraError, adapted, add_adapters, load_peft, save_peft

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, 40), dtype=np.int32)


def _trained_adapters(path: Path, targets: list[str], rank: int = 4, alpha: float = 8.0):  # noqa: ANN202
    """The checkpoint with adapters whose B is drawn too (a fresh B is zero: no test at all)."""
    model = from_hf(path)
    add_adapters(model, rank=rank, alpha=alpha, targets=targets, seed=3)
    key = jax.random.key(7)
    for _, module in adapted(model):
        key, sub = jax.random.split(key)
        b = module.lora_b.get_value()
        module.lora_b.set_value(0.2 * jax.random.normal(sub, b.shape, b.dtype))
    return model


def _same_logits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to float32 rounding at the logits' scale (the products' order differs by CPU:
    AVX-512 and AVX2 machines round differently)."""
    return float(np.abs(np.asarray(a) - b).max()) <= 1e-5 * max(1.0, float(np.abs(b).max()))


def _peft_logits(base: Path, adapter: Path, tokens: np.ndarray) -> np.ndarray:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize(("arch", "targets"), [("qwen3", TARGETS), ("qwen2", ["q_proj", "v_proj", "down_proj"])])
def test_adapter_logits_match_peft_and_the_merged_export(
    arch: str, targets: list[str], tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_hf_checkpoint(arch)
    model = _trained_adapters(base, targets)
    tokens = _tokens()
    ours = np.asarray(model(jnp.asarray(tokens)))
    adapter = save_peft(model, tmp_path / "adapter", base_model=str(base))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["target_modules"] == sorted(targets)
    ref = _peft_logits(base, adapter, tokens)
    assert _same_logits(ours, ref)
    # The adapters matter: the base alone is far from these logits.
    assert np.abs(hf_logits(base, tokens) - ref).max() > 1e-2
    merged = to_hf(model, tmp_path / "merged", tokenizer_from=base)
    assert _same_logits(hf_logits(merged, tokens), ours)


def test_fresh_adapters_leave_the_model_unchanged(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    base = tiny_hf_checkpoint("qwen3")
    model = from_hf(base)
    before = np.asarray(model(jnp.asarray(_tokens())))
    paths = add_adapters(model, rank=8, alpha=16, targets=TARGETS, seed=0)
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(TARGETS)
    # Equal up to float rounding: the program around the (zero) adapter terms fuses differently.
    assert np.abs(np.asarray(model(jnp.asarray(_tokens()))) - before).max() <= 1e-5
    lora = nnx.state(model, nnx.LoRAParam)
    assert all(v.get_value().dtype == jnp.float32 for _, v in nnx.to_flat_state(lora))


def test_targets_an_moe_model_lacks_are_refused(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    model = from_hf(tiny_hf_checkpoint("qwen3_moe"))
    with pytest.raises(LoraError, match=r"\['down_proj', 'gate_proj'\] name no projection of this MoE"):
        add_adapters(model, rank=2, alpha=2, targets=["q_proj", "gate_proj", "down_proj"], seed=0)
    assert len(add_adapters(from_hf(tiny_hf_checkpoint("qwen3_moe")), rank=2, alpha=2, targets=["o_proj"], seed=0))


def test_an_engine_refuses_to_serve_unmerged_adapters(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    model = from_hf(tiny_hf_checkpoint("qwen3"))
    add_adapters(model, rank=2, alpha=2, targets=["q_proj"], seed=0)
    with pytest.raises(ValueError, match="served merged"):
        model.prepare_for_serving()


def test_convert_merges_a_peft_adapter_into_the_weights(
    tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tiny_hf_checkpoint("qwen3")
    model = _trained_adapters(base, ["q_proj", "up_proj"])
    adapter = save_peft(model, tmp_path / "adapter", base_model=str(base))
    out = tmp_path / "merged"
    assert main(["convert", "--from-hf", str(base), "--adapter", str(adapter), "--to-hf", str(out)]) == 0
    tokens = _tokens(1)
    assert _same_logits(hf_logits(out, tokens), np.asarray(model(jnp.asarray(tokens))))
    # What PEFT can write and this project does not read is refused by name, not half-read.
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert main(["convert", "--from-hf", str(base), "--adapter", str(adapter), "--to-hf", str(out)]) == 2
    assert "not supported: use_rslora=True" in capsys.readouterr().err
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(LoraError, match="needs adapter_config.json"):
        load_peft(from_hf(base), adapter)
