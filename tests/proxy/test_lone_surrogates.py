"""Text cut in the middle of a character, as JS CLIs cut tool output (by
UTF-16 units): the half pair arrives as a lone surrogate escape, and each
dialect takes it as U+FFFD while the sampled turns still match by tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rollout_server.proxy.render import ChatTemplate

from .scripted_engine import ScriptedEngine
from .test_incremental_render import WIRES
from .test_openai_chat import call_text


def _js_slice(text: str, units: int) -> str:
    """`text.slice(0, units)` as JavaScript does it: by UTF-16 code units."""
    return text.encode("utf-16-le")[: 2 * units].decode("utf-16-le", "surrogatepass")


@pytest.mark.parametrize("dialect", sorted(WIRES))
def test_a_tool_result_cut_mid_character_is_replaced(
    proxy: Any, engine: ScriptedEngine, template: ChatTemplate, dialect: str
) -> None:
    wire = WIRES[dialect]
    key = proxy.new_session()["key"]
    output = _js_slice("build ok \U0001f600 done", 10)
    assert output.endswith("\ud83d")
    seen = len(engine.log.prompts)
    engine.push(*(call_text("bash", {"command": f"step {i}"}) for i in range(2)), "Done.")
    body = wire.start()
    for turn in range(3):
        raw = json.dumps(body).encode()  # JSON.stringify's form: the half pair as an escape
        assert turn == 0 or b"\\ud83d" in raw
        reply = httpx.post(
            f"{proxy.url}{wire.path}",
            content=raw,
            headers={"x-api-key": key, "content-type": "application/json"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        if turn < 2:
            cid, args = wire.call_of(reply.json())
            wire.append(body, cid, args, output)
    prompts, replies = engine.log.prompts[seen:], engine.log.replies[seen:]
    assert len(prompts) == len(replies) == 3
    for before, sampled, after in zip(prompts[:2], replies[:2], prompts[1:], strict=True):
        assert after[: len(before) + len(sampled["token_ids"])] == before + sampled["token_ids"]
    assert template.decode(prompts[-1]).count("build ok \ufffd") == 2
