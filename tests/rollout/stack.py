"""Plumbing shared by the rollout-server suites: server configs, task variants,
the scripted test engine on a host port, and the orphan check.

The scripted engine (tests/proxy/scripted_engine.py) listens on every host
interface, as a real engine would, so the sandbox isolation tests prove that
the firewall, not the bind address, keeps agents away from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import docker
import grpc
from proxy.scripted_engine import ScriptedEngine, ServerThread

from legorl_jax.core.config import Config, load_config
from legorl_jax.demo.demonstrations import tool_call_text
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.sandbox.reaper import OWNER_LABEL, TRIAL_LABEL
from rollout_server.server import RolloutServer
from rollout_server.tasks import DEMO_TASKS_DIR

# The instruction carries the trial's script name, the only per-trial part of its first prompt.
_SCRIPT_TAG = re.compile(r"\[script:([\w-]+)\]")
_ASSISTANT_TURN = "<|im_start|>assistant"
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)</tool_response>", re.DOTALL)


def server_config(**extra: Any) -> Config:
    overrides = [
        "engine.port=0",
        "engine.max_batch=8",
        "sandbox.kind=docker",
        "fleet.capacity_per_server=4",
        "fleet.agent_timeout_s=60",
        "fleet.verifier_timeout_s=30",
        "rl.sampling.max_tokens=24",
        "proxy.max_model_calls=3",
        "tasks.demo=true",
        # Suites copy task variants under pytest's tmp_path, which lives in the system temp dir.
        f"tasks.location_roots=[{tempfile.gettempdir()}]",
        # And publish weights there.
        f"fleet.weights_location_roots=[{tempfile.gettempdir()}]",
    ]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])


def scripted_server_config(engine_url: str, **extra: Any) -> Config:
    """A host in front of an external (scripted) engine: nothing to launch, no model to load."""
    return server_config(**{"engine.kind": "external", "engine.url": engine_url, "tasks.demo": "false", **extra})


def lego(tools: str = "bash_only", **options: Any) -> pb.HarnessConfig:
    options = {"tools": tools, "turn_budget": "short", **options}
    return pb.HarnessConfig(name="lego", options_json=json.dumps(options), config_id=f"lego-{tools}")


def rollout_request(
    request_id: str, tasks: list[Path], harness: pb.HarnessConfig | None = None, group_size: int = 1
) -> pb.RolloutRequest:
    """One trial group per task directory (loaded by the server from its location)."""
    return pb.RolloutRequest(
        request_id=request_id,
        tasks=[pb.TaskRef(location=str(t)) for t in tasks],
        harness_configs=[harness or lego()],
        group_size=group_size,
    )


async def rollout(address: str, request: pb.RolloutRequest) -> dict[str, pb.Trajectory]:
    """One Rollout call to its end; the trajectories by task name."""
    async with grpc.aio.insecure_channel(address) as channel:
        return {t.task_id: t async for t in pb_grpc.RolloutServiceStub(channel).Rollout(request)}


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Polls `condition`; a wait that never ends fails the test instead of hanging it."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.1)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"gave up waiting for {what}") from None


def prompted(engine: ScriptedEngine, name: str) -> Callable[[], bool]:
    """A condition: the engine has answered the named trial at least once."""
    return lambda: any(f"[script:{name}]" in engine.tokenizer.decode(p) for p in engine.log.prompts)


def task_variant(root: Path, name: str, *, base: str = "edit-config", memory_mb: int | None = None) -> Path:
    """A copy of a demo task renamed `name`, its instruction tagged with `[script:name]`."""
    task = root / name
    shutil.copytree(DEMO_TASKS_DIR / base, task)
    toml = (task / "task.toml").read_text()
    toml = toml.replace(f'name = "{base}"', f'name = "{name}"')
    if memory_mb is not None:
        toml = re.sub(r"memory_mb = \d+", f"memory_mb = {memory_mb}", toml)
    (task / "task.toml").write_text(toml)
    with (task / "instruction.md").open("a") as fh:
        fh.write(f"\n[script:{name}]\n")
    return task


def stand_in_cli_task(root: Path, name: str, script: str, *, memory_mb: int | None = None) -> Path:
    """A demo task whose image carries `script` as mini-swe-agent's `mini` (a test instrument)."""
    task = task_variant(root, name, memory_mb=memory_mb)
    (task / "environment" / "mini").write_text(script)
    (task / "environment" / "mini").chmod(0o755)
    with (task / "environment" / "Dockerfile").open("a") as fh:
        fh.write("COPY mini /usr/local/bin/mini\n")
    return task


