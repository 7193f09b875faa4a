"""The calls the proxy and rollout server make on an engine, checked on the wire.
Everything here must hold for vLLM (launched by rollout_server.backends.vllm)
and for the embedded JAX engine alike."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_server.backends.client import EngineClient, EngineError, SyncEngineClient, TokenCompletion


@pytest.fixture(scope="module")
def prompt(client: SyncEngineClient, engine_url: str) -> list[int]:
    ids = httpx.post(f"{engine_url}/tokenize", json={"model": client.model(), "prompt": "def add(a, b):\n"}).json()[
        "tokens"
    ]
    assert ids and all(isinstance(t, int) for t in ids)
    return ids


def _raw(engine_url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{engine_url}/v1/completions", json=body, timeout=300)


def test_health_and_models(engine_url: str, client: SyncEngineClient) -> None:
    assert httpx.get(f"{engine_url}/health").status_code == 200
    card = httpx.get(f"{engine_url}/v1/models").json()["data"][0]
    assert card["id"] == client.model() and card["max_model_len"] > 0


def test_tokens_in_tokens_out_with_logprobs(client: SyncEngineClient, prompt: list[int], engine_url: str) -> None:
    body = {
        "model": client.model(),
        "prompt": prompt,
        "max_tokens": 5,
        "ignore_eos": True,
        "seed": 7,
        "logprobs": 0,
        "return_token_ids": True,
        "temperature": 1.0,
    }
    data = _raw(engine_url, body).json()
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 5
    assert all(lp <= 0 and math.isfinite(lp) for lp in choice["logprobs"]["token_logprobs"])
    assert choice["finish_reason"] == "length"
    counts = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5}


def test_seed_reproduces(client: SyncEngineClient, prompt: list[int]) -> None:
    a = client.complete(prompt, max_tokens=6, seed=11, ignore_eos=True)[0]
    b = client.complete(prompt, max_tokens=6, seed=11, ignore_eos=True)[0]
    assert a.token_ids == b.token_ids


def _top(engine_url: str, model: str, prompt: list[int], temperature: float) -> dict[int, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": temperature,
        "seed": 1,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    top = _raw(engine_url, body).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.removeprefix("token_id:")): v for k, v in top.items()}


def test_logprobs_are_processed_at_the_request_temperature(
    client: SyncEngineClient, prompt: list[int], engine_url: str
) -> None:
    """Processed logprobs are log softmax(logits / T): gaps between two tokens'
    logprobs scale by 1/T. Raw logprobs would not change with T at all."""
    at_one = _top(engine_url, client.model(), prompt, 1.0)
    at_half = _top(engine_url, client.model(), prompt, 0.5)
    common = sorted(set(at_one) & set(at_half), key=lambda t: -at_one[t])
    assert len(common) >= 2
    a, b = common[0], common[-1]
    assert at_half[a] - at_half[b] == pytest.approx(2 * (at_one[a] - at_one[b]), rel=0.02, abs=1e-3)


def test_stop_token_ids_stop_and_are_returned(client: SyncEngineClient, prompt: list[int]) -> None:
    free = client.complete(prompt, max_tokens=8, seed=3, ignore_eos=True)[0].token_ids
    stop = free[3]
    stopped = client.complete(prompt, max_tokens=8, seed=3, ignore_eos=True, stop_token_ids=[stop])[0]
    assert stopped.token_ids == free[: free.index(stop) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop


def test_stream_carries_the_same_tokens(client: SyncEngineClient, prompt: list[int]) -> None:
    whole = client.complete(prompt, max_tokens=6, seed=5, ignore_eos=True)[0]

    async def streamed() -> tuple[list[int], list[float], str | None]:
        async with EngineClient(client.base_url, timeout=300) as aclient:
            ids: list[int] = []
            logprobs: list[float] = []
            finish = None
            async for chunk in aclient.stream(prompt, max_tokens=6, seed=5, ignore_eos=True):
                for choice in chunk["choices"]:
                    ids += choice.get("token_ids") or []
                    logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
                    finish = choice.get("finish_reason") or finish
            return ids, logprobs, finish

    ids, logprobs, finish = asyncio.run(streamed())
    assert ids == whole.token_ids and finish == "length"
    assert logprobs == pytest.approx(whole.logprobs, abs=1e-5)


def test_prompt_over_the_context_is_a_400(client: SyncEngineClient, engine_url: str) -> None:
    limit = httpx.get(f"{engine_url}/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(EngineError) as err:
        client.complete([5] * (limit + 10), max_tokens=1)
    assert err.value.status == 400 and err.value.message
    assert client.complete([5, 6], max_tokens=1)[0].token_ids  # still serving


@pytest.mark.parametrize("empty", ["", []])
def test_empty_prompt_is_a_400(client: SyncEngineClient, engine_url: str, empty: str | list[int]) -> None:
    reply = _raw(engine_url, {"model": client.model(), "prompt": empty, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["message"]
    assert client.complete([5, 6], max_tokens=1)[0].token_ids  # still serving


def test_tokenize_renders_the_chat_template(engine_url: str, client: SyncEngineClient) -> None:
    async def tokenize() -> list[int]:
        async with EngineClient(engine_url) as aclient:
            return await aclient.tokenize(messages=[{"role": "user", "content": "Say hi."}], add_generation_prompt=True)

    tokens = asyncio.run(tokenize())
    assert len(tokens) > 3
    text = httpx.post(f"{engine_url}/detokenize", json={"model": client.model(), "tokens": tokens}).json()
    assert "Say hi." in text["prompt"]


def test_many_concurrent_requests_all_finish(client: SyncEngineClient, prompt: list[int]) -> None:
    async def run_all() -> list[int]:
        async with EngineClient(client.base_url, timeout=300) as aclient:
            jobs = [aclient.complete(prompt, max_tokens=2 + i % 5, seed=i, ignore_eos=True) for i in range(24)]
            return [len(c[0].token_ids) for c in await asyncio.gather(*jobs)]

    assert asyncio.run(run_all()) == [2 + i % 5 for i in range(24)]


def _reference_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    """log p(ids[1:]) under the checkpoint at `model_dir`, by transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])
    return [float(x) for x in picked[:, 0]]


