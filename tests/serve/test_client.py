"""EngineClient's parsing of vLLM responses, independent of any server."""

from __future__ import annotations

import httpx
import pytest

from rollout_server.backends.client import EngineError, completion_body, parse_choice, raise_for_error


def test_token_ids_pair_with_logprobs_by_position() -> None:
    choice = {
        "text": "ab",
        "token_ids": [5, 9],
        "prompt_token_ids": [1, 2],
        "logprobs": {"token_logprobs": [-0.5, -1.5], "tokens": ["a", "b"]},
        "prompt_logprobs": [None, {"2": {"logprob": -3.0, "rank": 4}, "7": {"logprob": -0.1, "rank": 1}}],
        "finish_reason": "stop",
        "stop_reason": 9,
    }
    parsed = parse_choice(choice)
    assert parsed.token_ids == [5, 9] and parsed.logprobs == [-0.5, -1.5]
    assert parsed.prompt_logprobs == [None, -3.0]  # the prompt token's entry, not the top alternative
    assert parsed.stop_reason == 9


def test_falls_back_to_token_id_strings_when_token_ids_are_missing() -> None:
    choice = {
        "text": "",
        "token_ids": None,
        "logprobs": {"tokens": ["token_id:17", "token_id:3"], "token_logprobs": [-1.0, -2.0]},
    }
    assert parse_choice(choice).token_ids == [17, 3]


def test_choice_without_any_token_ids_is_a_protocol_error() -> None:
    with pytest.raises(EngineError, match="neither token_ids"):
        parse_choice({"text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}})
    with pytest.raises(EngineError, match="2 token ids but 1 logprobs"):
        parse_choice({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}})


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"message": "too long", "type": "BadRequestError", "param": "prompt", "code": 400}},
        {"object": "error", "message": "too long", "type": "BadRequestError", "param": "prompt", "code": 400},
    ],
)
def test_error_bodies_new_and_old_vllm_shapes(body: dict) -> None:
    with pytest.raises(EngineError) as err:
        raise_for_error(httpx.Response(400, json=body))
    assert (err.value.status, err.value.message, err.value.err_type, err.value.param) == (
        400,
        "too long",
        "BadRequestError",
        "prompt",
    )


def test_non_json_error_keeps_the_text() -> None:
    with pytest.raises(EngineError, match="bad gateway"):
        raise_for_error(httpx.Response(502, text="bad gateway"))


def test_completion_body_asks_for_ids_and_logprobs() -> None:
    body = completion_body([1, 2], "m", max_tokens=4, seed=None, stop=["\n"])
    assert body["return_token_ids"] is True and body["logprobs"] == 0
    assert "seed" not in body and body["stop"] == ["\n"]
    assert (body["temperature"], body["top_p"], body["top_k"]) == (1.0, 1.0, -1)
