"""Request-parsing helpers every dialect shares."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

from rollout_server.proxy.conversation import ToolSpec
from rollout_server.proxy.errors import expect_type, invalid

# Part types that carry plain text, across the dialects.
TEXT_PARTS = ("text", "input_text", "output_text")


def text_of(content: Any, where: str) -> str:
    """Message content -> text: a string, null, or a list of text parts
    (provider-only fields such as `cache_control` are ignored). The model
    reads text only, so an image is a clear 400 rather than silently dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    expect_type(content, list, where)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        expect_type(part, dict, f"{where}[{j}]")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text", "")
            expect_type(text, str, f"{where}[{j}].text")
            texts.append(text)
        elif kind in ("image", "image_url", "input_image", "document", "input_file", "input_audio"):
            raise invalid(f"{where}[{j}]: {kind} content is not supported; this model reads text only")
        else:
            raise invalid(f"{where}[{j}]: unknown content part type {kind!r}")
    return "".join(texts)


def each_object(raw: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The JSON objects of an optional list (`tools`, absent meaning none), each with where it
    stands for error messages."""
    if raw is None:
        return
    expect_type(raw, list, where)
    for k, item in enumerate(raw):
        at = f"{where}[{k}]"
        expect_type(item, dict, at)
        yield at, item


def tool_spec(name: Any, description: Any, parameters: Any, where: str) -> ToolSpec:
    expect_type(name, str, f"{where}.name")
    if not name:
        raise invalid(f"{where}.name: must not be empty")
    params = parameters if parameters is not None else {"type": "object", "properties": {}}
    expect_type(params, dict, f"{where}.parameters")
    desc = description if description is not None else ""
    expect_type(desc, str, f"{where}.description")
    return ToolSpec(name, desc, params)


def turns(body: Any, field: str) -> list[Any]:
    """The body's conversation (`messages`, `contents`): a list, and never an empty one, since
    there is nothing to answer; the body itself must be a JSON object."""
    expect_type(body, dict, "request body")
    value = body.get(field)
    expect_type(value, list, field)
    if not value:
        raise invalid(f"{field}: must not be empty")
    return value


def model_name(body: dict[str, Any]) -> str:
    model = body.get("model", "")
    expect_type(model, str, "model")
    return model


def optional_int(body: dict[str, Any], *names: str, within: str = "") -> int | None:
    """The first of `names` that is set, as a positive integer; `within` prefixes the field
    in the error when `body` is a nested object (`generationConfig.`)."""
    for name in names:
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise invalid(f"{within}{name}: expected a positive integer, got {value!r}")
            return value
    return None


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def now() -> int:
    return int(time.time())