def test_weight_reload_sequence(
    client: SyncEngineClient, prompt: list[int], reload_path: str, engine_url: str, real_model: bool
) -> None:
    before = client.complete(prompt, max_tokens=4, seed=2, ignore_eos=True)[0]

    async def update() -> dict[str, Any]:
        reload_method = client.async_client.reload_method
        async with EngineClient(engine_url, timeout=300, watch=client.watch, reload_method=reload_method) as aclient:
            return await aclient.update_weights(reload_path)

    result = asyncio.run(update())
    assert isinstance(result.get("results"), list)
    rescored = client.complete(prompt + before.token_ids[:1], max_tokens=1, seed=2, prompt_logprobs=0)[0]
    assert rescored.prompt_logprobs is not None
    # The first token sampled before the reload, rescored after it (T = 1, where
    # prompt and sampled logprobs agree), has a different logprob: new weights.
    assert abs(rescored.prompt_logprobs[-1] - before.logprobs[0]) > 1e-3
    if real_model:
        # And they are the reloaded checkpoint's: transformers computes the same logprobs from its files.
        reference = _reference_logprobs(reload_path, prompt + before.token_ids[:1])
        assert rescored.prompt_logprobs[1:] == pytest.approx(reference, abs=2e-3)
    entry = result["results"][0]
    if isinstance(entry, dict) and "weight_version" in entry:  # the embedded engine reports versions
        assert entry["weight_version"] >= 1
        assert json.loads(httpx.get(f"{engine_url}/is_paused").text)["is_paused"] is False


def test_tokens_carry_the_weights_label(client: SyncEngineClient, prompt: list[int], engine_url: str) -> None:
    """vLLM 0.33's per-token weight versions: POST /update_weight_version labels the weights,
    and a completion asked for `return_weight_versions` gets spans of that label."""
    labelled = httpx.post(f"{engine_url}/update_weight_version", json={"new_version": "12"})
    if labelled.status_code == 404:
        pytest.skip("this engine predates vLLM 0.33: no per-token weight versions")
    assert labelled.json()["success"] is True
    choice = client.complete(prompt, max_tokens=4, ignore_eos=True, return_weight_versions=True)[0]
    assert choice.weight_versions == [("12", 0, 4)]


