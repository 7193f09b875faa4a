"""Labels on every trial container, and the reaper that removes orphans.

A container is an orphan when its deadline has passed, when it has stopped,
or when the process that created it (on this host) is gone. The owner label
carries the creator's process start time as well as its pid, so a recycled
pid does not keep an orphan alive. Servers reap once at start-up and then
periodically; a killed server's containers go at the next reap (or at their
deadline, when PID 1's `sleep` ends).
"""

from __future__ import annotations

import logging
import threading
import time

import docker
import docker.errors

from rollout_server.sandbox.owner import owner_alive, owner_id

log = logging.getLogger(__name__)

TRIAL_LABEL = "legorl.trial"
OWNER_LABEL = "legorl.owner"
DEADLINE_LABEL = "legorl.deadline"


def labels(trial_id: str, deadline: float) -> dict[str, str]:
    return {TRIAL_LABEL: trial_id, OWNER_LABEL: owner_id(), DEADLINE_LABEL: f"{deadline:.0f}"}


def orphan_reason(container_labels: dict[str, str], status: str, now: float) -> str | None:
    """Why a trial container should go, or None while its trial may still be using it."""
    if status in ("exited", "dead"):
        return f"container {status}"
    try:
        deadline = float(container_labels.get(DEADLINE_LABEL, "0"))
    except ValueError:
        return "unreadable deadline label"
    if deadline <= now:
        return "deadline passed"
    if not owner_alive(container_labels.get(OWNER_LABEL, "")):
        return f"owner {container_labels.get(OWNER_LABEL)} is gone"
    return None


def reap(client: docker.DockerClient, now: float | None = None) -> list[str]:
    """Remove orphaned trial containers; returns their trial ids."""
    now = time.time() if now is None else now
    removed: list[str] = []
    # The low-level list carries labels and state itself; the high-level one inspects each
    # container again and fails on any that a trial removed in between.
    for entry in client.api.containers(all=True, filters={"label": TRIAL_LABEL}):
        container_labels = entry.get("Labels") or {}
        reason = orphan_reason(container_labels, entry.get("State", ""), now)
        if reason is None:
            continue
        try:
            client.api.remove_container(entry["Id"], force=True, v=True)
        except docker.errors.NotFound:
            continue
        except docker.errors.APIError as exc:
            log.warning("reaper could not remove %s: %s", entry["Id"][:12], exc)
            continue
        trial = container_labels.get(TRIAL_LABEL, "?")
        log.info("reaped trial container %s (trial %s): %s", entry["Id"][:12], trial, reason)
        removed.append(trial)
    return removed


class Reaper:
    """Reaps now, then every interval_s seconds on a daemon thread until stop()."""

    def __init__(self, client: docker.DockerClient, interval_s: float = 30.0) -> None:
        self._client = client
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> list[str]:
        removed = reap(self._client)
        self._thread = threading.Thread(target=self._loop, name="sandbox-reaper", daemon=True)
        self._thread.start()
        return removed

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                reap(self._client)
            except docker.errors.DockerException as exc:
                log.warning("reaper pass failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
