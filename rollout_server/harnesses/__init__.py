"""Harnesses: one module per agent harness, looked up by name.

harness = get_harness("codex")                   # UnknownHarnessError lists the names
options = harness.parse_options(options_json)    # HarnessConfigError names the bad field
spec = harness.launch_spec(ctx, options)         # CliHarness: argv, env, files, workdir
result = await get_harness("lego").run(sandbox, ctx, options, deadline_s=...)  # InProcessHarness
"""

from __future__ import annotations

# Imported for their @register_harness side effect.
from . import claude_code, codex, gemini_cli, lego, mini_swe_agent, opencode, openhands, qwen_code  # noqa: F401
from .base import (
    CliHarness,
    Dialect,
    FileSpec,
    Harness,
    HarnessConfigError,
    HarnessContext,
    HarnessOptions,
    HarnessStatus,
    InProcessHarness,
    InstallSpec,
    LaunchSpec,
    Outcome,
    RunResult,
    UnknownHarnessError,
    get_harness,
    harness_names,
    register_harness,
)

__all__ = [
    "CliHarness",
    "Dialect",
    "FileSpec",
    "Harness",
    "HarnessConfigError",
    "HarnessContext",
    "HarnessOptions",
    "HarnessStatus",
    "InProcessHarness",
    "InstallSpec",
    "LaunchSpec",
    "Outcome",
    "RunResult",
    "UnknownHarnessError",
    "get_harness",
    "harness_names",
    "register_harness",
]
