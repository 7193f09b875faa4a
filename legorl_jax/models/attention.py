"""The attention kernel: which implementation computes softmax(q k^T / sqrt(H)) v.

What runs where (`attention_kernel`; "auto" is the default). Training rows
(causal, queries and keys aligned at index 0, packed by segment ids) go
through `attend`:

- Blockwise (`blockwise_attention`): XLA code that computes a row a tile of
  queries by a tile of keys at a time with a running softmax, and a custom
  backward pass that recomputes each tile, so memory grows with the row, not
  its square, and tiles no query can see are skipped. "auto" picks it for
  rows of two or more tiles (multiples of 128) wherever no fused kernel
  takes the call: on CPU, for float32 on GPUs, for tree rows on TPU. On
  CPU at float32 (head_dim a multiple of 16) the same computation runs as
  `cpu_kernels`' C++ kernel (`train_attention.cc`, forward and backward):
  at the CLI demo model's heads XLA's loops of small products take 1.4-1.8x
  its time (docs/benchmarks.md); elsewhere, or without a C++ compiler, XLA's.
- XLA (`jax.nn.dot_product_attention(implementation="xla")`) runs everywhere
  and builds the [B, N, T, T] score matrix: "auto" keeps it for rows of one
  tile and rows no tile size divides.
- cuDNN's fused kernel: "auto" picks it on an Ampere-or-newer NVIDIA GPU for
  16-bit activations and head_dim a multiple of 8 up to 128. It reads the
  boolean mask.
- Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`):
  "auto" picks it on TPU for rows whose length and head_dim are multiples of
  128. It never sees the dense mask: the causal triangle is a static
  block-sparse mask (blocks above the diagonal are skipped) and the packing
  arrives as segment ids.

KV-cache steps (the embedded engine's prefill/decode) run `cached_attention`
whatever the setting. On CPU a decode step (one query a row) runs the C++
kernel of `cpu_kernels` (reads each row's blocks once); every other step
runs `paged_attention`: XLA code that gathers the window's keys from the block
pool once, then reads them a tile at a time with an online softmax (a decode
step's one tile is the whole window), so a prefill's scores never span the
whole window and tiles past a step's last position are skipped (serving on
accelerator hosts is vLLM's).

Tree rows (shared prompt prefixes, `legorl_jax.rl.batching`): a token sees
only its own prefix chain, a data-dependent mask. Blockwise reads it from
`kv_end` (and skips other members' continuations whole), XLA and cuDNN from
the boolean mask. Splash cannot express it (its masks are static block
patterns and it takes packing only as equal segment ids), so a tree call
that would run splash runs blockwise (XLA for a one-tile row) instead, and
says so in the log.

Sharding: a Pallas or FFI kernel is opaque to XLA's SPMD partitioner, so under a
context mesh (`jax.set_mesh`) splash and the CPU kernel run inside `jax.shard_map`: rows split
over the `data`/`fsdp` axes, heads over `tensor`, each where it divides. With
several devices and no context mesh "auto" keeps XLA (whole-array kernel calls
would not be data parallel); the learner's step must be traced under
`jax.set_mesh(mesh)` to get splash on a pod.

Tested: splash and blockwise match XLA (forward and gradients, packed rows,
tree rows for blockwise, GQA, a mesh of fake CPU devices), splash with the
kernel run in Pallas interpret mode on CPU, i.e. the same kernel code, not
Mosaic-compiled: it has not run on a real TPU here. `scripts/bench_attention.py`
compares what "auto" picks with XLA on the machine it runs on.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from legorl_jax.models import cpu_kernels
from legorl_jax.models.blockwise_attention import blockwise_attention
from legorl_jax.models.config import AttentionKernel
from legorl_jax.models.kv_cache import LayerView, read_blocks
from legorl_jax.models.sharding import BATCH_AXES

Implementation = Literal["xla", "cudnn", "splash", "blockwise"]
logger = logging.getLogger(__name__)

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The backend each explicit fused kernel needs, and how an error names it.
_BACKEND_OF = {"cudnn": ("gpu", "an NVIDIA GPU"), "splash": ("tpu", "a TPU")}
# Tiles of splash and blockwise attention: multiples of the TPU's 128 lanes (splash's segment-id
# masking asserts so); the largest that divides the row wins, since bigger tiles amortise per-tile
# overhead (on CPU 512 beat 256 and 1,024 at 4k-token rows: docs/benchmarks.md).
_TILES = (512, 256, 128)


# The platform programs are compiled for, when it is not this process's own (`compile_target`).
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_compile_target", default=None)


@contextlib.contextmanager
def compile_target(platform: str) -> Iterator[None]:
    """Within it, kernels are chosen for `platform` ("tpu", "gpu", "cpu") rather than for
    the process's default backend: a plan traced on a CPU for a TPU must use the TPU's
    kernels (splash), as the real run would (`legorl plan`)."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def _compile_backend() -> str:
    """The platform programs are compiled for: `compile_target`'s, else this process's default backend."""
    return _TARGET.get() or jax.default_backend()


