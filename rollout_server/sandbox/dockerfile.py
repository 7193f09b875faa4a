"""Just enough of the Dockerfile language for the local sandbox to lay out a task.

Without Docker there is no image to build, so the local sandbox replays the
parts of a task's Dockerfile that shape the filesystem: WORKDIR, COPY/ADD of
files from the build context, ENV, and RUN (run inside the sandbox). The base
image is not reproduced: the host's own userland stands in for it. Metadata
instructions are skipped; anything else is an error naming the line.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

_METADATA_ONLY = {
    "FROM",
    "CMD",
    "ENTRYPOINT",
    "LABEL",
    "EXPOSE",
    "USER",
    "SHELL",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "VOLUME",
    "ARG",
    "MAINTAINER",
}
_APPLIED = {"WORKDIR", "COPY", "ADD", "ENV", "RUN"}


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Step:
    instruction: str
    args: list[str]
    line: int


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations and drop comments; keeps the first physical line number."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((start, pending + stripped))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def _split_args(instruction: str, rest: str, line: int) -> list[str]:
    if instruction == "RUN":
        if rest.startswith("["):
            return [shlex.join(json.loads(rest))]
        return [rest]
    if rest.startswith("["):
        try:
            return [str(a) for a in json.loads(rest)]
        except json.JSONDecodeError as exc:
            raise DockerfileError(f"line {line}: bad JSON argument list: {exc}") from exc
    return shlex.split(rest)


def parse(path: Path) -> list[Step]:
    """The filesystem-shaping steps of a Dockerfile, in order."""
    steps: list[Step] = []
    for line, text in _logical_lines(path.read_text(encoding="utf-8")):
        instruction, _, rest = text.partition(" ")
        instruction = instruction.upper()
        if instruction in _METADATA_ONLY:
            continue
        if instruction not in _APPLIED:
            raise DockerfileError(f"{path}: line {line}: {instruction} is not supported by the local sandbox")
        args = _split_args(instruction, rest.strip(), line)
        if instruction in ("COPY", "ADD"):
            if any(a.startswith("--from") for a in args):
                raise DockerfileError(
                    f"{path}: line {line}: multi-stage COPY --from is not supported by the local sandbox"
                )
            args = [a for a in args if not a.startswith("--")]
            if len(args) < 2:
                raise DockerfileError(f"{path}: line {line}: {instruction} needs a source and a destination")
        if not args:
            raise DockerfileError(f"{path}: line {line}: {instruction} without arguments")
        steps.append(Step(instruction, args, line))
    return steps


def env_pairs(args: list[str]) -> dict[str, str]:
    """ENV in both spellings: `ENV K=V K2=V2` and the legacy `ENV K V`."""
    if all("=" in a for a in args):
        return dict(a.split("=", 1) for a in args)
    if len(args) >= 2 and "=" not in args[0]:
        return {args[0]: " ".join(args[1:])}
    raise DockerfileError(f"cannot read ENV {' '.join(args)!r}")
