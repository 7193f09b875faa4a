"""The CPU decode-attention kernel (`decode_attention.cc`): build, load, call.

A decode step's attention on CPU is memory-bound, and XLA runs it as a gather
of each row's window plus many tiny products; the kernel reads each row's
blocks straight from the pool, once. It is compiled with the system's C++
compiler on first use for this machine (`-march=native`) into the cache
(`$LEGORL_CACHE`, default `.cache/` in the repository), keyed by the source,
the compiler, the CPU and jaxlib, and registered with XLA as an FFI target.
Without a compiler (or off CPU) `available()` is False and the engine keeps
XLA's path, saying why once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from legorl_jax.core.build_once import build_once
from legorl_jax.core.config import REPO_ROOT
from legorl_jax.models.kv_cache import LayerView

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "legorl_decode_attention"
_LIBRARY = "decode_attention.so"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def available() -> bool:
    """Whether decode steps can run the kernel: a CPU backend and a library built and registered."""
    return jax.default_backend() == "cpu" and _registered() is not None


def decode_attention(q: jax.Array, view: LayerView, positions: jax.Array) -> jax.Array:
    """paged_attention's result for q[B, T, N, H] at positions[B, T] over `view`, by the kernel."""
    if not available():
        raise RuntimeError("the CPU decode-attention kernel is unavailable (see the log); use paged_attention")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    layer = jnp.asarray(view.layer, jnp.int32)
    return call(q, view.k, view.v, layer, view.table.astype(jnp.int32), positions.astype(jnp.int32))


@functools.cache
def _registered() -> Path | None:
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.LegorlDecodeAttention), platform="cpu")
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        logger.warning("decode attention: the CPU kernel is unavailable (%s); decode steps run XLA's path", error)
        return None
    return path


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(_FLAGS).encode(), _cpu_flags(), jaxlib.__version__):
        key.update(part if isinstance(part, bytes) else part.encode())
    cache = Path(os.environ.get("LEGORL_CACHE", REPO_ROOT / ".cache")) / "kernels" / key.hexdigest()[:20]

    def compile_into(directory: Path) -> None:
        command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(directory / _LIBRARY)]
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
