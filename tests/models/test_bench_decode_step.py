"""scripts/bench_decode_step.py runs at the tiny shape and prints every row it promises:
the decode step and attention for each variant, and the products against torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from legorl_jax.models import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels need a C++ compiler")
def test_bench_prints_the_step_attention_and_products_rows() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_decode_step.py"), "--shape", "tiny"]
        + ["--rows", "12", "--positions", "40", "--steps", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    number = r"\d+\.\d"
    assert re.search(rf"^decode step +{number} +{number} +{number} +{number}+x$", out, re.M), out
    assert re.search(rf"^attention, all layers +{number} +{number} +{number}+x$", out, re.M), out
    match = re.search(rf"12 rows\): kernel ({number}) ms, torch linear \(MKL\) ({number}) ms, torch / kernel", out)
    assert match and float(match[1]) > 0 and float(match[2]) > 0, out
