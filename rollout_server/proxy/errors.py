"""Proxy errors, independent of wire dialect; each dialect renders them in its
provider's own error shape so harnesses react as they would to the provider
(compact on "prompt too long", stop on a bad request, retry on 503)."""

from __future__ import annotations

from typing import Literal, TypeVar, overload

T = TypeVar("T")

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "not_found",
    "prompt_too_long",
    "cap_exceeded",
    "engine_unavailable",
]

STATUS: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "not_found": 404,
    "prompt_too_long": 400,
    # A cap ends the episode: a 4xx the SDKs do not retry.
    "cap_exceeded": 400,
    "engine_unavailable": 503,
}


class ProxyError(Exception):
    def __init__(self, kind: ErrorKind, message: str, *, prompt_tokens: int = 0, max_context: int = 0) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context

    @property
    def status(self) -> int:
        return STATUS[self.kind]


def invalid(message: str) -> ProxyError:
    return ProxyError("invalid_request", message)


@overload
def expect_type(value: object, kind: type[T], where: str) -> T: ...
@overload
def expect_type(value: object, kind: tuple[type, ...], where: str) -> object: ...
def expect_type(value: object, kind: type | tuple[type, ...], where: str) -> object:
    """Type check for a request field, raising a 400 that names the field;
    returns the value, typed as checked."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise invalid(f"{where}: expected {names}, got {type(value).__name__}")
    return value
