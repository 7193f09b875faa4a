"""The embedded engine over HTTP: vLLM's completion shapes, logprob parity
with the learner's `token_logprobs`, continuous batching, stops, errors."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

PROMPT = [11, 42, 7, 300, 15, 99, 260]


def post(engine: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps, not httpx's json=: it writes NaN and Infinity, as a careless client might.
    return httpx.post(
        engine.url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120
    )


def complete(engine: Any, **body: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 8, "return_token_ids": True, "logprobs": 0, **body}
    response = post(engine, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_logprobs_equal_learner_token_logprobs_at_the_same_temperature(engine: Any, tiny_model_dir: Path) -> None:
    from legorl_jax.models import from_hf, token_logprobs

    temperature = 0.7
    choice = complete(engine, max_tokens=12, temperature=temperature, seed=3, prompt_logprobs=0)
    assert choice["prompt_token_ids"] == PROMPT
    ids = PROMPT + choice["token_ids"]
    reference = np.asarray(token_logprobs(from_hf(tiny_model_dir), jnp.array([ids]), temperature=temperature))[0]
    engine_completion = np.array(choice["logprobs"]["token_logprobs"])
    np.testing.assert_allclose(engine_completion, reference[len(PROMPT) - 1 :], atol=1e-4, rtol=0)
    prompt_lp = [next(iter(e.values()))["logprob"] for e in choice["prompt_logprobs"][1:]]
    np.testing.assert_allclose(prompt_lp, reference[: len(PROMPT) - 1], atol=1e-4, rtol=0)
    assert choice["prompt_logprobs"][0] is None
    assert [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]] == PROMPT[1:]


def test_prompt_logprobs_list_the_prompt_token_and_top_alternatives(engine: Any) -> None:
    entries = complete(engine, max_tokens=1, prompt_logprobs=3)["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    for token, entry in zip(PROMPT[1:], entries[1:], strict=True):
        assert str(token) in entry and 3 <= len(entry) <= 4
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert {1, 2, 3} <= {v["rank"] for v in ranked} and len({v["rank"] for v in ranked}) == len(ranked)
        assert [v["logprob"] for v in ranked] == sorted((v["logprob"] for v in ranked), reverse=True)


def _metric(engine: Any, name: str) -> float:
    text = httpx.get(engine.url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
    assert lines, f"{name} missing from /metrics"
    return float(lines[0].rsplit(" ", 1)[1])


def test_concurrent_requests_share_steps_and_match_solo_runs(engine: Any) -> None:
    requests = [
        {"prompt": PROMPT[: 2 + i % 6] + [i + 20], "max_tokens": 3 + (i * 5) % 13, "seed": 100 + i, "temperature": 1.0}
        for i in range(10)
    ]
    steps_before = _metric(engine, "legorl:engine_steps_total")
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: complete(engine, **r), requests))
    steps_together = _metric(engine, "legorl:engine_steps_total") - steps_before
    alone = [complete(engine, **r) for r in requests]
    generated = sum(len(c["token_ids"]) for c in together)
    # Decoding sequentially would take at least one step per generated token.
    assert steps_together < generated
    for solo, batched, req in zip(alone, together, requests, strict=True):
        assert len(batched["token_ids"]) == req["max_tokens"]
        assert batched["finish_reason"] == "length"
        assert batched["token_ids"] == solo["token_ids"]
        np.testing.assert_allclose(batched["logprobs"]["token_logprobs"], solo["logprobs"]["token_logprobs"], atol=1e-4)


def test_seed_reproduces_and_top_logprobs_hold_the_sampled_token(engine: Any) -> None:
    # Token ids as keys: decoded strings of different byte tokens can collide.
    a = complete(engine, seed=5, logprobs=3, return_tokens_as_token_ids=True)
    b = complete(engine, seed=5, logprobs=3, return_tokens_as_token_ids=True)
    assert a["token_ids"] == b["token_ids"]
    block = a["logprobs"]
    assert len(block["tokens"]) == len(block["token_logprobs"]) == len(block["text_offset"]) == len(a["token_ids"])
    for token, logprob, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"], strict=True):
        assert 3 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) >= logprob
    assert block["text_offset"] == sorted(block["text_offset"])


def test_tokens_as_token_ids_or_text(engine: Any) -> None:
    as_ids = complete(engine, seed=5, return_tokens_as_token_ids=True)
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in as_ids["token_ids"]]
    as_text = complete(engine, seed=5, max_tokens=40, ignore_eos=True)
    assert as_text["token_ids"][:8] == as_ids["token_ids"]
    assert as_text["text"] == engine.served.tokenizer.decode(as_text["token_ids"], skip_special_tokens=True)
    assert as_text["logprobs"]["tokens"] == [engine.served.tokenizer.decode([t]) for t in as_text["token_ids"]]


def test_stop_token_id_ends_the_completion_and_stays_in_token_ids(engine: Any) -> None:
    free = complete(engine, seed=9, max_tokens=10)["token_ids"]
    stop = free[4]
    cut = free.index(stop)
    stopped = complete(engine, seed=9, max_tokens=10, stop_token_ids=[stop])
    assert stopped["token_ids"] == free[: cut + 1]
    assert stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == stop


def test_stop_string_truncates_text(engine: Any) -> None:
    free = complete(engine, seed=9, max_tokens=10)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    at = text.index(stop)
    stopped = complete(engine, seed=9, max_tokens=10, stop=[stop])
    assert stopped["text"] == text[:at]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["token_ids"] == free["token_ids"][: len(stopped["token_ids"])]
    kept = complete(engine, seed=9, max_tokens=10, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == text[: at + len(stop)]


def test_text_prompt_is_tokenized(engine: Any) -> None:
    ids = post(engine, "/tokenize", {"prompt": "def main():"}).json()["tokens"]
    by_text = complete(engine, prompt="def main():", seed=1)
    assert by_text["prompt_token_ids"] == ids
    assert by_text["token_ids"] == complete(engine, prompt=ids, seed=1)["token_ids"]


def test_a_lone_surrogate_in_text_reads_as_a_replacement_character(engine: Any) -> None:
    """A JS client cutting text by UTF-16 units sends half a pair (json.dumps escapes it as such a client does)."""
    expected = post(engine, "/tokenize", {"prompt": "cut \ufffd"}).json()["tokens"]
    assert post(engine, "/tokenize", {"prompt": "cut \ud83d"}).json()["tokens"] == expected
    assert complete(engine, prompt="cut \ud83d", seed=1)["prompt_token_ids"] == expected
    assert complete(engine, prompt=["cut \ud83d"], seed=1)["prompt_token_ids"] == expected

    def chat(text: str) -> httpx.Response:
        return post(engine, "/tokenize", {"messages": [{"role": "user", "content": text}]})

    messages = chat("cut \udc00")
    assert messages.status_code == 200, messages.text
    assert messages.json()["tokens"] == chat("cut \ufffd").json()["tokens"]


def test_n_and_batched_prompts_index_choices(engine: Any) -> None:
    body = {"prompt": [PROMPT, PROMPT[:3]], "n": 2, "max_tokens": 2, "seed": 1, "return_token_ids": True}
    data = post(engine, "/v1/completions", body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["choices"][2]["prompt_token_ids"] == PROMPT[:3]
    assert data["usage"] == {"prompt_tokens": 2 * 7 + 2 * 3, "completion_tokens": 8, "total_tokens": 28}


def _stream(engine: Any, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", engine.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_stream_concatenates_to_the_whole_response(engine: Any, stop: list[str] | None) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "seed": 4, "return_token_ids": True, "logprobs": 0, "stop": stop}
    whole = complete(engine, **body)
    events = _stream(engine, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == len(whole["token_ids"])
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert choices[0]["prompt_token_ids"] == PROMPT
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert sum((c["token_ids"] for c in choices), []) == whole["token_ids"]
    assert sum((c["logprobs"]["token_logprobs"] for c in choices), []) == whole["logprobs"]["token_logprobs"]
    assert choices[-1]["finish_reason"] == whole["finish_reason"]
    assert all(c["finish_reason"] is None for c in choices[:-1])


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_prompt_longer_than_context_is_a_400(engine: Any) -> None:
    err = _error(post(engine, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 1}), 400)
    assert "maximum context length is 96" in err["message"]
    err = _error(post(engine, "/v1/completions", {"prompt": [5] * 90, "max_tokens": 10}), 400)
    assert "100 tokens" in err["message"]
    # The engine still serves after rejecting.
    assert complete(engine, max_tokens=1, ignore_eos=True)["finish_reason"] == "length"


def test_max_tokens_default_fills_the_context(engine: Any) -> None:
    choice = complete(engine, prompt=[5] * 90, max_tokens=None, seed=2, ignore_eos=True)
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "top_k": 0}, "top_k"),
        ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": [-3]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [""]}, "prompt"),
        ({"prompt": [PROMPT] * 300}, "prompt"),
        ({"prompt": PROMPT, "top_k": 2**31}, "top_k"),
        ({"prompt": PROMPT, "top_k": -2}, "top_k"),
        ({"prompt": PROMPT, "top_p": float("nan")}, "top_p"),
        ({"prompt": PROMPT, "temperature": float("inf")}, "temperature"),
        ({"prompt": PROMPT, "temperature": 1e30}, "temperature"),
        ({"prompt": PROMPT, "max_tokens": 2**31}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "n": 65}, "n"),
        ({"prompt": PROMPT, "min_tokens": 2**31}, "min_tokens"),
        ({"prompt": PROMPT, "seed": 2**64}, "seed"),
        ({"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": PROMPT, "stop": ["x"] * 100}, "stop"),
        ({"prompt": PROMPT, "stop": "x" * 5000}, "stop"),
        ({"prompt": PROMPT, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": PROMPT, "stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"prompt": PROMPT, "stop_token_ids": list(range(5000))}, "stop_token_ids"),
    ],
)
def test_bad_requests_get_vllm_shaped_400s(engine: Any, body: dict[str, Any], param: str) -> None:
    assert _error(post(engine, "/v1/completions", body), 400)["param"] == param
    assert complete(engine, max_tokens=1, ignore_eos=True)["finish_reason"] == "length"  # still serving


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [2**40]}, "tokens"),
        ("/collective_rpc", {"method": "reload_weights", "timeout": float("inf")}, "timeout"),
    ],
)
def test_bad_numbers_of_other_routes_are_400s(engine: Any, path: str, body: dict[str, Any], param: str) -> None:
    assert _error(post(engine, path, body), 400)["param"] == param


def test_unknown_model_is_404(engine: Any) -> None:
    _error(post(engine, "/v1/completions", {"prompt": PROMPT, "model": "nope"}), 404)


def test_models_and_health(engine: Any) -> None:
    assert httpx.get(engine.url + "/health").status_code == 200
    card = httpx.get(engine.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 96 and card["id"] == engine.served.name


def test_tokenize_messages_uses_the_chat_template(engine: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    data = post(engine, "/tokenize", {"messages": messages, "add_generation_prompt": True}).json()
    expected = engine.served.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert data["tokens"] == list(expected) and data["count"] == len(expected)
    rendered = engine.served.tokenizer.decode(data["tokens"])
    assert rendered.endswith("<|im_start|>assistant\n") and "hi there" in rendered
    _error(post(engine, "/tokenize", {"prompt": "a", "messages": messages}), 400)


class FailingOnce:
    """TEST INSTRUMENT: wraps a function of the engine's step and raises on its first call."""

    def __init__(self, step: Any) -> None:
        self.step, self.failed = step, False

    def __call__(self, *args: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected step failure")
        return self.step(*args)


def test_a_failed_step_fails_its_requests_and_the_engine_recovers(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.served.engine, "_step", FailingOnce(engine.served.engine._step))
    err = _error(post(engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}), 500)
    assert "injected step failure" in err["message"]
    assert len(complete(engine, max_tokens=3, ignore_eos=True)["token_ids"]) == 3


