"""A GCS emulator for the tests: gcp-storage-emulator (`gcs_emulator.py`) in a subprocess on a loopback port,
and the environment that points tensorstore's gcs driver and gcsfs at it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import gcsfs
import pytest

BUCKET = "legorl-test"
# A dead emulator fails a request at once; tensorstore's default retries would back off for minutes.
FAST_FAILING = {"gcs_request_retries": {"max_retries": 2, "initial_delay": "10ms", "max_delay": "50ms"}}


class Emulator:
    """One gcp-storage-emulator subprocess serving `BUCKET` on a free loopback port (in memory, or in
    `data_dir`, which outlives a restart)."""

    def __init__(self, data_dir: Path | None = None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = [sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), str(self.port), BUCKET]
        self._args += [str(data_dir)] if data_dir else []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url, timeout=1) as reply:  # the emulator's health check
                    if reply.read() == b"OK":
                        return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the GCS emulator did not come up on {self.url}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def point_at(emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Points tensorstore's gcs driver and gcsfs (etils.epath's gs:// backend, which Orbax lists and
    commits checkpoints through) at `emu`."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", emu.url)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    # fsspec caches one GCSFileSystem per set of arguments, which would keep an earlier test's endpoint.
    gcsfs.GCSFileSystem.clear_instance_cache()
