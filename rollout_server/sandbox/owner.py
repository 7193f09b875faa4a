"""Who made a trial's resources: a process id that outlives pid reuse.

An owner id is `host/pid/start-time`; the start time (from /proc) tells a
recycled pid from the process that made the resource. Docker trial containers
carry it as a label, local sandbox directories as a file, so a server that
was killed has its leftovers removed by the next one to start.
"""

from __future__ import annotations

import os
import socket


def _process_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            # Field 22 (starttime) follows the parenthesised command name, which may hold spaces.
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_id(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}/{pid}/{_process_start_time(pid) or '?'}"


def owner_alive(owner: str) -> bool:
    """Whether the process an `owner_id` names still runs (another host's is taken to)."""
    host, _, rest = owner.partition("/")
    if host != socket.gethostname():
        return True  # another host's process: this host cannot tell, so it stays
    pid_text, _, start = rest.partition("/")
    if not pid_text.isdigit():
        return False
    return _process_start_time(int(pid_text)) == start