def resolve_kernel(
    kernel: AttentionKernel, dtype: jnp.dtype, head_dim: int, seq_len: int | None = None
) -> Implementation:
    """The implementation `kernel` stands for on the compile target (`compile_target`;
    by default this process's default backend).

    seq_len is the row length of a training-shaped call (see the module
    docstring); None says the call is not one, which rules splash and
    blockwise out.
    """
    if kernel not in get_args(AttentionKernel):
        raise ValueError(f"attention_kernel must be one of {get_args(AttentionKernel)}, got {kernel!r}")
    backend = _compile_backend()
    if kernel in _BACKEND_OF and backend != _BACKEND_OF[kernel][0]:
        raise ValueError(f"attention_kernel={kernel!r} needs {_BACKEND_OF[kernel][1]}; this process runs on {backend}")
    if kernel in ("splash", "blockwise") and (seq_len is None or tile_size(seq_len) is None):
        raise ValueError(
            f"attention_kernel={kernel!r} needs a training-shaped call (causal, no KV cache, segment ids) "
            f"with a row length that is a multiple of 128; got row length {seq_len}"
        )
    if kernel != "auto":
        return kernel
    if backend == "tpu" and seq_len is not None and _splash_fits(head_dim, seq_len):
        return "splash"
    if backend == "gpu" and jnp.dtype(dtype) in _CUDNN_DTYPES and _cudnn_fits(head_dim):
        return "cudnn"
    return "blockwise" if _blockwise_pays(seq_len) else "xla"


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    kv_end: jax.Array | None = None,
    *,
    kernel: AttentionKernel,
) -> jax.Array:
    """Causal attention of a training row: q[B, T, N, H], k/v[B, T, K, H] (N a multiple of K) -> [B, T, N, H].

    segment_ids int32[B, T] pack several sequences in a row: a token sees
    earlier tokens of its own segment. kv_end int32[B, T] (tree rows, see
    `legorl_jax.rl.batching`) further limits key s to queries before
    kv_end[s], so a token sees only its own prefix chain.
    """
    impl = resolve_kernel(kernel, q.dtype, q.shape[-1], q.shape[1])
    if kv_end is not None and impl == "splash":
        fallback: Implementation = "blockwise" if _blockwise_pays(q.shape[1]) else "xla"
        logger.info("attention: tree rows run %s, not splash (splash cannot express a prefix-chain mask)", fallback)
        impl = fallback
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if impl == "splash":
        return splash_attention(q, k, v, segment_ids)
    if impl == "blockwise":
        if _compile_backend() == "cpu" and cpu_kernels.train_attention_fits(q):
            ends = jnp.full(segment_ids.shape, q.shape[1], jnp.int32) if kv_end is None else kv_end
            return _per_shard(cpu_kernels.train_attention, q, k, v, segment_ids, ends)
        tile = tile_size(q.shape[1])
        assert tile is not None  # resolve_kernel picks blockwise only for rows of whole tiles
        return blockwise_attention(q, k, v, segment_ids, kv_end, block=tile)
    mask = causal_segment_mask(segment_ids, kv_end)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def causal_segment_mask(segment_ids: jax.Array, kv_end: jax.Array | None = None) -> jax.Array:
    """bool[B, 1, T, T]: causal by index within a row, and only within a segment.

    kv_end int32[B, T] (tree rows) further limits key s to queries before
    kv_end[s], the end of its subtree: a token then sees its own prefix chain.
    """
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    mask = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if kv_end is not None:
        mask &= jnp.arange(t, dtype=jnp.int32)[None, :, None] < kv_end[:, None, :]
    return mask[:, None]


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """Causal attention within segments through the Pallas splash kernel.

    q[B, T, N, H], k/v[B, T, K, H], segment_ids int32[B, T] -> [B, T, N, H].
    `interpret` runs the kernel in Pallas interpret mode (any backend; slow).
    """
    if tile_size(q.shape[1]) is None:
        raise ValueError(f"splash attention needs a row length that is a multiple of 128, got {q.shape[1]}")
    return _per_shard(partial(_splash_per_shard, interpret=interpret), q, k, v, segment_ids)


