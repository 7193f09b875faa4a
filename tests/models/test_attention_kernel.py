"""Which attention implementation runs, that asking for one that cannot is a clear error,
and that the splash kernel (Pallas interpret mode on CPU) computes what XLA computes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from legorl_jax.models import CausalLM, ModelConfig, attention
from legorl_jax.models.attention import attend, resolve_kernel, splash_attention
from legorl_jax.models.layers import causal_segment_mask

_REPO = Path(__file__).resolve().parents[2]
# Padding (0) at the end of row 0; segments straddle the 128-token splash blocks.
_SEGMENTS = np.array([[1] * 100 + [2] * 150 + [3] * 80 + [0] * 54, [4] * 384], np.int32)


def _qkv(seed: int, b: int, t: int, n: int, kv: int, h: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32) for heads in (n, kv, kv))
    return q, k, v


def _xla(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    return attend(q, k, v, causal_segment_mask(segment_ids), kernel="xla", causal=True)


def test_auto_is_xla_on_cpu_and_fused_kernels_need_their_hardware() -> None:
    assert jax.default_backend() == "cpu"
    assert resolve_kernel("auto", jnp.bfloat16, 128, 512) == "xla"
    assert resolve_kernel("xla", jnp.bfloat16, 128, 512) == "xla"
    with pytest.raises(ValueError, match="attention_kernel='cudnn' needs an NVIDIA GPU"):
        resolve_kernel("cudnn", jnp.bfloat16, 128)
    with pytest.raises(ValueError, match="attention_kernel='splash' needs a TPU; this process runs on cpu"):
        resolve_kernel("splash", jnp.bfloat16, 128, 512)
    with pytest.raises(ValueError, match="attention_kernel must be one of .*got 'flash'"):
        resolve_kernel("flash", jnp.bfloat16, 128, 512)  # type: ignore[arg-type]


def test_auto_on_tpu_picks_splash_only_for_shapes_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Test instrument: pretend the default backend is a TPU (only the choice is exercised, nothing compiles).
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_kernel("auto", jnp.bfloat16, 128, 4096) == "splash"
    assert resolve_kernel("auto", jnp.float32, 256, 384) == "splash"
    assert resolve_kernel("auto", jnp.bfloat16, 128, 200) == "xla"  # row not a multiple of 128
    assert resolve_kernel("auto", jnp.bfloat16, 64, 4096) == "xla"  # head_dim below the lane width
    assert resolve_kernel("auto", jnp.bfloat16, 128, None) == "xla"  # not training-shaped
    assert resolve_kernel("splash", jnp.bfloat16, 64, 512) == "splash"
    with pytest.raises(ValueError, match="attention_kernel='splash' needs a training-shaped call.*row length 200"):
        resolve_kernel("splash", jnp.bfloat16, 128, 200)
    with pytest.raises(ValueError, match="attention_kernel='cudnn' needs an NVIDIA GPU; this process runs on tpu"):
        resolve_kernel("cudnn", jnp.bfloat16, 128)


@pytest.mark.parametrize("kernel", ["cudnn", "splash"])
def test_kernel_choice_reaches_every_layer(kernel: str) -> None:
    config = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, attention_kernel=kernel,
    )  # fmt: skip
    model = CausalLM(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"attention_kernel='{kernel}' needs"):
        model(jnp.zeros((1, 128), jnp.int32))
    model = CausalLM(config.replace(attention_kernel="xla"), rngs=nnx.Rngs(0))
    assert np.isfinite(np.asarray(model(jnp.zeros((1, 4), jnp.int32)))).all()


def test_attend_masks_and_groups_heads_like_a_reference() -> None:
    b, t, n, kv, h = 2, 6, 4, 2, 8
    q, k, v = _qkv(0, b, t, n, kv, h)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    mask = causal_segment_mask(segments)
    out = attend(q, k, v, mask, kernel="auto", causal=True, segment_ids=segments)
    kr, vr = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(h)
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", weights, vr), atol=1e-5)


def test_splash_matches_xla_on_packed_rows_with_gqa() -> None:
    q, k, v = _qkv(1, 2, 384, 4, 2, 16)
    segments = jnp.asarray(_SEGMENTS)
    splash = partial(splash_attention, interpret=True)
    out, ref = jax.jit(splash)(q, k, v, segments), _xla(q, k, v, segments)
    assert np.isfinite(np.asarray(out)).all()  # padding rows included: losses mask them, and NaN * 0 = NaN
    np.testing.assert_allclose(out, ref, atol=1e-5)

    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=out.shape), jnp.float32)
    cotangent = cotangent * (segments != 0)[:, :, None, None]  # as a loss masks padding

    def grads(fn: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]) -> tuple[jax.Array, ...]:
        return jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v, segments) * cotangent).sum(), argnums=(0, 1, 2)))(q, k, v)

    for name, got, want in zip("qkv", grads(splash), grads(_xla), strict=True):
        assert np.isfinite(np.asarray(got)).all(), name
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"d/d{name}")


def test_segment_ids_reach_the_splash_kernel_in_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, attention_kernel="xla",
    )  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (1, 128)), jnp.int32)
    segments = jnp.asarray([[1] * 40 + [2] * 70 + [0] * 18], jnp.int32)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    want = model(tokens, segment_ids=segments)
    # Test instruments: resolution as on a TPU, and the kernel in interpret mode since this is a CPU.
    monkeypatch.setattr(attention, "resolve_kernel", lambda *_args: "splash")
    monkeypatch.setattr(attention, "splash_attention", partial(splash_attention, interpret=True))
    got = model(tokens, segment_ids=segments)
    # Segment ids lost on the way would trip the assert in attend; wrong ones would move the logits.
    np.testing.assert_allclose(got, want, atol=1e-4)


_SHARDED_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from collections.abc import Callable
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P
from legorl_jax.models import make_mesh
from legorl_jax.models.attention import splash_attention
from test_attention_kernel import _SEGMENTS, _qkv, _xla

assert jax.device_count() == 4
mesh = make_mesh(data=2, fsdp=1, tensor=2)
q, k, v = _qkv(4, 2, 384, 4, 2, 16)
rows = NamedSharding(mesh, P(("data", "fsdp")))
q, k, v, seg = (jax.device_put(x, rows) for x in (q, k, v, jnp.asarray(_SEGMENTS)))
splash = partial(splash_attention, interpret=True)
loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v, seg) ** 2).sum(), argnums=(0, 1, 2)))
with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(splash)(q, k, v, seg))
    got = loss(splash)(q, k, v)
want = loss(_xla)(q, k, v)
for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
print("ok")
"""