# TEST INSTRUMENT: the head of a stand-in `mini` that answers its install check and defines `ask()`,
# one chat call to the proxy (a refusal is swallowed); `asking_mini` appends what it does next.
_ASKING_MINI = """#!/usr/bin/env python3
import json, os, sys, time, urllib.error, urllib.request
if sys.argv[1:] == ["--help"]:
    print("Usage: mini [OPTIONS] (stand-in)")
    sys.exit(0)
base = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("model.model_kwargs.api_base="))
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": sys.argv[-1]}]}).encode()
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
def ask():
    try:
        urllib.request.urlopen(urllib.request.Request(base + "/chat/completions", body, headers), timeout=60).read()
    except urllib.error.HTTPError:
        pass
"""


def asking_mini(then: str) -> str:
    """A stand-in `mini` script: `ask()` defined, then the Python in `then`."""
    return _ASKING_MINI + then


def by_script(commands: dict[str, str], final: str = "Done.") -> Callable[[str], str | None]:
    """A `ScriptedEngine.respond` for lego's bash tool: the first turn of a trial runs the
    command its task is tagged with, every later turn answers `final` (ending the episode)."""

    def respond(prompt: str) -> str | None:
        tag = _SCRIPT_TAG.search(prompt)
        if tag is None or tag.group(1) not in commands:
            return None
        if prompt.count(_ASSISTANT_TURN) > 1:
            return final
        return tool_call_text("bash", {"command": commands[tag.group(1)]})

    return respond


def observations(engine: ScriptedEngine, name: str) -> str:
    """The tool results the named trial's agent was shown, read from the prompts the engine got."""
    prompts = [engine.tokenizer.decode(p) for p in engine.log.prompts]
    mine = [p for p in prompts if f"[script:{name}]" in p]
    # Prompts grow by appending, so the longest holds every earlier tool result.
    return "\n".join(_TOOL_RESPONSE.findall(max(mine, key=len))) if mine else ""


@contextmanager
def engine_on_host(tokenizer: Any, max_model_len: int = 4096) -> Iterator[tuple[ScriptedEngine, ServerThread, int]]:
    """The scripted engine bound to all interfaces, serving `max_model_len` tokens of context;
    yields it, its server thread and its port."""
    engine = ScriptedEngine(tokenizer, max_model_len=max_model_len)
    thread = ServerThread(engine.app)
    thread.server.config.host = "0.0.0.0"
    with thread:
        yield engine, thread, thread.server.servers[0].sockets[0].getsockname()[1]


def kill_engine(thread: ServerThread) -> None:
    """Stops the engine as a crash would: open requests are dropped, not answered."""
    thread.server.force_exit = True
    thread.__exit__(None, None, None)


@asynccontextmanager
async def running_server(config: Config, model_dir: Path, grace_s: float = 30.0) -> AsyncIterator[RolloutServer]:
    server = RolloutServer(config, model_dir)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=grace_s)


def trial_containers(client: docker.DockerClient, pid: int | None = None) -> list[str]:
    """Trial containers, running or not, that process `pid` (default: this one) created.
    Other engineers' and CI jobs' trials on the same daemon carry other owners."""
    prefix = f"{socket.gethostname()}/{os.getpid() if pid is None else pid}/"
    return [
        c["Id"][:12]
        for c in client.api.containers(all=True, filters={"label": TRIAL_LABEL})
        if (c.get("Labels") or {}).get(OWNER_LABEL, "").startswith(prefix)
    ]