def _per_shard(run: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, *rows: jax.Array) -> jax.Array:
    """run(q, k, v, *rows) -> [B, T, N, H] on each shard under a context mesh, else whole.

    A kernel call (Pallas, FFI) is opaque to XLA's SPMD partitioner, which would
    gather its inputs whole onto every device; rows (q/k/v and each [B, T] of
    `rows`) split over the batch axes and heads over `tensor` instead, each where it divides.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(q, k, v, *rows)
    batch = [axis for axis in BATCH_AXES if axis in mesh.axis_names]
    rows_spec = tuple(batch) if batch and q.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else None
    # Sharding kv heads over `tensor` keeps each query head with its kv head (contiguous grouping).
    heads = "tensor" if "tensor" in mesh.axis_names and k.shape[2] % mesh.shape["tensor"] == 0 else None
    qkv = PartitionSpec(rows_spec, None, heads, None)
    # check_vma off: the kernels declare their outputs without how they vary over mesh axes.
    in_specs = (qkv, qkv, qkv, *[PartitionSpec(rows_spec, None)] * len(rows))
    return jax.shard_map(run, in_specs=in_specs, out_specs=qkv, check_vma=False)(q, k, v, *rows)


def _splash_per_shard(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, interpret: bool
) -> jax.Array:
    _, t, n, h = q.shape
    b = tile_size(t)
    assert b is not None  # splash_attention checked the row length
    sizes = splash.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
        block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    # The MHA form maps query head i to kv head i // (N / K) itself, the same grouping as
    # dot_product_attention, so GQA needs neither repeated k/v nor one MQA call per kv head.
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([splash.CausalMask((t, t))] * n),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    # Splash does not scale the logits: scale q (in float32, one rounding) as the other paths scale scores.
    q = (q.astype(jnp.float32) * h**-0.5).astype(q.dtype)
    # Padding (segment 0) is a segment like any other: each of its tokens sees at least itself,
    # so no softmax row is empty and its outputs stay finite, as on the XLA path.
    segments = splash.SegmentIds(q=segment_ids, kv=segment_ids)
    heads_major = partial(jnp.swapaxes, axis1=1, axis2=2)
    out = jax.vmap(kernel)(heads_major(q), heads_major(k), heads_major(v), segments)
    return heads_major(out)


def tile_size(seq_len: int) -> int | None:
    """The largest of `_TILES` that divides a row of seq_len, if any."""
    return next((b for b in _TILES if seq_len % b == 0), None)


def _blockwise_pays(seq_len: int | None) -> bool:
    """Whether "auto" runs blockwise: a training row of two tiles or more (one tile is XLA's dense call)."""
    tile = None if seq_len is None else tile_size(seq_len)
    return seq_len is not None and tile is not None and seq_len > tile


def _cudnn_fits(head_dim: int) -> bool:
    """cuDNN's fused attention needs head_dim a multiple of 8 up to 128 and an Ampere or newer GPU.

    Compiling for a GPU from a process without one (`legorl plan`) never picks it:
    cuDNN's kernels are built by the cuDNN library at compile time, which plans
    do not install; this process's devices then have no compute capability."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return head_dim % 8 == 0 and head_dim <= 128 and float(capability) >= 8.0


def _splash_fits(head_dim: int, seq_len: int) -> bool:
    """Whether "auto" may pick splash: a 128-multiple row, lane-aligned heads, and a way to shard it."""
    # head_dim below 128 is padded to lanes inside the kernel and has failed there in past JAX
    # releases; 128-multiples (Qwen3, Llama 3) are the shapes the kernel is known for.
    if tile_size(seq_len) is None or head_dim % 128:
        return False
    return jax.device_count() == 1 or not jax.sharding.get_abstract_mesh().empty


# Keys per tile of a KV-cache step: scores [heads, rows, chunk, KV_TILE] stay
# small enough to stay in cache, and the step skips tiles no query reaches.
KV_TILE = 512
# A step with few queries (decode) widens its tiles up to this many (query, key)
# score pairs: one tile over the whole window skips the loop and its slicing.
TILE_PAIRS = 2**22

Carry = tuple[jax.Array, jax.Array, jax.Array]  # running max, running sum, weighted values


def cached_attention(q: jax.Array, view: LayerView, positions: jax.Array) -> jax.Array:
    """A KV-cache step's attention, q[B, T, N, H] -> [B, T, N, H]: the CPU kernel for a
    decode step where it is built, else `paged_attention` (module docstring)."""
    # A prefill chunk is compute-bound and XLA's tiled products serve it well; the
    # kernel's win is reading a decode step's memory-bound window once.
    if q.shape[1] == 1 and cpu_kernels.available():
        return cpu_kernels.decode_attention(q, view, positions)
    return paged_attention(q, view, positions)


def paged_attention(q: jax.Array, view: LayerView, positions: jax.Array, tile: int = KV_TILE) -> jax.Array:
    """Attention of a KV-cache step: q[B, T, N, H] at positions[B, T] over the
    pool blocks of each row's table (`view`), whose position s lives in block
    table[b, s // block_size] -> [B, T, N, H].

    A query at position p sees keys 0..p; a padding query (-1) sees key 0
    only, so its softmax stays finite. The window's blocks are gathered once,
    head-major, so both products batch over (head, row) with no transpose;
    keys are then read a tile at a time with a running max and sum, and only
    up to the step's furthest position: a chunk costs chunk x context so far.
    Tiles every query sees whole skip the mask.
    """
    b, t, n, h = q.shape
    kv_heads, block = view.k.shape[1], view.k.shape[3]
    group = n // kv_heads
    # Tiles of at most `tile` keys (more when the step has few queries), as even as
    # the window allows, so padding stays under a tile's count of blocks.
    tile = max(tile, TILE_PAIRS // (b * n * t))
    width = view.table.shape[1]
    per_tile = -(-width // -(-width // max(1, tile // block)))
    tile = per_tile * block
    # Table entries past the window read the null block: their keys sit beyond every query's position.
    table = jnp.pad(view.table, ((0, 0), (0, -width % per_tile)))
    # Gathered here, not per tile inside the loop: a loop that read the pool itself
    # would make XLA copy the whole pool (the layers' loop carry) on every layer.
    keys, values = read_blocks(view.k, view.layer, table), read_blocks(view.v, view.layer, table)
    # Query head i reads kv head i // G, as dot_product_attention groups them; rows (g, t) per kv head.
    # The 1/sqrt(H) scale is folded into q once instead of into every tile's scores.
    grouped = q.reshape(b, t, kv_heads, group, h).transpose(2, 0, 3, 1, 4).reshape(kv_heads, b, group * t, h)
    grouped = (grouped.astype(jnp.float32) * h**-0.5).astype(q.dtype)
    seen = jnp.tile(jnp.maximum(positions, 0), (1, group))[None, :, :, None]  # [1, B, G*T, 1]
    acc_dtype = jnp.float32

    def tile_step(i: jax.Array, carry: Carry, masked: bool) -> Carry:
        top, total, acc = carry
        kt, vt = (jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=2) for x in (keys, values))
        scores = jnp.einsum("kbqh,kbsh->kbqs", grouped, kt, preferred_element_type=acc_dtype)
        if masked:
            at = i * tile + jnp.arange(tile)
            scores = jnp.where(at <= seen, scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(-1))
        probs = jnp.exp(scores - new_top[..., None])
        rescale = jnp.exp(top - new_top)
        total = total * rescale + probs.sum(-1)
        update = jnp.einsum("kbqs,kbsh->kbqh", probs.astype(vt.dtype), vt, preferred_element_type=acc_dtype)
        return new_top, total, acc * rescale[..., None] + update

    stats = (kv_heads, b, group * t)
    init = (jnp.full(stats, -jnp.inf, acc_dtype), jnp.zeros(stats, acc_dtype), jnp.zeros((*stats, h), acc_dtype))
    if per_tile >= width:  # one tile: no loop
        _, total, acc = tile_step(jnp.int32(0), init, masked=True)
    else:
        # Tiles wholly at or before every real query's position need no mask (padding
        # queries may read them: their outputs are discarded and stay finite). Tile 0
        # always runs, so the running max is finite after it.
        real = positions >= 0
        nearest = jnp.min(jnp.where(real, positions, jnp.iinfo(jnp.int32).max))
        unmasked = jnp.where(jnp.any(real), (nearest + 1) // tile, 0)
        tiles = jnp.max(seen) // tile + 1
        carry = jax.lax.fori_loop(0, unmasked, partial(tile_step, masked=False), init)
        _, total, acc = jax.lax.fori_loop(unmasked, tiles, partial(tile_step, masked=True), carry)
    out = (acc / total[..., None]).astype(q.dtype).reshape(kv_heads, b, group, t, h)
    return out.transpose(1, 3, 0, 2, 4).reshape(b, t, n, h)
