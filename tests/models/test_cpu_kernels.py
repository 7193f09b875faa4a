"""The CPU kernels give XLA's results: decode attention reads only what it may, products match numpy,
training attention matches XLA's forward and gradients on packed and tree rows."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.models import cpu_kernels
from legorl_jax.models.attention import attend, paged_attention
from legorl_jax.models.kv_cache import LayerView

# CI has a compiler: there a kernel that failed to build fails these tests instead of skipping them.
pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() and os.environ.get("CI") != "true", reason="needs the CPU backend and a C++ compiler"
)


def _case(
    rows: int, heads: int, kv_heads: int, dim: int, width: int, steps: int = 1, dtype: str = "float32", seed: int = 0
) -> tuple[jax.Array, LayerView, jax.Array]:
    """A 3-layer pool of 32-position blocks, rows owning scattered blocks, queries at varied positions."""
    rng = np.random.default_rng(seed)
    block, blocks = 32, 1 + rows * width
    pool = rng.standard_normal((2, 3, kv_heads, blocks, block, dim), np.float32)
    table = rng.permutation(np.arange(1, blocks)).reshape(rows, width).astype(np.int32)
    last = rng.integers(0, width * block, rows)
    positions = np.maximum(last[:, None] - np.arange(steps)[::-1], -1).astype(np.int32)
    positions[-1, 1:] = -1  # the last row is a decode row padded out
    q = rng.standard_normal((rows, steps, heads, dim), np.float32)
    view = LayerView(
        k=jnp.asarray(pool[0], dtype), v=jnp.asarray(pool[1], dtype), layer=jnp.int32(1), table=jnp.asarray(table)
    )
    return jnp.asarray(q, dtype), view, jnp.asarray(positions)


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim", "width", "steps"),
    [
        (8, 9, 3, 64, 17, 1),  # smollm2-135m's heads at a 544-position window
        (3, 16, 8, 128, 5, 1),  # qwen3-0.6b's heads
        (2, 4, 4, 64, 3, 4),  # no grouping; four queries a row
        (1, 2, 1, 16, 1, 1),  # one row, one block
    ],
)
def test_kernel_matches_the_xla_path(rows: int, heads: int, kv_heads: int, dim: int, width: int, steps: int) -> None:
    q, view, positions = _case(rows, heads, kv_heads, dim, width, steps)
    got = jax.jit(cpu_kernels.decode_attention)(q, view, positions)
    want = jax.jit(paged_attention)(q, view, positions)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [("float32", "bfloat16"), ("bfloat16", "bfloat16")])
def test_kernel_matches_with_bfloat16(q_dtype: str, kv_dtype: str) -> None:
    q, view, positions = _case(4, 9, 3, 64, 9, dtype=kv_dtype, seed=3)
    q = q.astype(q_dtype)
    got = jax.jit(cpu_kernels.decode_attention)(q, view, positions)
    want = jax.jit(paged_attention)(q, view, positions)
    assert got.dtype == want.dtype == jnp.dtype(q_dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=0)


def test_keys_past_a_query_are_never_read() -> None:
    q, view, positions = _case(2, 4, 2, 64, 4)
    positions = jnp.asarray([[40], [0]], jnp.int32)
    table = np.asarray(view.table)
    k, v = np.asarray(view.k).copy(), np.asarray(view.v).copy()
    for row, position in ((0, 40), (1, 0)):  # poison every position after the row's query, block by block
        for s in range(position + 1, table.shape[1] * 32):
            k[1, :, table[row, s // 32], s % 32] = v[1, :, table[row, s // 32], s % 32] = np.nan
    poisoned = LayerView(k=jnp.asarray(k), v=jnp.asarray(v), layer=view.layer, table=view.table)
    got = np.asarray(cpu_kernels.decode_attention(q, poisoned, positions))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, paged_attention(q, view, positions), atol=2e-6, rtol=1e-5)


def test_a_bad_table_is_clamped_not_read_out_of_bounds() -> None:
    # XLA clamps a gather's indices; the kernel must too, or a bad table reads outside the pool.
    q, view, positions = _case(2, 4, 2, 64, 3)
    bad = LayerView(k=view.k, v=view.v, layer=jnp.int32(7), table=jnp.asarray([[10**6, -5, 2], [1, 2, 10**9]]))
    far = jnp.asarray([[10**6], [-(10**6)]], jnp.int32)
    assert np.isfinite(np.asarray(cpu_kernels.decode_attention(q, bad, far))).all()


@pytest.mark.parametrize(
    ("rows", "k", "n"), [(1, 576, 192), (3, 100, 33), (8, 1024, 64), (9, 64, 7), (13, 100, 130), (32, 576, 50)]
)
def test_decode_matmul_is_the_product_with_hf_layout_weights(rows: int, k: int, n: int) -> None:
    # Odd column counts, a K that no vector width divides, rows past one register pass and a
    # work item of several tiles (13 x 130: the second tile's weights are prefetched) are the edges.
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k), np.float32)
    weight = rng.standard_normal((n, k), np.float32)
    got = np.asarray(jax.jit(cpu_kernels.decode_matmul)(jnp.asarray(x), jnp.asarray(weight)))
    np.testing.assert_allclose(got, x.astype(np.float64) @ weight.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    # Leading axes are the rows, as a [B, T, D] activation has them.
    batched = cpu_kernels.decode_matmul(jnp.asarray(x[:, None, :]), jnp.asarray(weight))
    assert batched.shape == (rows, 1, n)


def test_decode_matmul_reads_one_layer_of_a_stack_in_place() -> None:
    # A scanned serving step hands every layer's weight [L, N, K] with a traced layer index.
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 72), np.float32)
    stack = rng.standard_normal((3, 40, 72), np.float32)
    each = jax.jit(lambda x, w, i: cpu_kernels.decode_matmul(x, w, i))
    for layer in range(3):
        got = np.asarray(each(jnp.asarray(x), jnp.asarray(stack), jnp.int32(layer)))
        np.testing.assert_allclose(got, x.astype(np.float64) @ stack[layer].T.astype(np.float64), rtol=1e-5, atol=1e-4)
    # Out of range is clamped as XLA clamps a dynamic index: never a read outside the stack.
    for layer, nearest in ((7, 2), (-4, 0)):
        got = np.asarray(each(jnp.asarray(x), jnp.asarray(stack), jnp.int32(layer)))
        np.testing.assert_allclose(got, np.asarray(each(jnp.asarray(x), jnp.asarray(stack), jnp.int32(nearest))))


def test_decode_matmul_takes_only_few_float32_rows() -> None:
    weight = jnp.ones((4, 8), jnp.float32)
    assert cpu_kernels.matmul_fits(jnp.ones((2, 8), jnp.float32), weight)
    assert not cpu_kernels.matmul_fits(jnp.ones((cpu_kernels.MATMUL_MAX_ROWS + 1, 8), jnp.float32), weight)
    assert not cpu_kernels.matmul_fits(jnp.ones((2, 8), jnp.bfloat16), weight.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="decode_matmul"):
        cpu_kernels.decode_matmul(jnp.ones((2, 8), jnp.bfloat16), weight)
    with pytest.raises(ValueError, match=r"\[L, N, K\]"):
        cpu_kernels.decode_matmul(jnp.ones((2, 8), jnp.float32), jnp.ones((1, 1, 4, 8), jnp.float32))


# Row 0: packed segments off the 64-token tiles, then padding. Row 1: one trie, a 150-token prefix and
# two branches (130 and 90 tokens) that never see each other, then padding. Row 2: one segment whole.
_SEGMENTS = np.array([[1] * 100 + [2] * 150 + [3] * 80 + [0] * 54, [1] * 370 + [0] * 14, [5] * 384], np.int32)
_KV_END = np.array([[384] * 384, [370] * 150 + [280] * 130 + [370] * 90 + [384] * 14, [384] * 384], np.int32)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 16), (4, 4, 32), (8, 1, 128)])
def test_train_attention_matches_xla_forward_and_gradients(heads: int, kv_heads: int, dim: int) -> None:
    rng = np.random.default_rng(heads + dim)
    q, k, v = (jnp.asarray(rng.normal(size=(3, 384, n, dim)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    seg, kv_end = jnp.asarray(_SEGMENTS), jnp.asarray(_KV_END)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def run(fn):  # type: ignore[no-untyped-def]
        loss = lambda q, k, v: (fn(q, k, v) * cotangent).sum()  # noqa: E731
        return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want, want_grads = run(lambda q, k, v: attend(q, k, v, seg, kv_end, kernel="xla"))
    got, got_grads = run(lambda q, k, v: cpu_kernels.train_attention(q, k, v, seg, kv_end))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"d/d{name}")


def test_train_attention_runs_for_float32_training_rows_on_cpu() -> None:
    seg = jnp.ones((1, 1024), jnp.int32)  # two 512-token tiles: "auto" takes blockwise

    def calls(dtype: str, dim: int) -> bool:
        q = jnp.zeros((1, 1024, 4, dim), dtype)
        k = v = jnp.zeros((1, 1024, 2, dim), dtype)
        lowered = jax.jit(jax.grad(lambda q: attend(q, k, v, seg, kernel="auto").sum())).lower(q).as_text()
        return "legorl_train_attention_fwd" in lowered and "legorl_train_attention_bwd" in lowered

    assert calls("float32", 32)
    assert not calls("bfloat16", 32)  # XLA's blockwise loops
    assert not calls("float32", 8)  # head_dim below two vector registers
