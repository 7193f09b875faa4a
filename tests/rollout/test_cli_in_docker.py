"""Real harness CLIs running trials inside Docker sandboxes, end to end over gRPC:
one native npm binary (Claude Code), one node script (Codex), one pip venv on
the sandbox's Python version (mini-swe-agent) and one on another (OpenHands).

The sandbox reaches nothing but the proxy and its image has neither Node nor
the CLIs: the server mounts the host's installs (scripts/setup) read-only
(sandbox.harness_tools). A scripted engine drives the CLI: its first turn runs
the task's reference solution and probes the mounts for writes, its second
ends the episode. The trial must come back graded (reward 1, the verifier's
alone) with the whole episode captured as one merged token sequence.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import docker
import pytest

from legorl_jax.core.config import REPO_ROOT
from legorl_jax.demo.demonstrations import solution_command, tool_call_text
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.harnesses.tools import NPM_DIR, ROOT
from rollout_server.tasks import DEMO_TASKS_DIR, load_task

from .stack import engine_on_host, rollout, running_server, scripted_server_config, trial_containers

pytestmark = [pytest.mark.docker, pytest.mark.npm]

TASK = DEMO_TASKS_DIR / "edit-config"


@dataclass(frozen=True)
class Cli:
    install: str  # its directory under .cache, where scripts/setup installs it
    kind: Literal["npm", "pip"]
    shell: Callable[[str], str]  # the completion that calls its shell tool with a command
    last: str  # the completion that ends its episode


CLIS = {
    "claude-code": Cli(
        "harness-cli", "npm", lambda cmd: tool_call_text("Bash", {"command": cmd, "description": "run"}), "All done."
    ),
    # A node script: runs on the host's node, mounted beside the npm prefix.
    "codex": Cli("harness-cli", "npm", lambda cmd: tool_call_text("exec_command", {"cmd": cmd}), "All done."),
    "mini-swe-agent": Cli(
        "mini-venv",
        "pip",
        lambda cmd: tool_call_text("bash", {"command": cmd}),
        tool_call_text("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
    ),
    # Python 3.12 in a 3.11 sandbox: runs on the venv's own mounted interpreter.
    "openhands": Cli(
        "openhands-venv",
        "pip",
        lambda cmd: tool_call_text("terminal", {"command": cmd, "security_risk": "LOW"}),
        "All done.",
    ),
}


def host_install(cli: Cli) -> Path:
    path = REPO_ROOT / ".cache" / cli.install
    if not path.is_dir():
        reason = f"no host install at {path} (run scripts/setup)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and this test needs {reason}", pytrace=False)
        pytest.skip(reason)
    return path


@pytest.mark.parametrize("name", sorted(CLIS))
def test_cli_trial_in_docker_is_graded(
    name: str, tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient
) -> None:
    cli = CLIS[name]
    installed = str(host_install(cli))
    mount = NPM_DIR if cli.kind == "npm" else f"{ROOT}/venv0/site"
    probe = f"touch {mount}/probe 2>&1; echo write-exit=$?"
    # Encoded: some CLIs run commands with /bin/sh (dash) and the solution is bash; OpenHands 1.16
    # ends its conversation on a command holding Rich markup, as the solution's `[server\\]` is.
    solve = base64.b64encode(solution_command(load_task(TASK)).encode()).decode()
    command = f"echo {solve} | base64 -d | bash; {probe}"  # one line: OpenHands runs one command per call
    tools = (
        {"sandbox.harness_tools.npm_dir": installed}
        if cli.kind == "npm"
        else {"sandbox.harness_tools.pip_venvs": f"[{installed}]"}
    )

    async def main() -> tuple[dict[str, pb.Trajectory], list[str], list[dict[str, Any]]]:
        # Real CLI system prompts run to tens of thousands of demo-tokenizer tokens.
        with engine_on_host(tokenizer, max_model_len=131072) as (engine, _, engine_port):
            engine.push(cli.shell(command), cli.last)
            config = scripted_server_config(
                f"http://127.0.0.1:{engine_port}",
                **{
                    **tools,
                    "proxy.max_total_tokens": 1_000_000,
                    # OpenHands spends ~30 s importing itself on the task's one CPU; a loaded CI host, more.
                    "fleet.agent_timeout_s": 180,
                },
            )
            async with running_server(config, tokenizer_dir) as server:
                request = pb.RolloutRequest(
                    request_id=f"cli-{name}",
                    tasks=[pb.TaskRef(location=str(TASK))],
                    harness_configs=[pb.HarnessConfig(name=name, config_id=name)],
                    group_size=1,
                )
                results = await asyncio.wait_for(rollout(server.address, request), timeout=300)
            return results, [engine.tokenizer.decode(p) for p in engine.log.prompts], engine.log.replies

    results, prompts, replies = asyncio.run(main())

    trajectory = results["edit-config"]
    assert trajectory.status == pb.TRIAL_STATUS_OK, (trajectory.error, prompts[-1][-1500:] if prompts else "")
    assert trajectory.reward == 1.0, prompts[-1][-1500:]
    assert trajectory.metrics.model_calls == 2, [p[-300:] for p in prompts]
    (sequence,) = [s for s in trajectory.sequences if not s.side_call]
    assert sequence.num_model_calls == 2  # the tool turn and the final turn merged into one sequence
    assert (sequence.root_reason, sequence.recomputed_tokens) == ("first_call", 0)
    # Every token the engine sampled is captured once, in order, with its logprob.
    sampled = [
        (t, lp)
        for t, m, lp in zip(sequence.token_ids, sequence.loss_mask, sequence.behavior_logprobs, strict=True)
        if m
    ]
    assert [t for t, _ in sampled] == [t for r in replies for t in r["token_ids"]]
    assert [lp for _, lp in sampled] == pytest.approx([lp for r in replies for lp in r["logprobs"]], rel=1e-6)
    # The tool's output reached the second prompt: the write was refused by the mount itself,
    # not by file permissions, so root (the verifier's user) cannot write there either.
    assert "Read-only file system" in prompts[-1] and "write-exit=1" in prompts[-1], prompts[-1][-1500:]
    assert trial_containers(docker_client) == []
