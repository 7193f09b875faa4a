"""Secrets kept out of every log line, at every level.

A proxy session's key travels in its URL path (`/s/<key>/v1/...`) and in API
key headers; admin and gRPC tokens travel as `Bearer` credentials. httpx logs
each request line at INFO, uvicorn its access lines, and an exception's text
often quotes a URL. `install` wraps the log record factory, so every record
is scrubbed when it is made, whichever logger made it and whichever handler
(added before or after) writes it: the message, its arguments (as the text
they format to), a traceback and a stack.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

REDACTED = "<redacted>"

_PATTERNS = [
    (re.compile(r"(?i)(\bbearer\s+)[^\s'\",;]+"), rf"\1{REDACTED}"),
    (re.compile(r"(/s/)[^/\s'\"?#]+"), rf"\1{REDACTED}"),
    (re.compile(r"(?i)([?&](?:key|api[-_]?key|token|access_token)=)[^&\s'\"#]+"), rf"\1{REDACTED}"),
    (
        re.compile(r"(?i)((?:x-api-key|x-goog-api-key|api[-_]key|authorization)['\"]?\s*[:=,]\s*b?['\"]?)[^\s'\",]+"),
        rf"\1{REDACTED}",
    ),
]
# Shorter secrets would blank out ordinary words of every line.
_MIN_SECRET_LEN = 6

_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()
_installed = False


def redact(text: str) -> str:
    """`text` with every secret in it replaced."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    for secret in _secrets:
        text = text.replace(secret, REDACTED)
    return text


def add_secret(secret: str | None) -> None:
    """Redact `secret` wherever it appears, not only where the patterns find it
    (a token is a token in a config dump too)."""
    global _secrets
    if secret and len(secret) >= _MIN_SECRET_LEN:
        with _lock:
            _secrets = _secrets | {secret}


def _scrubbed(value: Any) -> Any:
    """`value`, or the text it formats to with secrets replaced when it holds one."""
    if isinstance(value, int | float | bool) or value is None:
        return value
    try:
        text = str(value)
    except Exception:  # an object that cannot print: the handler reports it as it would have
        return value
    clean = redact(text)
    return value if clean == text else clean


def _scrub(record: logging.LogRecord) -> None:
    # Arguments one by one first, so formatters that read them (uvicorn's access
    # lines) still find them; then the whole line, for a secret that only the
    # message and its arguments together spell ("key=%s").
    if isinstance(record.args, tuple):
        record.args = tuple(_scrubbed(a) for a in record.args)
    elif isinstance(record.args, dict):
        record.args = {k: _scrubbed(v) for k, v in record.args.items()}
    try:
        message = record.getMessage()
    except Exception:  # arguments that do not fit the message: the handler reports it as it would have
        message = None
    if message is not None:
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def install() -> None:
    """Scrub every log record made in this process from now on (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        make = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            _scrub(record)
            return record

        logging.setLogRecordFactory(factory)


def configure(level: int, fmt: str = "%(asctime)s %(name)s %(levelname)s %(message)s") -> None:
    """The commands' logging: `logging.basicConfig` with secrets scrubbed."""
    install()
    # force: importing orbax installs a root handler at WARNING, which would make basicConfig do nothing.
    logging.basicConfig(level=level, format=fmt, force=True)
