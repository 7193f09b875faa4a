"""`legorl train` for two steps at a real model's shape: a random-weight model
shaped like SmolLM2-135M (Llama, 30 layers, hidden 576, vocab 49,152, tied),
its tokenizer at the same vocabulary, through the real proxy, the embedded
engine in its own process and Docker sandboxes. What the toy model's tests
cannot show: nothing in the loop (contexts, buckets, chunk sizes, timeouts,
memory) assumes the toy's sizes.

The tokenizer is trained here, at the model's full vocabulary, on the demo
corpus plus seeded pseudo-words. With the 1,024-token demo tokenizer padded to
49,152 rows, almost every token an untrained model samples would be an id with
no text, so the proxy's text paths (tool-call parsing, the rollout log's
per-token text) would hardly run.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from process_report import failure_report
from script_module import load_script

from .test_train_e2e import train_command

pytestmark = [pytest.mark.slow, pytest.mark.docker]

REPO = Path(__file__).resolve().parents[2]
SHAPE = "smollm2-135m"


def shape_preset(name: str) -> dict:
    """A `scripts/bench_engine.py --shape` preset, so the test and the benchmark build one shape."""
    return dict(load_script("bench_engine").SHAPES[name])


def pseudo_words(documents: int = 2000, words: int = 200, seed: int = 0) -> list[str]:
    """Seeded text of ~80k made-up words: enough distinct merges for a BPE of 49k entries."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    lexicon = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(80_000)]
    return [" ".join(rng.choices(lexicon, k=words)) for _ in range(documents)]


def build_real_shape_model(root: Path) -> Path:
    """The random-weight smollm2-135m-shaped checkpoint with its full-vocabulary tokenizer, under `root`."""
    from transformers import AutoTokenizer

    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.models.tokenizer import build_demo_tokenizer

    shape = shape_preset(SHAPE)
    tokenizer = build_demo_tokenizer(root / "tokenizer", corpus=pseudo_words(), vocab_size=shape["vocab_size"])
    assert len(AutoTokenizer.from_pretrained(tokenizer)) == shape["vocab_size"]
    return build_tiny_hf_model(root / SHAPE, tokenizer_dir=tokenizer, **shape)


@pytest.fixture(scope="module")
def real_shape_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_real_shape_model(tmp_path_factory.mktemp("real_shape"))


# What a 135M model needs of the learner and engine on a CPU host, over the toy's settings:
# - the learner keeps no per-layer activations (remat full): on XLA's CPU attention, saving
#   30 layers' [rows, heads, T, T] scores for the backward pass asks for ~35 GB at the default
#   micro-batch of 16k tokens;
# - the engine serves SmolLM2's 8,192-token context from a KV pool budgeted in bytes (512 MiB of
#   float32 K/V: 11.6k tokens; bfloat16 K/V moves the engine's logprobs ~1e-3 from the learner's).
# The toy's micro-batch budget and length buckets serve as they are: a micro-batch takes only the
# rows its step fills, so a step of a few short sequences computes little padding.
REAL_SHAPE_SETTINGS = {
    "sandbox.kind": "docker",
    # Four trials a group and up to three rounds: a coin-flip group lacks contrast 1 time in 8,
    # so a step has nothing to train on about 1 run in 500.
    "rl.group_size": "4",
    "rl.max_sampling_rounds": "3",
    # A 135M model on two shared cores prefills and decodes for tens of seconds a call; the demo's
    # 120 s agent timeout is the toy's.
    "fleet.agent_timeout_s": "600",
    "model.remat": "full",
    "engine.max_context": "8192",
    "engine.max_batch": "4",
    "engine.kv_cache_memory_bytes": str(512 * 2**20),
    # A checkpoint at this shape is 1.4 GB (f32 weights and Adam's two moments); one is enough
    # to show the save works, and a CI machine's disk may be small.
    "learner.checkpoint.keep": "1",
}


def real_shape_command(model_dir: Path, run_parent: Path) -> list[str]:
    """The toy e2e test's `legorl train` command (2 steps, coinflip task, lego) at the real shape."""
    command = train_command(model_dir, run_parent, steps=2)
    for key, value in REAL_SHAPE_SETTINGS.items():
        command += ["--set", f"{key}={value}"]
    return command


def test_two_training_steps_at_a_real_shape_through_proxy_engine_and_docker(
    real_shape_model: Path, tmp_path: Path
) -> None:
    config = json.loads((real_shape_model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    done = subprocess.run(real_shape_command(real_shape_model, tmp_path), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, failure_report(done)
    run = tmp_path / "e2e"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2] and [r["policy_version"] for r in train] == [1, 2]
    assert all(r["rollout/env_failures"] == 0 and r["status/ok"] == r["rollout/trials"] for r in train), train
    trained = [r for r in train if r.get("sequences/trained", 0) > 0]
    assert trained, "no step had a group with reward contrast to train on"
    for r in trained:
        # learner and engine score the sampled tokens with the same weights at 49k vocab and 30 layers
        assert r["logprob_diff_mean"] < 1e-3, r
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    sampled = [t for r in rollouts for t in r["sampled"]]
    assert sampled and any(text.strip() for text in sampled), "the engine's samples decoded to no text"
    assert (run / "weights" / "LATEST").read_text().strip() == "v00000002"
