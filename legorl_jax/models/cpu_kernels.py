"""The CPU kernels: the engine's decode steps and training rows' attention. Build, load, call.

A decode step on CPU is bound by memory reads, and XLA reads below the
memory system's speed at its shapes. `decode_attention.cc` reads each row's
KV blocks straight from the pool, once (XLA gathers each row's window, then
runs many tiny products); `decode_matmul.cc` multiplies the step's few rows
by a weight streamed once in its stored [out, in] layout. A training row's
attention is bound by arithmetic instead, and XLA's blockwise loops run far
below the FMA units' speed: `train_attention.cc` computes the same thing
(forward and backward) a 64 x 64 tile at a time in vector registers.

All are compiled with the system's C++ compiler on first use for this machine
(`-march=native`) into one library in the cache (`$LEGORL_CACHE`, default
`.cache/` in the repository), keyed by the sources, the compiler, the CPU and
jaxlib, and registered with XLA as FFI targets. Without a compiler (or off
CPU) `available()` is False and the callers keep XLA's path, saying why once
in the log.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from legorl_jax.core.build_once import build_once
from legorl_jax.core.config import cache_root
from legorl_jax.models.kv_cache import LayerView

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = (_HERE / "decode_attention.cc", _HERE / "decode_matmul.cc", _HERE / "train_attention.cc")
_HEADERS = (_HERE / "cpu_pool.h", _HERE / "cpu_math.h")
# FFI target name -> the handler symbol the library exports.
_TARGETS = {
    "legorl_decode_attention": "LegorlDecodeAttention",
    "legorl_decode_matmul": "LegorlDecodeMatmul",
    "legorl_train_attention_fwd": "LegorlTrainAttentionForward",
    "legorl_train_attention_bwd": "LegorlTrainAttentionBackward",
}
_LIBRARY = "cpu_kernels.so"
# Rows up to which a product takes the kernel: a decode step's (prefill chunks keep XLA's dot, compute-bound there).
MATMUL_MAX_ROWS = 32
# A training row's attention works in 64-query, 64-key tiles (train_attention.cc's kTile).
TRAIN_TILE = 64
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def available() -> bool:
    """Whether the kernels can run: a CPU backend, a library built and registered, and
    `LEGORL_CPU_KERNELS` not `off` (which keeps every caller on XLA's path; read at trace time)."""
    if os.environ.get("LEGORL_CPU_KERNELS", "on") == "off":
        return False
    return jax.default_backend() == "cpu" and _registered() is not None


def decode_attention(q: jax.Array, view: LayerView, positions: jax.Array) -> jax.Array:
    """paged_attention's result for q[B, T, N, H] at positions[B, T] over `view`, by the kernel."""
    if not available():
        raise RuntimeError("the CPU decode kernels are unavailable (see the log); use paged_attention")
    call = jax.ffi.ffi_call("legorl_decode_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    layer = jnp.asarray(view.layer, jnp.int32)
    return call(q, view.k, view.v, layer, view.table.astype(jnp.int32), positions.astype(jnp.int32))


def matmul_fits(x: jax.Array, weight: jax.Array) -> bool:
    """Whether `decode_matmul(x, weight)` runs the kernel: float32, few rows, kernels available."""
    rows = math.prod(x.shape[:-1])
    return x.dtype == weight.dtype == jnp.float32 and 0 < rows <= MATMUL_MAX_ROWS and available()


def decode_matmul(x: jax.Array, weight: jax.Array, layer: jax.Array | int = 0) -> jax.Array:
    """x[..., K] @ weight[N, K].T by the kernel (float32; see `matmul_fits`).

    weight may be a stack of layers' weights [L, N, K]: then layer `layer`'s is
    read in place (a scanned step's weights are never sliced out of the stack).
    """
    if not matmul_fits(x, weight) or weight.ndim not in (2, 3):
        raise ValueError(
            f"decode_matmul: float32 x of at most {MATMUL_MAX_ROWS} rows and weight [N, K] or [L, N, K] "
            "on the CPU kernels only"
        )
    flat = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call("legorl_decode_matmul", jax.ShapeDtypeStruct((flat.shape[0], weight.shape[-2]), x.dtype))
    return call(flat, weight, jnp.asarray(layer, jnp.int32).reshape(1)).reshape(*x.shape[:-1], weight.shape[-2])


def train_attention_fits(q: jax.Array) -> bool:
    """Whether `train_attention` runs for q[B, T, N, H]: float32, T a multiple of the tile, H of 16
    (two vector registers), kernels available."""
    return q.dtype == jnp.float32 and q.shape[1] % TRAIN_TILE == 0 and q.shape[3] % 16 == 0 and available()


@jax.custom_vjp
def train_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array) -> jax.Array:
    """blockwise_attention's result (float32 q[B, T, N, H], k/v[B, T, K, H], segment_ids and
    kv_end int32[B, T]) by the kernel; differentiable in q, k and v."""
    return _train_forward(q, k, v, segment_ids, kv_end)[0]


def _train_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array
) -> tuple[jax.Array, jax.Array]:
    if not train_attention_fits(q):
        raise ValueError(
            f"train_attention: float32 rows of a multiple of {TRAIN_TILE} tokens, head_dim a multiple of 16, "
            "on the CPU kernels only"
        )
    b, t, n, _ = q.shape
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32))
    rows = (segment_ids.astype(jnp.int32), kv_end.astype(jnp.int32))
    out, lse = jax.ffi.ffi_call("legorl_train_attention_fwd", outs)(q, k, v, *rows)
    return out, lse


def _train_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _train_forward(q, k, v, segment_ids, kv_end)
    return out, (q, k, v, segment_ids, kv_end, out, lse)


def _train_bwd(residuals: tuple[jax.Array, ...], d_out: jax.Array) -> tuple[jax.Array | None, ...]:
    q, k, v, segment_ids, kv_end, out, lse = residuals
    grads = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    rows = (segment_ids.astype(jnp.int32), kv_end.astype(jnp.int32))
    dq, dk, dv = jax.ffi.ffi_call("legorl_train_attention_bwd", grads)(q, k, v, *rows, out, lse, d_out)
    return dq, dk, dv, None, None


train_attention.defvjp(_train_fwd, _train_bwd)


@functools.cache
def _registered() -> Path | None:
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, AttributeError, subprocess.CalledProcessError, RuntimeError) as error:
        logger.warning(
            "the CPU kernels are unavailable (%s): decode steps and training attention run XLA's path", error
        )
        return None
    return path


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *_HEADERS))
    for part in (sources, version.encode(), " ".join(_FLAGS).encode(), _cpu_flags(), jaxlib.__version__):
        key.update(part if isinstance(part, bytes) else part.encode())
    cache = cache_root() / "kernels" / key.hexdigest()[:20]

    def compile_into(directory: Path) -> None:
        command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(directory / _LIBRARY)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")

    return build_once(cache, compile_into, lambda d: (d / _LIBRARY).is_file()) / _LIBRARY


def _cpu_flags() -> str:
    """What -march=native compiles for: a library built on another CPU may not run on this one."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()
