"""The lego tool sets and how each tool runs inside the sandbox.

Every tool is a sandbox exec as the agent user, so the agent touches only what
the sandbox allows. File tools do their text work on the host (numbering,
replacing) and move bytes with coreutils (`cat`, `base64`), because a task
image need not have Python.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_server.sandbox.base import AGENT_USER, ExecResult, Sandbox, SandboxError

# An exec that outlives its own timeout by this much means the sandbox is stuck, not the command.
_EXEC_GRACE_S = 30.0
# Linux caps one argv string at 128 KiB; stay well under it when shipping file bytes.
_WRITE_CHUNK_BYTES = 64 * 1024

SUBMIT = "submit"


class ToolError(Exception):
    """A tool call the model got wrong; the message goes back to the model as the observation."""


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CommandArgs(_Args):
    command: str = Field(min_length=1, description="The command line to run.")


class ViewFileArgs(_Args):
    path: str = Field(min_length=1, description="File path, relative to the work directory or absolute.")
    start_line: int | None = Field(None, ge=1, description="First line to show (1-based).")
    end_line: int | None = Field(None, ge=1, description="Last line to show, inclusive.")


class WriteFileArgs(_Args):
    path: str = Field(min_length=1, description="File path; parent directories are created.")
    content: str = Field(description="The whole new file content.")


class StrReplaceArgs(_Args):
    path: str = Field(min_length=1, description="File to edit.")
    old: str = Field(min_length=1, description="Exact text to replace; must occur exactly once.")
    new: str = Field(description="Replacement text.")


class SubmitArgs(_Args):
    summary: str = Field("", description="What you did, in a sentence or two.")


@dataclass(frozen=True)
class ToolDef:
    description: str
    args: type[_Args]


TOOLS: dict[str, ToolDef] = {
    "bash": ToolDef("Run a bash command in the work directory and return its output.", CommandArgs),
    "run": ToolDef("Run a POSIX sh command in the work directory and return its output.", CommandArgs),
    "view_file": ToolDef("Show a text file with line numbers.", ViewFileArgs),
    "write_file": ToolDef("Create or overwrite a text file.", WriteFileArgs),
    "str_replace": ToolDef("Replace one exact occurrence of a text in a file.", StrReplaceArgs),
    SUBMIT: ToolDef("Finish the task. Call this once the work is done and checked.", SubmitArgs),
}

TOOL_SETS: dict[str, tuple[str, ...]] = {
    "bash_only": ("bash",),
    "edit_tools": ("bash", "view_file", "write_file", "str_replace", SUBMIT),
    "minimal": ("run", SUBMIT),
}


def tool_schemas(tool_set: str) -> list[dict[str, Any]]:
    """OpenAI chat-completions function tools for a tool set."""
    schemas = []
    for name in TOOL_SETS[tool_set]:
        tool = TOOLS[name]
        params = tool.args.model_json_schema()
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        schemas.append(
            {"type": "function", "function": {"name": name, "description": tool.description, "parameters": params}}
        )
    return schemas


def parse_arguments(tool_set: str, name: str, arguments: str) -> _Args:
    """Validate one tool call; a ToolError says what the model got wrong."""
    allowed = TOOL_SETS[tool_set]
    if name not in allowed:
        raise ToolError(f"unknown tool {name!r}; available tools: {', '.join(allowed)}")
    try:
        raw = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolError(f"arguments for {name} are not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(raw, dict):
        raise ToolError(f"arguments for {name} must be a JSON object")
    try:
        return TOOLS[name].args.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
        raise ToolError(f"bad arguments for {name}: {problems}") from None


def number_lines(text: str, start: int | None, end: int | None) -> str:
    lines = text.splitlines()
    first = (start or 1) - 1
    last = len(lines) if end is None else min(end, len(lines))
    if not lines and start is None and end is None:
        return "(empty file)"
    if first >= last:
        raise ToolError(f"line range {start}-{end} is outside the file ({len(lines)} lines)")
    return "\n".join(f"{i + 1:6d}\t{lines[i]}" for i in range(first, last))


def replace_once(text: str, old: str, new: str) -> str:
    count = text.count(old)
    if count == 0:
        raise ToolError("old text not found in the file; view the file and copy the text exactly")
    if count > 1:
        raise ToolError(f"old text occurs {count} times; include more surrounding lines to make it unique")
    return text.replace(old, new, 1)


class ToolRunner:
    """Runs parsed tool calls in one trial's sandbox.

    Sandbox calls block, so they run on a thread. Each runner has its own: on
    the shared default pool (a handful of threads on a small host) one trial's
    exec would queue behind other trials' and its timeout would count the wait.
    """

    def __init__(self, sandbox: Sandbox, workdir: str, timeout_s: float) -> None:
        self.sandbox = sandbox
        self.workdir = workdir
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lego-tool")

    def close(self) -> None:
        # Not waiting: a sandbox call stuck past its grace period must not hang the episode's end.
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, name: str, args: _Args) -> ExecResult:
        if isinstance(args, CommandArgs):
            shell = "bash" if name == "bash" else "sh"
            return await self._exec([shell, "-c", args.command])
        if isinstance(args, ViewFileArgs):
            text = await self._read(args.path)
            return ExecResult(0, number_lines(text, args.start_line, args.end_line), "")
        if isinstance(args, WriteFileArgs):
            await self._write(args.path, args.content)
            return ExecResult(0, f"wrote {len(args.content.encode())} bytes to {args.path}", "")
        if isinstance(args, StrReplaceArgs):
            await self._write(args.path, replace_once(await self._read(args.path), args.old, args.new))
            return ExecResult(0, f"edited {args.path}", "")
        raise ToolError(f"tool {name!r} does not execute anything")

    async def _exec(self, argv: list[str]) -> ExecResult:
        call = asyncio.get_running_loop().run_in_executor(
            self._pool,
            functools.partial(self.sandbox.exec, argv, timeout=self.timeout_s, workdir=self.workdir, user=AGENT_USER),
        )
        try:
            return await asyncio.wait_for(call, self.timeout_s + _EXEC_GRACE_S)
        except TimeoutError:
            raise SandboxError(f"sandbox exec did not return {_EXEC_GRACE_S:.0f} s past its timeout") from None

    async def _read(self, path: str) -> str:
        result = await self._exec(["sh", "-c", 'wc -c < "$1" && cat -- "$1"', "sh", path])
        if not result.ok:
            raise ToolError(f"cannot read {path}: {result.stderr.strip() or 'timed out'}")
        size, _, text = result.stdout.partition("\n")
        # Sandboxes decode output leniently and cap its length; editing such a lossy copy would corrupt the file.
        if not size.strip().isdigit() or len(text.encode()) != int(size):
            raise ToolError(f"{path} is not a UTF-8 text file within the output limit; use the shell instead")
        return text

    async def _write(self, path: str, content: str) -> None:
        data = content.encode()
        chunks = [data[i : i + _WRITE_CHUNK_BYTES] for i in range(0, len(data), _WRITE_CHUNK_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            redirect = ">" if i == 0 else ">>"
            # Path and payload travel as positional parameters, never spliced into the script.
            script = f'mkdir -p -- "$(dirname -- "$1")" && printf %s "$2" | base64 -d {redirect} "$1"'
            result = await self._exec(["sh", "-c", script, "sh", path, base64.b64encode(chunk).decode()])
            if not result.ok:
                raise ToolError(f"cannot write {path}: {result.stderr.strip() or 'timed out'}")
