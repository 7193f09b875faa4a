"""ensure_demo_model: a tiny build end to end, the cache hit, and the cache key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from legorl_jax.core.config import Config
from legorl_jax.demo import demo_model
from legorl_jax.demo.demo_model import BUILD_INFO, DemoModelSpec, cache_key, demo_harness_options, ensure_demo_model
from legorl_jax.demo.sft import SFTConfig
from legorl_jax.models import from_hf
from rollout_server.tasks import demo_tasks

TINY = DemoModelSpec(
    vocab_size=768,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    harnesses=({"tools": "bash_only", "prompt": "terse"},),
    plans=("direct",),
    sft=SFTConfig(max_steps=4, batch_size=2, eval_every=2, target_pass=1.0),
)


def one_task() -> list:
    return [next(t for t in demo_tasks() if t.name == "edit-config")]


@pytest.mark.slow  # the whole demo build: demonstrations, SFT, export
def test_build_then_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = ensure_demo_model(tmp_path, progress=False, spec=TINY, tasks=one_task())
    info = json.loads((built / BUILD_INFO).read_text())
    assert info["demonstrations"] == 1 and info["sft_steps"] == 4 and not info["reached_target"]
    assert info["cache_key"].startswith(built.name.removeprefix("demo-model-"))
    model = from_hf(built)
    assert model.config.architecture == "qwen3" and model.config.tie_word_embeddings
    assert model.config.hidden_size == 32 and model.config.vocab_size == 768
    assert (built / "tokenizer.json").is_file() and "<tool_call>" in (built / "tokenizer_config.json").read_text()
    # Nothing but the finished model is left in the cache directory.
    assert [p.name for p in tmp_path.iterdir()] == [built.name]

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("a matching cached model was rebuilt")

    monkeypatch.setattr(demo_model, "build_demo_model", no_rebuild)
    assert ensure_demo_model(tmp_path, progress=False, spec=TINY, tasks=one_task()) == built


def test_a_failed_build_leaves_no_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out_dir: Path, *args: object, **kwargs: object) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("build interrupted")

    monkeypatch.setattr(demo_model, "build_demo_model", broken)
    with pytest.raises(RuntimeError, match="build interrupted"):
        ensure_demo_model(tmp_path, progress=False, spec=TINY, tasks=one_task())
    assert list(tmp_path.iterdir()) == []


def test_cache_key_changes_with_what_determines_the_model(tmp_path: Path) -> None:
    tasks = one_task()
    harnesses = list(TINY.harnesses)
    key = cache_key(TINY, tasks, harnesses)
    assert cache_key(TINY, tasks, harnesses) == key
    assert cache_key(TINY.model_copy(update={"seed": 1}), tasks, harnesses) != key
    assert cache_key(TINY, tasks, [{"tools": "edit_tools"}]) != key
    assert cache_key(TINY, demo_tasks(), harnesses) != key


def test_harnesses_come_from_the_config_lego_entries() -> None:
    mix = {"harnesses": [{"name": "lego", "options": {"tools": "minimal"}}, {"name": "claude-code"}]}
    assert demo_harness_options(Config(harness_mix=mix)) == [{"tools": "minimal"}]
    with pytest.raises(ValueError, match="no lego entry"):
        demo_harness_options(Config(harness_mix={"harnesses": [{"name": "claude-code"}]}))
    # The shipped demo config trains lego, so the default build has something to demonstrate.
    assert demo_harness_options()