def test_a_fault_packing_a_step_fails_only_that_steps_requests(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-side work of a step (packing its inputs) fails like the device step:
    the requests in that step get an error; those still waiting and the loop go on."""
    from legorl_jax.serve import engine as engine_module

    core = engine.served.engine
    slots = core.stats()["slots"]
    body = {"prompt": PROMPT, "max_tokens": 3}
    core.pause("keep")  # every request queues first, so the first step takes exactly `slots` of them
    try:
        with concurrent.futures.ThreadPoolExecutor(slots + 2) as pool:
            replies = [pool.submit(post, engine, "/v1/completions", body) for _ in range(slots + 2)]
            deadline = time.monotonic() + 60
            while core.stats()["waiting"] < slots + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            monkeypatch.setattr(engine_module, "build_inputs", FailingOnce(engine_module.build_inputs))
            core.resume()
            replies = [r.result() for r in replies]
    finally:
        core.resume()
    failed = [r for r in replies if r.status_code != 200]
    assert len(failed) == slots and all("injected step failure" in _error(r, 500)["message"] for r in failed)
    assert len(complete(engine, max_tokens=3, ignore_eos=True)["token_ids"]) == 3
    assert httpx.get(engine.url + "/health").status_code == 200


class Fatal(BaseException):
    """TEST INSTRUMENT: what no step handler catches, so the engine loop dies."""


def test_a_dead_engine_loop_fails_requests_and_health(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from legorl_jax.serve.server import EmbeddedEngine

    with EmbeddedEngine.start(tiny_model_dir, max_slots=4, max_len=32, max_chunk=8) as running:

        def fatal(*args: Any) -> Any:
            raise Fatal("injected loop death")

        monkeypatch.setattr(running.served.engine, "_step", fatal)
        body = {"prompt": PROMPT, "max_tokens": 3}
        assert "injected loop death" in _error(post(running, "/v1/completions", body), 500)["message"]
        assert httpx.get(running.url + "/health").status_code == 503
        assert "not running" in _error(post(running, "/v1/completions", body), 503)["message"]


def test_openai_sdk_reads_completions_and_streams(engine: Any) -> None:
    from openai import OpenAI

    sdk = OpenAI(base_url=engine.url + "/v1", api_key="unused")
    model = engine.served.name
    whole = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, seed=8, logprobs=1, extra_body={"return_token_ids": True}
    )
    assert whole.choices[0].logprobs is not None and len(whole.choices[0].logprobs.token_logprobs) == 4
    assert whole.choices[0].model_extra["token_ids"] == complete(engine, max_tokens=4, seed=8)["token_ids"]
    text = "".join(
        c.choices[0].text for c in sdk.completions.create(model=model, prompt=PROMPT, max_tokens=4, seed=8, stream=True)
    )
    assert text == whole.choices[0].text