def test_splash_runs_per_shard_under_a_mesh() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(_REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SHARDED_CHECK)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_tree_rows_fall_back_from_splash_to_xla_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, attention_kernel="xla",
    )  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (1, 128)), jnp.int32)
    # One trie: a 60-token prefix, two branches of 30, then padding.
    segments = jnp.asarray([[1] * 120 + [0] * 8], jnp.int32)
    kv_end = jnp.asarray([[120] * 60 + [90] * 30 + [120] * 30 + [128] * 8], jnp.int32)
    positions = jnp.asarray([list(range(90)) + list(range(60, 90)) + list(range(8))], jnp.int32)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    want, _ = model.hidden(tokens, positions, segments, kv_end)
    # The second branch computes what the same sequence computes alone.
    alone, _ = model.hidden(jnp.concatenate([tokens[:, :60], tokens[:, 90:120]], axis=1))
    np.testing.assert_allclose(want[:, 90:120], alone[:, 60:], atol=1e-5)
    monkeypatch.setattr(attention, "resolve_kernel", lambda *_args: "splash")
    with caplog.at_level("INFO", logger=attention.__name__):
        got, _ = model.hidden(tokens, positions, segments, kv_end)
    assert "tree rows run XLA, not splash" in caplog.text
    np.testing.assert_array_equal(got, want)
