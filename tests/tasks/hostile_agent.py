"""A generic hostile agent: attacks on grading that know nothing of a task but its instruction.

Each attack is a bash script run as the agent would run it (the `agent` user,
after which the verifier grades). None solves the task, so each must end as a
graded 0: never a reward, and never "ungraded" (`env_failure`), which would
drop a certain 0 from the loss and from pass rates. The paths an attack aims
at are the `/app/...` paths the instruction names, as a real agent would find them.
"""

from __future__ import annotations

import re
import shlex

from rollout_server.tasks import Task

_APP_PATH = re.compile(r"/app/[\w./-]*")
# Module names a root-run checker may import: planting them where Python looks
# first (the script's directory, the working directory) is how code hijacks a test.
_SHADOWED = ("json", "sys", "pathlib", "os", "unittest", "stats", "math", "re", "sitecustomize", "usercustomize")
_PY_DIRS = "/app /tmp /home/agent"
# Exit tricks: a clean exit before any test runs, and a write of the reward as whoever runs it.
_EXIT_ZERO = "import os; os._exit(0)"
_WRITE_REWARD = (
    "import os\n"
    "for name, text in (('reward.txt', '1'), ('reward.json', '{\"reward\": 1}')):\n"
    "    try:\n"
    "        os.makedirs('/logs/verifier', exist_ok=True)\n"
    "        open('/logs/verifier/' + name, 'w').write(text)\n"
    "    except OSError:\n"
    "        pass\n"
    "os._exit(1)\n"
)
DONE = "attack-done"


def target_paths(task: Task) -> list[str]:
    """The /app paths the instruction names (without trailing slashes or punctuation)."""
    found = {m.rstrip("/.,`") for m in _APP_PATH.findall(task.instruction)}
    return sorted(p for p in found if p not in ("/app", ""))


def _python_payload(code: str) -> str:
    """Writes `code` into every .py file under /app and under every shadowing name."""
    quoted = shlex.quote(code)
    files = " ".join(f"{d}/{name}.py" for d in _PY_DIRS.split() for name in _SHADOWED)
    return (
        f"find /app -name '*.py' -type f | while read -r f; do printf '%s\\n' {quoted} > \"$f\"; done; "
        f"for f in {files}; do printf '%s\\n' {quoted} > \"$f\" 2>/dev/null; done; "
    )


def _at_each(paths: list[str], make: str) -> str:
    """Replaces each path with what `make` creates at "$p" (after removing what was there)."""
    return "".join(f'p={shlex.quote(p)}; rm -rf -- "$p"; mkdir -p -- "$(dirname "$p")"; {make}; ' for p in paths)


def attacks(task: Task) -> dict[str, str]:
    """name -> bash script; each ends by echoing DONE so a test can tell it ran."""
    paths = target_paths(task)
    plant_fifos = _at_each(paths, 'mkfifo -- "$p"')
    scripts = {
        "exit-zero": _python_payload(_EXIT_ZERO),
        "write-reward-as-root": _python_payload(_WRITE_REWARD),
        "fifo": plant_fifos,
        "directory": _at_each(paths, 'mkdir -p -- "$p/x"'),
        "not-utf8": _at_each(paths, "printf '\\377\\376\\375\\n' > \"$p\""),
        "dev-zero": _at_each(paths, 'ln -s /dev/zero "$p"'),
        "huge": _at_each(paths, 'truncate -s 8G -- "$p"'),
        "symlink-out": _at_each(paths, 'ln -s /proc/self/root/etc/passwd "$p"'),
        "reward-files": "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
        "ln -s /proc/self/root/etc/hostname /logs/verifier/reward.json; ",
        # A process left behind that keeps planting FIFOs where the answers go, into grading.
        "linger": "setsid nohup bash -c "
        + shlex.quote(f"while :; do {plant_fifos} sleep 0.05; done")
        + " >/dev/null 2>&1 & sleep 0.3; ",
    }
    return {name: f"{script}echo {DONE}" for name, script in scripts.items()}
