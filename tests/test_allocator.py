"""`keep_freed_memory`: what it changes in a fresh process, and its opt-out.

Each case runs in a subprocess: the settings are process-wide and must come
before any thread, which pytest's process is long past.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Allocates and frees a 64 MB block, then reports whether it came from mmap
# (mallinfo2's hblkhd: bytes in mmapped blocks, read while the block is live).
PROBE = """
import ctypes, sys
sys.path.insert(0, {repo!r})
from legorl_jax.core.allocator import keep_freed_memory
applied = keep_freed_memory()

class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(64 << 20)
mmapped = libc.mallinfo2().hblkhd >= 64 << 20
libc.free(ctypes.c_void_p(block))
print(applied, mmapped)
"""


def _probe(malloc_env: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEGORL_MALLOC", "MALLOC_"))}
    if malloc_env is not None:
        env["LEGORL_MALLOC"] = malloc_env
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=str(REPO))], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tunes glibc only")
def test_large_blocks_come_from_the_heap_not_mmap() -> None:
    assert _probe(None) == "True False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tunes glibc only")
def test_opt_out_keeps_glibc_defaults() -> None:
    # glibc's default serves a 64 MB block with its own mmap.
    assert _probe("default") == "False True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tunes glibc only")
def test_the_legorl_command_applies_it() -> None:
    # Any subcommand: `legorl config schema` prints the run config's JSON schema.
    probe = PROBE.replace(
        "applied = keep_freed_memory()", "from legorl_jax import cli; applied = cli.main(['config', 'schema']) == 0"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEGORL_MALLOC", "MALLOC_"))}
    out = subprocess.run(
        [sys.executable, "-c", probe.format(repo=str(REPO))], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "True False"