def test_an_update_mid_completion_labels_each_token_with_its_weights(
    client: SyncEngineClient, prompt: list[int], reload_path: str, engine_url: str, real_model: bool
) -> None:
    """The update protocol with a completion in flight (keep mode): it finishes, its
    first tokens carry the old label and the rest the new one, as one split.

    On a 2-core machine the engine's decode loop can starve the update (or this
    process) for seconds, so the pause may reach the engine only after the
    completion ended: all its tokens then carry the old label. Or the completion's
    request is the one starved, and the update lands before its first step: all
    carry the new label. Such a try proves nothing, and a few are allowed; when
    every try is such, the test is inconclusive and says so (a skip, seen once in CI
    on a fresh vLLM: three tries of ~2 s completions). Any other labels fail: a
    split elsewhere, or more than one.
    The split itself is also held by tests/serve/test_vllm_update.py (the stand-in,
    slowed) and tests/rollout/test_vllm_host.py (an update mid-trial)."""
    if not real_model:
        pytest.skip("the stand-in decodes at once unless slowed: tests/serve/test_vllm_update.py splits one slowed")
    if httpx.post(f"{engine_url}/update_weight_version", json={"new_version": "20"}).status_code == 404:
        pytest.skip("this engine predates vLLM 0.33: no per-token weight versions")
    own = client.async_client
    budget = 1000 - len(prompt)

    async def attempt(old: str, new: str) -> TokenCompletion:
        async with EngineClient(
            engine_url, timeout=300, watch=client.watch, reload_method=own.reload_method, token_route=own.token_route
        ) as aclient:
            await aclient.label_weights(old)
            await aclient.model()  # asked now, so the completion's request goes out at once
            running = asyncio.create_task(
                aclient.complete(prompt, max_tokens=budget, seed=9, ignore_eos=True, return_weight_versions=True)
            )
            # Early: a warm vLLM decodes this model's ~1,000 tokens in about two seconds here.
            await asyncio.sleep(0.08)
            await aclient.update_weights(reload_path, "keep", version=new)
            return (await running)[0]

    tries = []
    for n in range(3):
        old, new = str(20 + 2 * n), str(21 + 2 * n)
        choice = asyncio.run(attempt(old, new))
        assert choice.weight_versions is not None and len(choice.token_ids) == budget
        labels = [label for label, _, _ in choice.weight_versions]
        tries.append(labels)
        if labels == [old, new]:
            return
        assert labels in ([old], [new]), f"an update mid-completion gave the labels {labels}, not [{old}, {new}]"
    pytest.skip(f"inconclusive: the update missed the completion's decode in all {len(tries)} tries: {tries}")


def test_chat_rendering_is_the_proxys(engine_url: str, client: SyncEngineClient) -> None:
    """An engine that renders chat requests (vLLM's /v1/chat/completions/render, served
    with --enable-scale-out) gives the prompt ids the proxy renders from the served
    model's chat template: tools, a tool call and its result, thinking on."""
    from transformers import AutoTokenizer

    from rollout_server.proxy.conversation import ChatRequest, Message, ToolCall, ToolSpec
    from rollout_server.proxy.render import ChatTemplate

    params = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}
    body = {
        "model": client.model(),
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.py"},
            {"role": "user", "content": "Now fix b.py."},
        ],
        "tools": [
            {"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": params}}
        ],
        # "none": rendering only; "auto" would ask for a tool-call parser the launch does not name.
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    reply = httpx.post(f"{engine_url}/v1/chat/completions/render", json=body, timeout=120)
    if reply.status_code == 404:
        pytest.skip("this engine renders no chat requests")
    if not Path(client.model()).is_dir():
        pytest.skip("the served name is not a model directory here: no chat template to compare with")
    template = ChatTemplate(AutoTokenizer.from_pretrained(client.model()))
    request = ChatRequest(
        [
            Message("system", "You are a coding agent."),
            Message("user", "List the files."),
            Message("assistant", tool_calls=[ToolCall("c1", "bash", {"command": "ls -la"})]),
            Message("tool", "a.txt\nb.py", tool_call_id="c1"),
            Message("user", "Now fix b.py."),
        ],
        tools=[ToolSpec("bash", "Run a command", params)],
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["token_ids"] == template.render(request, {}, True).ids
