"""What every harness declares, and the registry the trial runner looks them up in.

A harness is environment, not policy: it is never changed, only pointed at the
per-trial session URL of the token-capture proxy. Two kinds exist:

* `CliHarness`: a real agent CLI installed in the sandbox. It yields a
  `LaunchSpec` (argv, env, files, workdir, stdin) that the trial runner writes
  into the sandbox and executes, then `classify()` reads the process result.
* `InProcessHarness`: an agent loop that runs on the host (our `lego`) and only
  executes the agent's tool calls inside the sandbox.

Options arrive as JSON from the `HarnessConfig` proto and are validated by a
per-harness pydantic model that forbids unknown keys, so a typo is an error
that names the field rather than a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from legorl_jax.core.errors import InputError
from legorl_jax.core.registry import Registry
from rollout_server.sandbox.base import Sandbox

Dialect = Literal["openai_chat", "anthropic", "openai_responses", "gemini"]
HarnessStatus = Literal["ok", "harness_error", "cap_exceeded", "timeout"]


class HarnessConfigError(ValueError, InputError):
    """Options or launch inputs a harness cannot run with; the message says which and why."""


class UnknownHarnessError(HarnessConfigError):
    pass


class HarnessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CliOptions(HarnessOptions):
    version: str | None = Field(
        None, min_length=1, description="Package version range to install; None uses the harness's tested range."
    )


@dataclass(frozen=True)
class HarnessContext:
    """Everything a harness needs to know about one trial.

    `session_url` is the proxy's per-session root, `http://host:port/s/<key>`
    (no `/v1`); each harness appends what its SDK expects. `home` is set as
    HOME for CLI harnesses: the trial runner must create it writable by the
    agent user before writing `LaunchSpec.files`, since the CLIs keep state there.
    """

    session_url: str
    api_key: str
    model: str
    instruction: str
    workdir: str = "/app"
    home: str = "/home/agent"

    def __post_init__(self) -> None:
        if not self.session_url.startswith(("http://", "https://")):
            raise HarnessConfigError(f"session_url must be an http(s) URL, got {self.session_url!r}")
        for name in ("api_key", "model", "instruction"):
            if not getattr(self, name).strip():
                raise HarnessConfigError(f"{name} must not be empty")
        for name in ("workdir", "home"):
            if not getattr(self, name).startswith("/"):
                raise HarnessConfigError(f"{name} must be an absolute sandbox path, got {getattr(self, name)!r}")

    @property
    def base_url(self) -> str:
        return self.session_url.rstrip("/")

    @property
    def openai_base_url(self) -> str:
        """What OpenAI-style SDKs call `base_url`: they append `/chat/completions` or `/responses`."""
        return f"{self.base_url}/v1"


@dataclass(frozen=True)
class InstallSpec:
    """How a harness gets into the sandbox image."""

    kind: Literal["npm", "pip", "builtin"]
    package: str = ""
    version: str = ""  # an npm range ("2.1.x") or a pip specifier (">=2.4,<2.5")
    binary: str = ""
    # Arguments that make `binary` exit 0 without doing work (not every CLI has --version).
    check_args: tuple[str, ...] = ("--version",)

    def requirement(self) -> str:
        if self.kind == "npm":
            return f"{self.package}@{self.version}" if self.version else self.package
        return f"{self.package}{self.version}"

    def commands(self) -> list[list[str]]:
        """Install commands to run as root in the sandbox; none for a built-in harness."""
        if self.kind == "npm":
            return [["npm", "install", "-g", self.requirement()]]
        if self.kind == "pip":
            return [["python3", "-m", "pip", "install", self.requirement()]]
        return []

    def check_argv(self) -> list[str]:
        """A command that exits 0 once the harness is installed."""
        return [self.binary, *self.check_args] if self.binary else []


@dataclass(frozen=True)
class FileSpec:
    """A file the trial runner writes before launch, owned by the agent user (the CLI runs as it)."""

    path: str  # absolute sandbox path
    content: str
    mode: int = 0o600  # may hold the session key


@dataclass(frozen=True)
class LaunchSpec:
    """Complete for `sandbox.exec(list(argv), env=env, workdir=workdir, user=AGENT_USER, timeout=...)`
    once `files` are written: the sandbox protocol has no stdin, so any stdin a CLI needs is a
    redirection inside argv (see `stdin_from`)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    files: tuple[FileSpec, ...]
    workdir: str
    dialect: Dialect


def stdin_from(path: str, argv: tuple[str, ...]) -> tuple[str, ...]:
    """argv run with stdin redirected from a sandbox file; path and arguments stay unquoted data."""
    return ("sh", "-c", 'f="$1"; shift; exec "$@" < "$f"', "sh", path, *argv)


@dataclass(frozen=True)
class Outcome:
    status: HarnessStatus
    reason: str = ""


