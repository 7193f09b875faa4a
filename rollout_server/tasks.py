"""Tasks in Harbor's layout, loaded from directory trees or JSONL indexes.

A task directory holds `task.toml`, `instruction.md`, `environment/` (a
Dockerfile, or `[environment].docker_image` in task.toml), `tests/test.sh`
(writes `/logs/verifier/reward.txt` or `reward.json`) and optionally
`solution/solve.sh`. Every loading error names the task directory, the file
and, for task.toml, the field, so a broken dataset is fixed in one look.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from legorl_jax.core.errors import InputError

log = logging.getLogger(__name__)

DEMO_TASKS_DIR = Path(__file__).resolve().parent / "demo_tasks"
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_MEMORY_UNIT_MB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


class TaskError(ValueError, InputError):
    """A task that cannot be used; the message says where and why."""

    def __init__(self, task_dir: Path | str, file: str, problem: str) -> None:
        self.task_dir = Path(task_dir)
        self.file = file
        self.problem = problem
        super().__init__(f"task {self.task_dir}: {file}: {problem}")


class _Section(BaseModel):
    # Harbor ignores keys it does not know (newer schema versions add some); so do we,
    # but the loader logs them so a typo does not go unseen.
    model_config = ConfigDict(extra="allow", frozen=True)


class VerifierSection(_Section):
    timeout_sec: float = Field(120.0, gt=0, description="Longest tests/test.sh may run.")
    env: dict[str, str] = Field({}, description="Environment variables for the verifier.")


class AgentSection(_Section):
    timeout_sec: float = Field(600.0, gt=0, description="Longest the agent may work.")


class SolutionSection(_Section):
    env: dict[str, str] = Field({}, description="Environment variables for solution/solve.sh.")


class EnvironmentSection(_Section):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = Field(
        None, description="Prebuilt local image, used when environment/ has no Dockerfile."
    )
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    storage_mb: int | None = Field(None, gt=0)
    allow_internet: bool = Field(False, description="Read but never honoured: sandboxes reach only the proxy.")

    @model_validator(mode="before")
    @classmethod
    def _legacy_memory(cls, data: Any) -> Any:
        # Older task.toml files spell memory as a string ("2G"); Harbor normalises it to memory_mb.
        if isinstance(data, dict) and "memory" in data and "memory_mb" not in data:
            data = dict(data)
            data["memory_mb"] = _parse_memory(data.pop("memory"))
        return data


class TaskToml(_Section):
    version: str = "1.0"
    task: dict[str, Any] = Field({}, description="[task] name, description, authors, keywords.")
    metadata: dict[str, Any] = {}
    verifier: VerifierSection = VerifierSection()
    agent: AgentSection = AgentSection()
    environment: EnvironmentSection = EnvironmentSection()
    solution: SolutionSection = SolutionSection()

    @model_validator(mode="before")
    @classmethod
    def _schema_version(cls, data: Any) -> Any:
        if isinstance(data, dict) and "schema_version" in data and "version" not in data:
            data = dict(data)
            data["version"] = str(data.pop("schema_version"))
        return data


def _parse_memory(value: Any) -> int:
    if isinstance(value, int):
        return value
    match = _MEMORY_RE.match(str(value))
    if match is None:
        raise ValueError(f"memory {value!r} is not a size such as '2G' or '512M'")
    number, unit = match.groups()
    return max(1, int(float(number) * _MEMORY_UNIT_MB[unit.upper()]))


class Task(BaseModel):
    """One loaded, validated task. Paths are absolute host paths."""

    model_config = ConfigDict(frozen=True)

    name: str
    root: Path
    config: TaskToml
    instruction: str

    @property
    def environment_dir(self) -> Path:
        return self.root / "environment"

    @property
    def dockerfile(self) -> Path | None:
        path = self.environment_dir / "Dockerfile"
        return path if path.is_file() else None

    @property
    def tests_dir(self) -> Path:
        return self.root / "tests"

    @property
    def solution_dir(self) -> Path | None:
        path = self.root / "solution"
        return path if (path / "solve.sh").is_file() else None


def _field_path(loc: tuple[int | str, ...]) -> str:
    if not loc:
        return "(top level)"
    section, *rest = (str(part) for part in loc)
    return f"[{section}]." + ".".join(rest) if rest else section


def _warn_unknown_keys(task_dir: Path, config: TaskToml) -> None:
    unknown = list(config.model_extra or {})
    for name in ("verifier", "agent", "environment", "solution"):
        unknown += [f"[{name}].{key}" for key in getattr(config, name).model_extra or {}]
    for key in unknown:
        log.warning("task %s: task.toml: unknown key %s ignored", task_dir, key)


def _read_toml(task_dir: Path) -> TaskToml:
    path = task_dir / "task.toml"
    if not path.is_file():
        raise TaskError(task_dir, "task.toml", "missing")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskError(task_dir, "task.toml", f"not valid TOML: {exc}") from exc
    try:
        config = TaskToml.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{_field_path(err['loc'])}: {err['msg']}" for err in exc.errors())
        raise TaskError(task_dir, "task.toml", problems) from exc
    _warn_unknown_keys(task_dir, config)
    return config


def load_task(task_dir: Path | str) -> Task:
    """Load and validate one Harbor task directory."""
    try:
        return _load_task(Path(task_dir).resolve())
    except TaskError:
        raise
    except (OSError, ValueError) as exc:
        # An unreadable file (permissions, bad encoding, a loop of links, a NUL in the path) is the task's
        # fault like any other, and named like the others.
        raise TaskError(task_dir, ".", f"cannot read: {exc}") from None


def confined_task_dir(location: str, roots: Iterable[Path]) -> Path:
    """`location` with `..` and symlinks resolved; a TaskError unless it lies inside one of `roots`
    (resolved paths), so a request cannot have the server read and run an arbitrary host directory."""
    try:
        resolved = Path(location).resolve()
    except (OSError, ValueError) as exc:
        raise TaskError(location, ".", f"not a usable path: {exc}") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise TaskError(
            location, ".", "outside the task roots this server loads from (configure them in tasks.location_roots)"
        )
    return resolved


def _load_task(task_dir: Path) -> Task:
    if not task_dir.is_dir():
        raise TaskError(task_dir, ".", "not a directory")
    config = _read_toml(task_dir)
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(task_dir, "instruction.md", "missing")
    instruction = instruction_path.read_text(encoding="utf-8").strip()
    if not instruction:
        raise TaskError(task_dir, "instruction.md", "empty")
    if not (task_dir / "tests" / "test.sh").is_file():
        raise TaskError(task_dir, "tests/test.sh", "missing")
    has_dockerfile = (task_dir / "environment" / "Dockerfile").is_file()
    if not has_dockerfile and config.environment.docker_image is None:
        raise TaskError(task_dir, "environment/Dockerfile", "missing, and task.toml sets no [environment].docker_image")
    solution = task_dir / "solution"
    if solution.is_dir() and not (solution / "solve.sh").is_file():
        raise TaskError(task_dir, "solution/solve.sh", "solution/ exists but has no solve.sh")
    name = str(config.task.get("name") or task_dir.name)
    return Task(name=name, root=task_dir, config=config, instruction=instruction)


def _task_dirs_under(root: Path) -> list[Path]:
    if (root / "task.toml").is_file():
        return [root]
    found = sorted(
        p.parent for p in root.rglob("task.toml") if not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not found:
        raise TaskError(root, ".", "no task.toml anywhere below this directory")
    return found


def _task_dirs_in_index(index: Path) -> list[Path]:
    dirs: list[Path] = []
    for lineno, line in enumerate(index.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{index.name}:{lineno}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(index.parent, where, f"not valid JSON: {exc}") from exc
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise TaskError(index.parent, where, 'each line must be an object with a string "path"')
        path = Path(entry["path"])
        dirs.append(path if path.is_absolute() else index.parent / path)
    return dirs


def load_tasks(sources: Iterable[Path | str]) -> list[Task]:
    """Tasks from task directories, trees of them, or JSONL indexes (one {"path": ...} per line)."""
    tasks: list[Task] = []
    for source in sources:
        source = Path(source)
        if source.is_file() and source.suffix == ".jsonl":
            dirs = _task_dirs_in_index(source)
        elif source.is_dir():
            dirs = _task_dirs_under(source)
        else:
            raise TaskError(source, ".", "neither a task directory nor a .jsonl index")
        tasks.extend(load_task(d) for d in dirs)
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.name in seen and seen[task.name] != task.root:
            raise TaskError(task.root, "task.toml", f"task name {task.name!r} also used by {seen[task.name]}")
        seen[task.name] = task.root
    return tasks


def demo_tasks() -> list[Task]:
    """The project's shipped demo tasks (each has a solution that scores 1)."""
    return load_tasks([DEMO_TASKS_DIR])
