"""Logit parity with transformers and exact HF round trips, per architecture."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from tiny_hf import TINY_ARCHS, VOCAB, hf_logits

from legorl_jax.models import CheckpointError, from_hf, to_hf

ARCHS = list(TINY_ARCHS)


def _tokens(batch: int = 2, length: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length), dtype=np.int32)


def _params(model: nnx.Module) -> dict[tuple[str, ...], np.ndarray]:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch: str, tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_hf_checkpoint(arch)
    tokens = _tokens()
    ours = np.asarray(from_hf(path)(jnp.asarray(tokens)))
    ref = hf_logits(path, tokens)
    assert ours.shape == ref.shape == (2, 40, VOCAB) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= 1e-4
    # The weights are large enough that the logits are far from uniform.
    assert ref.std() > 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_in_transformers_with_same_logits(
    arch: str, tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_hf_checkpoint(arch)
    model = from_hf(src)
    out = to_hf(model, tmp_path / "export", tokenizer_from=src)
    tokens = _tokens(seed=1)
    assert np.abs(hf_logits(out, tokens) - hf_logits(src, tokens)).max() <= 1e-5
    assert (out / "generation_config.json").is_file()
    with safe_open(out / "model.safetensors", "np") as f:
        names = set(f.keys())
    with safe_open(src / "model.safetensors", "np") as f:
        assert names == set(f.keys())
    if "tie_word_embeddings" in json.loads((src / "config.json").read_text()) and model.config.tie_word_embeddings:
        assert "lm_head.weight" not in names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_round_trip_is_bit_identical(
    arch: str, dtype: str, tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    first = from_hf(tiny_hf_checkpoint(arch), dtype=dtype)
    second = from_hf(to_hf(first, tmp_path / "rt"), dtype=dtype)
    a, b = _params(first), _params(second)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(a[key].view(np.uint8), b[key].view(np.uint8), err_msg=str(key))
    cfg = json.loads((tmp_path / "rt" / "config.json").read_text())
    assert cfg["torch_dtype"] == dtype


def test_tied_export_has_no_lm_head(tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    model = from_hf(tiny_hf_checkpoint("qwen3"))
    assert model.config.tie_word_embeddings and model.lm_head is None
    out = to_hf(model, tmp_path / "tied")
    with safe_open(out / "model.safetensors", "np") as f:
        assert "lm_head.weight" not in f.keys()
        assert "model.embed_tokens.weight" in f.keys()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_sharded_export_writes_index_and_reloads(tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_hf_checkpoint("qwen3_untied")
    model = from_hf(src)
    limit = 40_000  # bytes: forces several files for this ~300 kB model
    out = to_hf(model, tmp_path / "sharded", max_shard_bytes=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in files}
    for f in files:
        with safe_open(f, "np") as st:
            sizes = [st.get_tensor(k).nbytes for k in st.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in _params(model).values())
    tokens = _tokens(seed=2)
    assert np.abs(hf_logits(out, tokens) - hf_logits(src, tokens)).max() <= 1e-5
    reloaded = _params(from_hf(out))
    for key, value in _params(model).items():
        np.testing.assert_array_equal(value, reloaded[key])


def test_moe_aux_loss_matches_transformers(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    import torch
    import transformers

    path = tiny_hf_checkpoint("qwen3_moe")
    tokens = _tokens(seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(tokens, dtype=torch.long), output_router_logits=True).aux_loss.item()
    model = from_hf(path)
    _, aux = model.hidden(jnp.asarray(tokens))
    assert abs(float(aux["router_aux_loss"]) - ref) <= 1e-5
    assert model.config.router_aux_loss_coef == pytest.approx(0.01)


def test_missing_and_unexpected_tensors_are_named(tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    src = tiny_hf_checkpoint("qwen2")
    with safe_open(src / "model.safetensors", "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.q_proj.bias"]
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_proj\.bias missing"):
        from_hf(tmp_path)
    save_file({**tensors, "model.layers.0.extra.weight": np.zeros(3, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.extra\.weight"):
        from_hf(tmp_path)
    wrong = dict(tensors)
    wrong["model.norm.weight"] = np.ones(7, np.float32)
    save_file(wrong, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(7,\)"):
        from_hf(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        from_hf(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard files listed in the index are missing"):
        from_hf(tmp_path)


def test_to_hf_rejects_bad_tokenizer_dir(tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    model = from_hf(tiny_hf_checkpoint("qwen3"))
    with pytest.raises(CheckpointError, match="not a directory"):
        to_hf(model, tmp_path / "o", tokenizer_from=tmp_path / "missing")
    with pytest.raises(ValueError, match="max_shard_bytes must be positive"):
        to_hf(model, tmp_path / "o", max_shard_bytes=0)


def test_import_buffers_are_adopted_by_jax_without_a_copy() -> None:
    # from_hf's speed rests on this: XLA's CPU client aliases a 64-byte aligned host buffer
    # (a copy of every parameter cost as much as reading it).
    import jax

    from legorl_jax.models.hf_io import _aligned_empty

    for dtype in (np.float32, jnp.bfloat16):
        host = _aligned_empty((3, 1000), dtype)
        host[...] = 1
        assert host.ctypes.data % 64 == 0 and host.flags.c_contiguous
        on_device = jax.device_put(host, jax.devices("cpu")[0])
        assert on_device.unsafe_buffer_pointer() == host.ctypes.data
