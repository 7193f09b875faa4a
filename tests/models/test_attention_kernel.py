"""Which attention implementation runs, that asking for one that cannot is a clear error,
and that the splash kernel (Pallas interpret mode on CPU) and blockwise attention compute
what XLA computes."""

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
from legorl_jax.models.attention import attend, causal_segment_mask, resolve_kernel, splash_attention
from legorl_jax.models.blockwise_attention import _live_tiles, blockwise_attention

_REPO = Path(__file__).resolve().parents[2]
# Padding (0) at the end of row 0; segments straddle the 128-token splash blocks.
_SEGMENTS = np.array([[1] * 100 + [2] * 150 + [3] * 80 + [0] * 54, [4] * 384], np.int32)


def _qkv(seed: int, b: int, t: int, n: int, kv: int, h: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32) for heads in (n, kv, kv))
    return q, k, v


def _xla(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    return attend(q, k, v, segment_ids, kernel="xla")


def test_auto_on_cpu_is_blockwise_for_rows_of_tiles_and_fused_kernels_need_their_hardware() -> None:
    assert jax.default_backend() == "cpu"
    assert resolve_kernel("auto", jnp.float32, 64, 1024) == "blockwise"
    assert resolve_kernel("auto", jnp.bfloat16, 128, 384) == "blockwise"  # three 128-tiles
    assert resolve_kernel("auto", jnp.bfloat16, 128, 512) == "xla"  # one tile: XLA's dense call
    assert resolve_kernel("auto", jnp.float32, 64, 1000) == "xla"  # no tile divides the row
    assert resolve_kernel("auto", jnp.float32, 64, None) == "xla"  # not training-shaped
    assert resolve_kernel("xla", jnp.bfloat16, 128, 4096) == "xla"
    with pytest.raises(ValueError, match="attention_kernel='blockwise' needs a training-shaped call.*row length 200"):
        resolve_kernel("blockwise", jnp.float32, 64, 200)
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
    assert resolve_kernel("auto", jnp.bfloat16, 64, 4096) == "blockwise"  # head_dim below the lane width
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
    out = attend(q, k, v, segments, kernel="auto")
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
from legorl_jax.models.attention import attend, splash_attention
from legorl_jax.models.blockwise_attention import blockwise_attention
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
    blockwise = loss(lambda q, k, v, seg: blockwise_attention(q, k, v, seg, None, block=128))(q, k, v)
    # attend's blockwise on CPU at float32: the C++ kernel, each shard's rows and heads its own call.
    kernel = lambda q, k, v, seg: attend(q, k, v, seg, kernel="blockwise")
    assert "shard_map" in str(jax.make_jaxpr(kernel)(q, k, v, seg))
    cpu = loss(kernel)(q, k, v)
want = loss(_xla)(q, k, v)
for a, b, c, d in zip(*(jax.tree.leaves(x) for x in (got, want, blockwise, cpu))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(c, b, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d, b, rtol=1e-5, atol=1e-4)
print("ok")
"""


def test_splash_and_blockwise_run_under_a_mesh() -> None:
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


def test_tree_rows_fall_back_from_splash_with_a_reason(
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
    assert "tree rows run xla, not splash" in caplog.text
    np.testing.assert_array_equal(got, want)


# Row 0: packed segments straddling the 128-token tiles, then padding. Row 1: one trie, a
# 150-token prefix and two branches (130 and 90 tokens), then padding; a branch sees the
# prefix and itself, never its sibling.
_TREE_SEGMENTS = np.array([[1] * 100 + [2] * 150 + [3] * 80 + [0] * 54, [1] * 370 + [0] * 14], np.int32)
_TREE_KV_END = np.array([[384] * 384, [370] * 150 + [280] * 130 + [370] * 90 + [384] * 14], np.int32)


@pytest.mark.parametrize("block", [128, 384])
def test_blockwise_matches_xla_on_packed_and_tree_rows(block: int) -> None:
    q, k, v = _qkv(6, 2, 384, 6, 2, 16)
    seg, kv_end = jnp.asarray(_TREE_SEGMENTS), jnp.asarray(_TREE_KV_END)
    cotangent = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

    def run(fn: Callable[..., jax.Array]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        loss = lambda q, k, v: (fn(q, k, v) * cotangent).sum()  # noqa: E731
        return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want, want_grads = run(lambda q, k, v: attend(q, k, v, seg, kv_end, kernel="xla"))
    got, got_grads = run(lambda q, k, v: blockwise_attention(q, k, v, seg, kv_end, block=block))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"d/d{name}")


def test_blockwise_skips_tiles_no_query_sees() -> None:
    # One trie per row: a 256-token prefix, then branches of 128; the branches' tiles see each other in no row.
    seg = jnp.ones((2, 640), jnp.int32)
    kv_end = jnp.asarray([[640] * 256 + [384] * 128 + [512] * 128 + [640] * 128] * 2, jnp.int32)
    live = np.asarray(_live_tiles(seg, kv_end, 128))
    want = np.tril(np.ones((5, 5), bool))
    want[3, 2] = want[4, 2] = want[4, 3] = False
    np.testing.assert_array_equal(live, want)
    # Segments: tiles of different segments are skipped too.
    packed = jnp.asarray([[1] * 256 + [2] * 384], jnp.int32)
    live = np.asarray(_live_tiles(packed, jnp.full((1, 640), 640, jnp.int32), 128))
    assert not live[2:, :2].any() and live[:2, :2][np.tril_indices(2)].all()


def test_blockwise_memory_grows_with_the_row_not_its_square() -> None:
    q, k, v = _qkv(8, 1, 4096, 4, 2, 32)
    seg = jnp.ones((1, 4096), jnp.int32)

    def temp_bytes(fn: Callable[..., jax.Array]) -> int:
        loss = lambda q, k, v: fn(q, k, v).sum()  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)

    # XLA's loops (attend runs the C++ kernel on CPU, whose buffers XLA does not see; it holds tiles too).
    dense = temp_bytes(lambda q, k, v: attend(q, k, v, seg, kernel="xla"))
    blockwise = temp_bytes(lambda q, k, v: blockwise_attention(q, k, v, seg, None, block=512))
    # Dense scores alone are 4 heads x 4096^2 float32 = 256 MiB; a row's q/k/v and gradients ~ 6 MiB.
    assert dense > 256 * 2**20 and blockwise < 32 * 2**20, (dense, blockwise)


# head_dim 8 runs XLA's blockwise loops on CPU, 16 the C++ kernel (cpu_kernels.train_attention_fits).
@pytest.mark.parametrize("head_dim", [8, 16])
def test_blockwise_in_the_model_matches_xla_with_remat(head_dim: int) -> None:
    config = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=head_dim, qk_norm=True, remat="full", attention_kernel="xla",
    )  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 64, (2, 384)), jnp.int32)
    seg, kv_end = jnp.asarray(_TREE_SEGMENTS), jnp.asarray(_TREE_KV_END)
    # A random projection, not a norm of the (RMS-normed) output, whose gradient would be ~0.
    cotangent = jnp.asarray(np.random.default_rng(10).normal(size=(2, 384, 32)), jnp.float32) * (seg != 0)[..., None]

    def loss_and_grads(kernel: str) -> tuple[jax.Array, nnx.State]:
        model = CausalLM(config.replace(attention_kernel=kernel), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state: nnx.State) -> jax.Array:
            hidden, _ = nnx.merge(graphdef, state).hidden(tokens, None, seg, kv_end)
            return (hidden * cotangent).sum()

        return jax.jit(jax.value_and_grad(loss))(state)

    (want, want_grads), (got, got_grads) = loss_and_grads("xla"), loss_and_grads("blockwise")
    # A float32 sum of ~25k signed products that mostly cancel (|loss| ~5): the two kernels' summation
    # orders leave ~1e-5 of it (1.3e-5 on this machine's XLA build), so the scalar gets 1e-4.
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
