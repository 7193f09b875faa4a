"""Typed configs: every shipped YAML validates; errors name file, field and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl_jax.core.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    Config,
    ConfigError,
    dump_config,
    load_config,
    parse_override,
)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    assert isinstance(load_config(path), Config)


def test_default_is_demo_and_round_trips(tmp_path: Path) -> None:
    config = load_config()
    assert config.engine.kind == "embedded"
    saved = tmp_path / "resolved.yaml"
    saved.write_text(dump_config(config))
    assert load_config(saved) == config


def test_overrides_apply_with_yaml_types() -> None:
    config = load_config(
        None,
        ["rl.sampling.temperature=0.7", "fleet.servers=[a:1, b:2]", "model.path=/m", "rl.mis_cap=null"],
    )
    assert config.rl.sampling.temperature == 0.7
    assert config.fleet.servers == ["a:1", "b:2"]
    assert config.model.path == "/m"
    assert config.rl.mis_cap is None


def test_wrong_type_names_override_field_and_expectation() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rl.clip_low=abc"])
    message = str(info.value)
    assert "--set rl.clip_low=abc" in message
    assert "rl.clip_low" in message
    assert "valid number" in message


def test_unknown_field_in_file_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  group_size: 4\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert f"{bad}: rl.temprature: unknown field" in str(info.value)


def test_wrong_type_in_file_names_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  mesh: {fsdp: many}\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert f"{bad}: learner.mesh.fsdp:" in str(info.value)
    assert "valid integer" in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"{missing}: config file not found"):
        load_config(missing)


def test_cross_field_rule_reported() -> None:
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        load_config(None, ["learner.mesh.data=-1"])


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("gs:/legorl-test/run", "is not a gs:// URL"),
        ("gs://", "is not a GCS bucket name"),
        ("gs://Bad_Bucket/run", "is not a GCS bucket name"),
        ("gs://legorl-test//run", "empty, '.' or '..' segment"),
        ("s3://bucket/run", "only a local path or gs://bucket/prefix"),
    ],
)
def test_a_malformed_checkpoint_url_names_the_field(value: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"learner.checkpoint.directory={value}"])
    assert "learner.checkpoint.directory:" in str(info.value) and why in str(info.value)


@pytest.mark.parametrize(
    ("value", "kept"),
    [("gs://legorl-test/runs/a/", "gs://legorl-test/runs/a"), ("gs://legorl-test", "gs://legorl-test"), ("ck", "ck")],
)
def test_a_checkpoint_directory_is_kept_as_written(value: str, kept: str) -> None:
    assert load_config(None, [f"learner.checkpoint.directory={value}"]).learner.checkpoint.directory == kept


@pytest.mark.parametrize("text", ["novalue", "=3", "a..b=1"])
def test_malformed_override_rejected(text: str) -> None:
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_override_into_a_value_rejected() -> None:
    with pytest.raises(ConfigError, match="seed is a value, not a section"):
        load_config(None, ["seed.x=1"])


def test_non_mapping_yaml_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_schedule_horizon_follows_the_run_unless_set() -> None:
    config = load_config(DEFAULT_CONFIG, ["total_steps=7"])
    assert config.learner.optimizer.total_steps == 7
    pinned = load_config(DEFAULT_CONFIG, ["total_steps=7", "learner.optimizer.total_steps=50"])
    assert pinned.learner.optimizer.total_steps == 50


def test_a_dumped_config_keeps_the_horizon_following_the_run(tmp_path: Path) -> None:
    # A run's saved config.yaml, reloaded to run longer, must not keep the old run's horizon.
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(load_config(DEFAULT_CONFIG, ["total_steps=7"])))
    assert load_config(saved, ["total_steps=40"]).learner.optimizer.total_steps == 40
    saved.write_text(dump_config(load_config(DEFAULT_CONFIG, ["learner.optimizer.total_steps=50"])))
    assert load_config(saved, ["total_steps=40"]).learner.optimizer.total_steps == 50


def test_a_config_starts_from_its_base(tmp_path: Path) -> None:
    """`base: FILE` lays a file over another: mappings key by key, lists and scalars whole."""
    vllm = load_config(CONFIG_DIR / "demo_vllm.yaml")
    demo = load_config(DEFAULT_CONFIG)
    assert vllm.engine.kind == "vllm" and vllm.engine.dtype == "float32"
    assert vllm.engine.max_context == demo.engine.max_context and vllm.rl == demo.rl
    assert vllm.harness_mix == demo.harness_mix and vllm.logging.run_name == "demo_vllm"
    top = tmp_path / "top.yaml"
    top.write_text(f"base: {DEFAULT_CONFIG}\nfleet:\n  servers: [a:1]\n")
    assert load_config(top).fleet.servers == ["a:1"] and load_config(top).total_steps == demo.total_steps


@pytest.mark.parametrize(
    ("text", "message"),
    [("base: loop.yaml\n", "leads back to itself"), ("base: [a]\n", "base must be the name"),
     ("base: missing.yaml\n", "config file not found")],
)  # fmt: skip
def test_a_bad_base_is_a_config_error(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def _command_config(*argv: str) -> Config:
    """The config `legorl <argv>` runs with, parsed by the real CLI parser."""
    from legorl_jax.cli import build_parser
    from legorl_jax.commands import load_command_config

    return load_command_config(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv",
    [
        ("proxy", "--engine-url", "http://127.0.0.1:1", "--model", "m", "--admin-token", "t"),
        ("rollout-server", "--model", "m"),
    ],
)
def test_standalone_services_default_to_real_session_sizes(argv: tuple[str, ...]) -> None:
    # A Claude Code prompt is 20k+ tokens; a session of a dozen calls without a shared prefix must fit.
    config = _command_config(*argv)
    caps = config.proxy
    assert caps.max_model_calls >= 12 and caps.max_total_tokens >= 12 * 20_000
    assert caps.max_wall_s >= 1800
    demo = load_config(DEFAULT_CONFIG)
    assert config.engine.max_context != demo.engine.max_context
    assert not config.sandbox.allow_local_fallback


def test_train_and_eval_still_default_to_the_demo() -> None:
    demo = load_config(DEFAULT_CONFIG)
    for argv in (("train",), ("eval", "--model", "m"), ("config", "show")):
        config = _command_config(*argv)
        assert config.proxy == demo.proxy and config.engine.max_context == 2048, argv


def test_a_chat_teacher_engine_names_its_server_model_and_key_variable() -> None:
    teacher = ["engine.kind=anthropic", "engine.url=http://t", "engine.teacher_model=m", "engine.api_key_env=K"]
    engine = load_config(None, teacher).engine
    assert (engine.kind, engine.url, engine.teacher_model, engine.api_key_env) == ("anthropic", "http://t", "m", "K")
    with pytest.raises(ConfigError, match="kind 'openai_chat' needs url and teacher_model"):
        load_config(None, ["engine.kind=openai_chat", "engine.url=http://t"])
    with pytest.raises(ConfigError, match="teacher_model, api_key_env: settings of a chat teacher"):
        load_config(
            None, ["engine.kind=external", "engine.url=http://t", "engine.teacher_model=m", "engine.api_key_env=K"]
        )
    with pytest.raises(
        ConfigError, match="max_chunk: options of an engine this process launches, not of kind 'anthropic'"
    ):
        load_config(None, [*teacher, "engine.max_chunk=64"])