def json_lines(text: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL stream, skipping lines that are not JSON objects (banners, logs)."""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj


def last_line(*texts: str) -> str:
    for text in texts:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        if lines:
            return lines[-1][:500]
    return ""


OptionsT = TypeVar("OptionsT", bound=HarnessOptions)


class Harness:
    name: ClassVar[str] = ""
    Options: ClassVar[type[HarnessOptions]] = HarnessOptions
    install: ClassVar[InstallSpec] = InstallSpec(kind="builtin")

    def parse_options(self, raw: Mapping[str, Any] | str | None = None) -> HarnessOptions:
        """Validate options given as a dict, a JSON object string (the proto's options_json), or nothing."""
        if raw is None or raw == "":
            raw = {}
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise HarnessConfigError(f"{self.name}: options are not valid JSON: {exc}") from exc
        if not isinstance(raw, Mapping):
            raise HarnessConfigError(f"{self.name}: options must be a JSON object, got {type(raw).__name__}")
        try:
            return self.Options.model_validate(dict(raw))
        except ValidationError as exc:
            raise HarnessConfigError(f"{self.name}: invalid options: {_brief(exc)}") from exc

    def config_id(self, options: HarnessOptions) -> str:
        """A short stable label for metrics: the name, plus a digest when options differ from defaults."""
        changed = options.model_dump(mode="json", exclude_defaults=True)
        if not changed:
            return self.name
        digest = hashlib.sha1(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.name}~{digest}"

    def _typed(self, options: HarnessOptions, kind: type[OptionsT]) -> OptionsT:
        if not isinstance(options, kind):
            raise HarnessConfigError(f"{self.name}: expected {kind.__name__}, got {type(options).__name__}")
        return options


class CliHarness(Harness, ABC):
    """A harness CLI run headless in the sandbox. One that always speaks the same API sets
    `wire`; one whose API depends on its options overrides `dialect()` instead."""

    Options: ClassVar[type[HarnessOptions]] = CliOptions
    wire: ClassVar[Dialect]

    def install_spec(self, options: HarnessOptions) -> InstallSpec:
        version = getattr(options, "version", None)
        return replace(self.install, version=version) if version else self.install

    def dialect(self, options: HarnessOptions) -> Dialect:
        return self.wire

    @abstractmethod
    def launch_spec(self, ctx: HarnessContext, options: HarnessOptions) -> LaunchSpec: ...

    def _launch(
        self,
        ctx: HarnessContext,
        options: HarnessOptions,
        argv: Sequence[str],
        env: Mapping[str, str],
        files: Sequence[FileSpec] = (),
    ) -> LaunchSpec:
        """Every CLI runs in the trial's work directory with HOME at the trial's home, where it keeps state."""
        return LaunchSpec(
            argv=tuple(argv),
            env={"HOME": ctx.home, **env},
            files=tuple(files),
            workdir=ctx.workdir,
            dialect=self.dialect(options),
        )

    def classify(self, exit_code: int | None, stdout: str, stderr: str, timed_out: bool) -> Outcome:
        """Whether the harness process ended normally. A cap hit is known to the proxy, which the
        trial runner asks first; this only reads what the process itself reported."""
        if timed_out:
            return Outcome("timeout", "harness ran past its wall-clock limit")
        if exit_code == 0:
            return Outcome("ok")
        return Outcome("harness_error", f"exit code {exit_code}: {last_line(stderr, stdout)}")


class RunResult(Protocol):
    """What an in-process harness reports; the trial runner needs no more than this."""

    @property
    def status(self) -> HarnessStatus: ...

    @property
    def reason(self) -> str: ...

    @property
    def final_message(self) -> str:
        """The agent's last words; the trial leaves them in the sandbox for the verifier."""
        ...

    def metrics(self) -> dict[str, float]: ...


class InProcessHarness(Harness, ABC):
    """An agent loop on the host that runs only the agent's tool calls in the sandbox."""

    dialect: ClassVar[Dialect] = "openai_chat"

    @abstractmethod
    async def run(
        self, sandbox: Sandbox, ctx: HarnessContext, options: HarnessOptions, *, deadline_s: float | None = None
    ) -> RunResult:
        """One episode. Raises `SandboxError` when the environment breaks (an ungraded env_failure)."""


_REGISTRY: Registry[Harness] = Registry("harness", error=UnknownHarnessError)
H = TypeVar("H", bound=type[Harness])


def register_harness(name: str) -> Callable[[H], H]:
    """Registers one instance of the decorated class, named `name`."""

    def wrap(cls: H) -> H:
        cls.name = name
        _REGISTRY.add(name, cls())
        return cls

    return wrap


def harness_names() -> list[str]:
    return _REGISTRY.names()


def get_harness(name: str) -> Harness:
    return _REGISTRY.get(name)


def _brief(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "options"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def home_path(ctx: HarnessContext, *parts: str) -> str:
    return "/".join([ctx.home.rstrip("/"), *parts])


def json_file(path: str, obj: Mapping[str, object]) -> FileSpec:
    """A JSON config file, indented so a person debugging a trial can read it in the sandbox."""
    return FileSpec(path=path, content=json.dumps(obj, indent=2))
