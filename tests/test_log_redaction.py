"""Log records are scrubbed of secrets when they are made: in the message, in
its arguments (httpx's URL objects, uvicorn's access fields), in tracebacks."""

from __future__ import annotations

import logging

import httpx
import pytest
from uvicorn.logging import AccessFormatter

from legorl_jax.core import log_redaction

KEY = "lr-Zq8sessionkey0123456789"
ADMIN = "admin-token-0123456789"


def test_secrets_never_reach_a_formatted_line(caplog: pytest.LogCaptureFixture) -> None:
    log_redaction.install()
    log_redaction.add_secret(ADMIN)
    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("legorl.test.redaction")
    log.info('HTTP Request: %s %s "%s"', "POST", httpx.URL(f"http://h:1/s/{KEY}/v1/messages"), "HTTP/1.1 200 OK")
    log.debug("headers: %s", {"authorization": f"Bearer {ADMIN}", "x-api-key": KEY})
    log.debug("gemini call /v1beta/models/m:generateContent?alt=sse&key=%s", KEY)
    log.warning("config dump: admin_token=%r", ADMIN)
    try:
        raise httpx.HTTPError(f"failed for url 'http://h:1/s/{KEY}/v1/chat/completions'")
    except httpx.HTTPError:
        log.exception("call failed")
    access = logging.getLogger("uvicorn.access").makeRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("1.2.3.4:5", "POST", f"/s/{KEY}/v1/messages", "1.1", 200), None,
    )  # fmt: skip
    lines = caplog.text + AccessFormatter(use_colors=False).format(access)
    assert KEY not in lines and ADMIN not in lines
    assert lines.count("<redacted>") >= 7 and "/s/<redacted>/v1/messages" in lines
