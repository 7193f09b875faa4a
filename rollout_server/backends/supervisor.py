"""Runs an inference-server process, waits for its /health, and restarts it
when it dies. Used for `vllm serve` on GPU hosts and `legorl serve` on CPUs.
A restart asks `replan` for its command, so it can serve the weights installed
since the first start rather than the ones the first command named.

The process gets its own session (process group) because vLLM forks engine and
worker processes: stopping must take the whole group down, not just the parent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import httpx

from legorl_jax.core.errors import InputError

log = logging.getLogger(__name__)

State = Literal["stopped", "starting", "healthy", "restarting", "failed"]


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to (re)start one engine process."""

    command: list[str]
    env: dict[str, str]
    url: str


# Runs the engine's command so that the engine gets SIGTERM when this process dies.
_DIE_WITH_PARENT = str(Path(__file__).with_name("die_with_parent.py"))


class EngineStartError(RuntimeError, InputError):
    """The engine process exited, or never became healthy."""


class ProcessSupervisor:
    def __init__(
        self,
        plan: LaunchPlan,
        *,
        log_path: Path | None = None,
        health_timeout: float = 900.0,
        max_restarts: int = 3,
        replan: Callable[[], LaunchPlan] | None = None,
        after_restart: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        self.replan = replan
        self.after_restart = after_restart  # run once a restarted process is healthy; raising fails the restart
        self.log_path = log_path
        self.health_timeout = health_timeout
        self.max_restarts = max_restarts
        self.restarts = 0
        self.state: State = "stopped"
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: deque[str] = deque(maxlen=40)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._planned = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Starts the process and blocks until /health answers 200."""
        self._stopping.clear()
        self.state = "starting"
        self._spawn()
        self._wait_healthy()
        self.state = "healthy"
        self._watcher = threading.Thread(target=self._watch, name="engine-supervisor", daemon=True)
        self._watcher.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout)
        self.state = "stopped"

    def kill(self, planned: bool = False) -> None:
        """Kills the engine's process group now; the watcher restarts it like after a crash.
        A `planned` restart (new weights by a restart, where a reload failed) spends none
        of the crash budget."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._planned = planned
            self._signal_group(proc, signal.SIGKILL)

    def output_tail(self) -> str:
        return "".join(self._tail)

    # ----- internals ---------------------------------------------------------
    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def _spawn(self) -> None:
        log.info("starting engine: %s", " ".join(self.plan.command))
        self._proc = subprocess.Popen(
            [sys.executable, _DIE_WITH_PARENT, str(os.getpid()), *self.plan.command],
            env={**os.environ, **self.plan.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(self._proc,), name="engine-log", daemon=True).start()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        sink = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
        try:
            for raw in proc.stdout:
                self._tail.append(raw.decode("utf-8", "replace"))
                if sink is not None:
                    sink.write(raw)
                    sink.flush()
        finally:
            if sink is not None:
                sink.close()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout
        with httpx.Client(timeout=5.0) as http:
            while True:
                proc = self._proc
                if proc is None or proc.poll() is not None:
                    code = None if proc is None else proc.returncode
                    raise EngineStartError(
                        f"the engine exited with code {code} before becoming healthy; its last output:\n"
                        + self.output_tail()
                    )
                try:
                    if http.get(f"{self.plan.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self._stopping.is_set():
                    raise EngineStartError("stopped while starting")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"engine not healthy after {self.health_timeout:.0f}s")
                time.sleep(0.25)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            proc = self._proc
            assert proc is not None
            code = proc.wait()
            if self._stopping.is_set():
                return
            planned, self._planned = self._planned, False
            if not planned and self.restarts >= self.max_restarts:
                log.error("engine exited with %s; restart budget (%d) spent", code, self.max_restarts)
                self.state = "failed"
                return
            self.state = "restarting"
            if planned:
                log.warning("engine killed for a planned restart")
            else:
                self.restarts += 1
                log.warning("engine exited with %s; restart %d/%d", code, self.restarts, self.max_restarts)
            try:
                if self.replan is not None:
                    self.plan = self.replan()
                self._spawn()
                self._wait_healthy()
                if self.after_restart is not None:
                    self.after_restart()
                self.state = "healthy"
            except Exception as exc:  # EngineStartError; OSError: replan found no executable; the hook's failure
                if self._stopping.is_set():
                    return
                log.error("engine restart failed: %s", exc)
                # A hung (never healthy) process is killed; the loop then counts it as the next crash.
                if self._proc is not None and self._proc.poll() is None:
                    self._signal_group(self._proc, signal.SIGKILL)
