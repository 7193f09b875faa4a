"""Per-token weight versions on the embedded engine: an update that lands
mid-completion (keep mode) labels the tokens before it with the old policy
version and the tokens after it with the new one, in vLLM 0.33's
`weight_versions` spans. The update is made to land after an exact token by
pausing from the request's own sink (the engine loop's thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from legorl_jax.serve.request_types import Event, FinishEvent, GenRequest, SamplingParams, TokenEvent
from rollout_server.backends.client import EngineClient, EngineError, SyncEngineClient, parse_choice
from rollout_server.proxy.engine_client import token_versions

from .pause_after import frozen_after
from .test_reload import PROMPT, reference_logprobs

FROZEN_AT = 5  # tokens sampled before the update lands
LENGTH = 20


@pytest.fixture
def restore(engine: Any, tiny_model_dir: Path) -> Iterator[None]:
    """Puts the original weights and label back for the other tests of the module."""
    yield
    engine.served.reload(tiny_model_dir)
    engine.served.engine.set_version_label("default")


def test_tokens_after_an_update_carry_the_new_version(
    engine: Any, tiny_model_dir: Path, other_weights_dir: Path, restore: None
) -> None:
    core = engine.served.engine
    core.set_version_label("3")
    events: queue.Queue[Event] = queue.Queue()
    with frozen_after(core, FROZEN_AT) as frozen:
        params = SamplingParams(max_tokens=LENGTH, seed=7, ignore_eos=True)
        core.submit(GenRequest("versions-engine", list(PROMPT), params, events.put))
        assert frozen.wait(60), "the request never reached its pause point"
        engine.served.reload(other_weights_dir)
        core.set_version_label("4")
        core.resume()
        tokens: list[TokenEvent] = []
        while not isinstance(event := events.get(timeout=60), FinishEvent):
            assert isinstance(event, TokenEvent), event
            tokens.append(event)
    assert [t.version for t in tokens] == ["3"] * FROZEN_AT + ["4"] * (LENGTH - FROZEN_AT)
    ids = [t.token for t in tokens]
    logprobs = np.array([t.logprob for t in tokens])
    old = reference_logprobs(tiny_model_dir, PROMPT + ids)[len(PROMPT) - 1 :]
    new = reference_logprobs(other_weights_dir, PROMPT + ids)[len(PROMPT) - 1 :]
    # Each token's version is the policy whose logprob it carries (new ones from fresh K/V).
    np.testing.assert_allclose(logprobs[:FROZEN_AT], old[:FROZEN_AT], atol=1e-4)
    np.testing.assert_allclose(logprobs[FROZEN_AT:], new[FROZEN_AT:], atol=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_the_update_protocol_labels_spans_of_a_completion_in_flight(
    engine: Any, other_weights_dir: Path, restore: None, stream: bool
) -> None:
    """pause keep → reload → reset → label → resume through the client; the choice's
    spans (on the last chunk when streamed) split at the token the update landed on."""
    client = SyncEngineClient(engine.url, timeout=120)
    body = {"max_tokens": LENGTH, "seed": 3, "ignore_eos": True, "return_weight_versions": True}
    try:
        engine.served.engine.set_version_label("8")
        with (
            frozen_after(engine.served.engine, FROZEN_AT) as frozen,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            pending = pool.submit(asyncio.run, _complete(engine.url, body, stream))
            assert frozen.wait(60), "the request never reached its pause point"
            client.update_weights(str(other_weights_dir), version="9")
            ids, spans = pending.result(timeout=60)
    finally:
        client.close()
    assert len(ids) == LENGTH
    assert spans == [
        {"version": "8", "start": 0, "end": FROZEN_AT},
        {"version": "9", "start": FROZEN_AT, "end": LENGTH},
    ]


async def _complete(url: str, body: dict[str, Any], stream: bool) -> tuple[list[int], list[dict[str, Any]] | None]:
    async with EngineClient(url, timeout=120) as client:
        if not stream:
            choice = (await client.complete(list(PROMPT), **body))[0]
            spans = [{"version": v, "start": a, "end": b} for v, a, b in choice.weight_versions or []]
            return choice.token_ids, spans
        ids: list[int] = []
        last: dict[str, Any] = {}
        async for chunk in client.stream(list(PROMPT), **body):
            last = chunk["choices"][0]
            ids += last["token_ids"]
            if last["finish_reason"] is None:
                assert last["weight_versions"] is None  # only the last chunk carries the spans
        return ids, last["weight_versions"]


def test_spans_are_only_sent_when_asked_for(engine: Any) -> None:
    client = SyncEngineClient(engine.url, timeout=120)
    try:
        # ignore_eos: a random model may sample its end token early, and the span must cover exactly 3.
        assert client.complete(list(PROMPT), max_tokens=3, ignore_eos=True)[0].weight_versions is None
        asked = client.complete(list(PROMPT), max_tokens=3, ignore_eos=True, return_weight_versions=True)[0]
    finally:
        client.close()
    assert asked.weight_versions == [("default", 0, 3)]


def test_spans_that_do_not_cover_the_tokens_break_the_contract() -> None:
    choice = {"token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-1.0] * 3}}
    ok = parse_choice(
        {**choice, "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]}
    )
    assert ok.weight_versions == [("2", 0, 1), ("3", 1, 3)]
    assert token_versions(ok.weight_versions) == (2, 3, 3)
    assert token_versions([("default", 0, 3)]) is None  # never labelled with a policy version
    for spans in ([{"version": "2", "start": 0, "end": 2}], [{"version": "2", "start": 1, "end": 3}], [{"start": 0}]):
        with pytest.raises(EngineError, match="weight_versions"):
            parse_choice({**choice, "weight_versions": spans})
