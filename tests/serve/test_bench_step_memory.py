"""scripts/bench_step_memory.py runs at the tiny shape and reports every figure;
a step compiled apart (`DeviceStep.compiled`, what the script measures) samples
the same tokens as the engine's own call of that step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from legorl_jax.models import from_hf, init_kv_cache
from legorl_jax.serve.loader import BLOCK_SIZE
from legorl_jax.serve.step import DeviceStep, StepInputs

REPO = Path(__file__).resolve().parents[2]


def test_bench_reports_each_step_shape_and_the_total() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_step_memory.py"), "--shape", "tiny"]
        + ["--steps", "2x1x2", "2x32x2", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert re.match(r"tiny: runtime \d+ MB, weights \d+ MB, pool \d+ MB \(\d+ blocks of 32\)", lines[0])
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert set(rows) == {"2x1x2", "2x32x2"}
    assert all(len(figures) == 5 for figures in rows.values())
    assert float(rows["2x32x2"][2]) > 0  # XLA's temporaries of a 64-token step
    assert lines[-1].startswith("baseline ") and lines[-1].endswith(" MB")


def test_bad_step_shapes_are_refused_by_name() -> None:
    for shape, words in (("2x1", "ROWSxCHUNKxWINDOW"), ("0x1x2", "positive"), ("1x128x2", "does not fit")):
        done = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "bench_step_memory.py"), "--shape", "tiny", "--steps", shape],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 2 and words in done.stderr, (shape, done.stderr[-2000:])


def test_a_step_compiled_apart_samples_what_the_engine_call_samples(tiny_model_dir: Path) -> None:
    model = from_hf(tiny_model_dir)
    model.prepare_for_serving()
    graphdef, state = nnx.split(model)
    rows, chunk = 2, 4
    inputs = StepInputs(
        tokens=np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32),
        positions=np.tile(np.arange(chunk, dtype=np.int32), (rows, 1)),
        block_table=np.array([[1], [2]], np.int32),
        last=np.full(rows, chunk - 1, np.int32),
        targets=np.full((rows, chunk), -1, np.int32),
        temperature=np.ones(rows, np.float32),
        top_k=np.full(rows, -1, np.int32),
        top_p=np.ones(rows, np.float32),
        seeds=np.array([1, 2], np.uint32),
        counters=np.zeros(rows, np.int32),
    )
    step = DeviceStep(graphdef)
    _, called = step(state, init_kv_cache(model.config, 3, BLOCK_SIZE), inputs, False, False)
    compiled = step.compiled(state, init_kv_cache(model.config, 3, BLOCK_SIZE), inputs, False, False)
    _, out = compiled.run(init_kv_cache(model.config, 3, BLOCK_SIZE))
    out = jax.device_get(out)
    np.testing.assert_array_equal(out["token"], called.token)
    np.testing.assert_allclose(out["logprob"], called.logprob, rtol=1e-6)
