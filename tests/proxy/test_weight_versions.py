"""Per-token policy versions through the proxy into a CapturedSequence: from
the embedded engine's spans when an update lands mid-completion, and, from an
engine that reports none, the version the session believed served (counted)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from serve.pause_after import frozen_after

from legorl_jax.core.config import SamplingConfig
from rollout_server.backends.client import SyncEngineClient
from rollout_server.proxy.app import build_app
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import build_core
from rollout_server.proxy.session import SessionSpec

from .conftest import Proxy
from .scripted_engine import ServerThread

FROZEN_AT = 4
LENGTH = 16


@pytest.fixture(scope="module")
def embedded(model_dir: Path) -> Iterator[Any]:
    from legorl_jax.serve.server import EmbeddedEngine

    with EmbeddedEngine.start(model_dir, max_slots=2, max_len=128, max_chunk=32) as running:
        yield running


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("update") / "m", seed=1, tokenizer_dir=model_dir)


def _chat(url: str) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])


def test_a_completion_split_by_an_update_carries_both_versions(
    embedded: Any, model_dir: Path, template: ChatTemplate, other_weights: Path
) -> None:
    core = build_core(
        model_dir,
        embedded.url,
        served_model=embedded.served.name,
        max_context=128,
        template=template,
        unit_temperature_prompt_logprobs=False,
    )
    embedded.served.engine.set_version_label("6")
    # top_k 1: greedy, so the completion's length does not depend on chance.
    session = core.store.create(SessionSpec(policy_version=6, sampling=SamplingConfig(max_tokens=LENGTH, top_k=1)))
    engine = SyncEngineClient(embedded.url, timeout=120)
    try:
        with (
            ServerThread(build_app(core)) as proxy,
            frozen_after(embedded.served.engine, FROZEN_AT) as frozen,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            pending = pool.submit(_chat, f"{proxy.url}/s/{session.key}/v1")
            assert frozen.wait(60), "the completion never reached its pause point"
            engine.update_weights(str(other_weights), version="7")
            pending.result(timeout=60)
    finally:
        engine.update_weights(str(model_dir), version="default")
        engine.close()
    (seq,) = session.trajectory.sequences
    sampled = [v for v, m in zip(seq.token_versions, seq.loss_mask, strict=True) if m]
    assert len(sampled) > FROZEN_AT, "the completion ended before the update landed"
    assert sampled == [6] * FROZEN_AT + [7] * (len(sampled) - FROZEN_AT)
    assert all(v == -1 for v, m in zip(seq.token_versions, seq.loss_mask, strict=True) if not m)
    assert seq.unreported_versions == 0 and seq.policy_version == 6


def test_an_engine_without_versions_gives_the_believed_version_counted(proxy: Proxy) -> None:
    key = proxy.new_session(policy_version=2)["key"]
    _chat(f"{proxy.url}/s/{key}/v1")
    (seq,) = proxy.trajectory(key)["sequences"]
    sampled = [v for v, m in zip(seq["token_versions"], seq["loss_mask"], strict=True) if m]
    assert sampled and sampled == [2] * len(sampled)
    assert seq["unreported_versions"] == len(sampled)
