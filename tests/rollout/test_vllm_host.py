"""A rollout host on the real vLLM (set-up's CPU build), launched and supervised by
the server (`engine.kind=vllm`), end to end over gRPC with Docker sandboxes: a
lego trial and a Claude Code trial through the proxy, UpdateWeights to a
published version, a `kill -9` of the engine mid-trial that the supervisor
recovers from on the latest weights, and an UpdateWeights that lands while a
trial's completion is at the engine. What the engine serves is checked by its
logprobs against transformers' (float32) on the checkpoint, never by a label alone.

One vLLM serves the whole module (each start takes 60-90 s on CPU); the tests
run in file order and build on each other's state: base weights, then the
published version, then the restart after the crash, then the next version (or the next few:
the last test may try more than once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import grpc
import pytest

from legorl_jax.core.config import REPO_ROOT
from legorl_jax.core.weight_layout import read_manifest
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.proxy.engine_client import CompletionParams, EngineCompletion, ProxyEngineClient
from rollout_server.tasks import DEMO_TASKS_DIR

from .stack import lego, rollout, rollout_request, server_config, task_variant, trial_containers, until
from .test_cli_in_docker import CLIS, host_install
from .vllm_host import BackgroundServer, Reference, max_abs_diff, sampled_logprob_diff

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]

VERSION = 5  # the published version the host is updated to
# The versions that land mid-trial, one a try: the base weights and VERSION's, published again in turn.
AFTER = (6, 7, 8)
CONTEXT = 131072  # a real CLI's prompt runs to tens of thousands of demo-tokenizer tokens
TOLERANCE = 2e-3  # vLLM (float32, CPU) against transformers (float32) on the same checkpoint
# A fixed prompt, not the weight probe's own sequence (the host already checks that one).
FIXED_TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five\n<|im_end|>"
# temperature 1, no top-k/top-p: the behaviour logprobs are the model's own log-softmax.
FULL = dict(temperature=1.0, top_p=1.0, top_k=-1)


@dataclasses.dataclass
class Assets:
    base: Path  # the checkpoint the host starts on
    version: Path  # VERSION as the learner publishes it, of another (sharper) model
    after: dict[int, Path]  # each of AFTER as the learner publishes it
    fixed_ids: list[int]
    base_ref: Reference
    version_ref: Reference


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    from transformers import AutoTokenizer

    from legorl_jax.models import from_hf
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.publish import DirectoryPublisher

    root = tmp_path_factory.mktemp("vllm-host")
    # head_dim 32: the smallest vLLM's CPU attention takes.
    base = build_tiny_hf_model(root / "base", seed=0, head_dim=32, max_position_embeddings=CONTEXT)
    other = build_tiny_hf_model(
        root / "other", seed=3, head_dim=32, max_position_embeddings=CONTEXT, tokenizer_dir=base
    )
    model = from_hf(other)
    # Sharper logits (tied head): a random model predicts near-uniformly, so two would differ too little to tell.
    model.embed_tokens.embedding.value = model.embed_tokens.embedding.value * 8.0
    publisher = DirectoryPublisher(root / "published", tokenizer_from=base, keep=1 + len(AFTER))
    version = Path(publisher.publish(model, VERSION))
    after = {v: Path(publisher.publish(from_hf(base) if i % 2 == 0 else model, v)) for i, v in enumerate(AFTER)}
    ids = AutoTokenizer.from_pretrained(base)(FIXED_TEXT)["input_ids"]
    return Assets(base, version, after, list(ids), Reference(base), Reference(version))


@pytest.fixture(scope="module")
def host(assets: Assets) -> Iterator[BackgroundServer]:
    config = server_config(
        **{
            "engine.kind": "vllm",
            "engine.dtype": "float32",  # else vLLM's CPU build serves the float32 checkpoint as bfloat16
            "engine.max_context": CONTEXT,
            "tasks.demo": "false",
            "proxy.max_total_tokens": 1_000_000,
            "proxy.max_model_calls": 8,  # a CLI answered by a random model may come back a few times
            "fleet.agent_timeout_s": 180,
            **_cli_tools(),
        }
    )
    server = BackgroundServer(config, assets.base)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-host-tasks")


def _cli_tools() -> dict[str, str]:
    """Mounts for the Claude Code trial, where set-up installed it (its test fails or skips otherwise)."""
    npm = REPO_ROOT / ".cache" / CLIS["claude-code"].install
    return {"sandbox.harness_tools.npm_dir": str(npm)} if npm.is_dir() else {}


def _request(name: str, root: Path, max_tokens: int, **lego_options: str) -> pb.RolloutRequest:
    request = rollout_request(name, [task_variant(root, name)], lego(**lego_options))
    request.sampling.CopyFrom(pb.SamplingParams(max_tokens=max_tokens, **FULL))
    return request


def _engine_prompt_logprobs(host: BackgroundServer, ids: list[int]) -> list[float | None]:
    """The served engine's prompt logprobs of `ids` (temperature 1), entries 1 .. n-1."""
    assert host.server.engine is not None
    client = host.server.engine.sync_client(timeout=120)
    try:
        (choice,) = client.complete(ids, max_tokens=1, prompt_logprobs=0, **FULL)
    finally:
        client.close()
    assert choice.prompt_logprobs is not None and len(choice.prompt_logprobs) == len(ids)
    return choice.prompt_logprobs[1:]


def _check_served(host: BackgroundServer, assets: Assets, ref: Reference, other: Reference) -> None:
    """The engine computes `ref`'s logprobs of the fixed sequence, and these are far from `other`'s."""
    served = _engine_prompt_logprobs(host, assets.fixed_ids)
    expected, elsewhere = ref.logprobs(assets.fixed_ids), other.logprobs(assets.fixed_ids)
    assert max_abs_diff(served, expected) < TOLERANCE, (served, expected)
    assert max_abs_diff(expected, elsewhere) > 100 * TOLERANCE  # the check tells the two checkpoints apart


def _check_trial(trajectory: pb.Trajectory, ref: Reference, version: int) -> None:
    """Every sampled token carries a finite behaviour logprob that `ref` computes too, and `version`'s label."""
    assert trajectory.sequences, trajectory.error
    sampled = 0
    for seq in trajectory.sequences:
        assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.behavior_logprobs)
        lps = [lp for lp, m in zip(seq.behavior_logprobs, seq.loss_mask, strict=True) if m]
        assert lps and all(math.isfinite(lp) and lp <= 0.0 for lp in lps)
        count, diff = sampled_logprob_diff(seq, ref)
        assert count == len(lps) and diff < TOLERANCE, diff
        sampled += count
        # The engine's own per-token labels (vLLM 0.32's generate route reports them).
        assert seq.unreported_version_tokens == 0 and seq.policy_version == version
        assert set(seq.version_runs) == {version} and sum(seq.version_run_lengths) == len(lps)
    assert sampled == trajectory.metrics.completion_tokens


def _status(host: BackgroundServer) -> pb.ServerStatus:
    async def call() -> pb.ServerStatus:
        async with grpc.aio.insecure_channel(host.address) as channel:
            return await pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest())

    return asyncio.run(call())


@pytest.fixture(scope="module")
def updated(host: BackgroundServer, assets: Assets) -> pb.UpdateWeightsResponse:
    """UpdateWeights to VERSION, as the learner's fleet sends it."""

    async def call() -> pb.UpdateWeightsResponse:
        async with grpc.aio.insecure_channel(host.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            return await stub.UpdateWeights(pb.UpdateWeightsRequest(version=VERSION, location=str(assets.version)))

    return asyncio.run(call())


def test_a_lego_trial_samples_from_vllm_through_the_proxy(host: BackgroundServer, assets: Assets, tasks: Path) -> None:
    status = _status(host)
    assert status.engine_healthy and status.loaded_policy_version == 0
    _check_served(host, assets, assets.base_ref, assets.version_ref)
    trajectory = asyncio.run(rollout(host.address, _request("vllm-base", tasks, 24)))["vllm-base"]
    assert trajectory.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), trajectory.error
    assert trajectory.HasField("reward") and trajectory.metrics.model_calls >= 1
    _check_trial(trajectory, assets.base_ref, 0)


@pytest.mark.npm
def test_a_claude_code_trial_samples_from_vllm_through_the_proxy(
    host: BackgroundServer, assets: Assets, docker_client: docker.DockerClient
) -> None:
    """The real CLI, its whole system prompt and tool list, rendered by the proxy and sampled by
    vLLM: a random model solves nothing, and every token it sampled is captured with its logprob."""
    host_install(CLIS["claude-code"])
    request = pb.RolloutRequest(
        request_id="vllm-claude-code",
        tasks=[pb.TaskRef(location=str(DEMO_TASKS_DIR / "edit-config"))],
        harness_configs=[pb.HarnessConfig(name="claude-code", config_id="claude-code")],
        group_size=1,
        sampling=pb.SamplingParams(max_tokens=48, **FULL),
    )
    trajectory = asyncio.run(rollout(host.address, request))["edit-config"]
    assert trajectory.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), trajectory.error
    assert trajectory.HasField("reward") and trajectory.reward == 0.0  # graded by the verifier, and unearned
    main = [s for s in trajectory.sequences if not s.side_call]
    assert main and list(main[0].loss_mask).index(1) > 10_000  # its first prompt: the CLI's own, whole
    _check_trial(trajectory, assets.base_ref, 0)
    assert trial_containers(docker_client) == []


def test_update_weights_serves_the_published_version(
    host: BackgroundServer, assets: Assets, tasks: Path, updated: pb.UpdateWeightsResponse
) -> None:
    # Either path will do: an in-place reload that passes the probe, or the restart a failed probe forces.
    assert updated.loaded_version == VERSION and updated.update_path in ("reload", "restart")
    assert 0 <= updated.probe_max_abs_diff < TOLERANCE
    assert host.server.engine is not None and host.server.engine.supervisor is not None
    assert _status(host).loaded_policy_version == VERSION
    _check_served(host, assets, assets.version_ref, assets.base_ref)
    trajectory = asyncio.run(rollout(host.address, _request("vllm-updated", tasks, 24)))["vllm-updated"]
    assert trajectory.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), trajectory.error
    _check_trial(trajectory, assets.version_ref, VERSION)


def test_a_killed_engine_ends_its_trial_and_comes_back_on_the_latest_weights(
    host: BackgroundServer,
    assets: Assets,
    tasks: Path,
    updated: pb.UpdateWeightsResponse,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = host.server.engine
    assert engine is not None and engine.supervisor is not None
    supervisor = engine.supervisor
    assert updated.loaded_version == VERSION
    installed = engine.installed()
    assert installed is not None and read_manifest(Path(installed)).version == VERSION  # type: ignore[union-attr]
    epoch, restarts, pid = engine.epoch(), supervisor.restarts, supervisor.pid
    assert pid is not None

    # plan_first: a planning call, then the agent's turn. The engine dies as that turn's call goes
    # out to it, after the trial has sampled its plan. The kill is made by the proxy's own engine
    # client (a fault injected here): watching for the call from outside raced calls that a random
    # model answers in a few milliseconds.
    request = _request("vllm-killed", tasks, 256, prompt="plan_first")
    forward = ProxyEngineClient.complete
    calls: list[int] = []

    async def complete(self: ProxyEngineClient, prompt_ids: list[int], sampling: CompletionParams) -> EngineCompletion:
        calls.append(len(prompt_ids))
        if len(calls) == 2:
            os.killpg(pid, signal.SIGKILL)  # vLLM's whole process group (its own session)
        return await forward(self, prompt_ids, sampling)

    monkeypatch.setattr(ProxyEngineClient, "complete", complete)
    trajectory = asyncio.run(rollout(host.address, request))["vllm-killed"]
    monkeypatch.undo()
    assert len(calls) == 2, f"the trial made {len(calls)} model calls, not a plan and a turn cut short"
    assert trajectory.status == pb.TRIAL_STATUS_ENGINE_ERROR, (trajectory.status, trajectory.error)
    assert not trajectory.HasField("reward")
    # It died mid-trial: the trial had sampled its plan from it, from VERSION.
    assert trajectory.metrics.model_calls >= 1 and trajectory.sequences
    count, diff = sampled_logprob_diff(trajectory.sequences[0], assets.version_ref)
    assert count > 0 and diff < TOLERANCE

    async def restarted() -> None:
        await until(lambda: engine.epoch() > epoch and supervisor.state == "healthy", "the engine's restart", 300)

    asyncio.run(restarted())
    assert supervisor.pid != pid and supervisor.restarts == restarts + 1
    assert supervisor.plan.command[2] == installed  # relaunched on the latest installed weights
    assert _status(host).loaded_policy_version == VERSION
    _check_served(host, assets, assets.version_ref, assets.base_ref)
    trajectory = asyncio.run(rollout(host.address, _request("vllm-after", tasks, 24)))["vllm-after"]
    assert trajectory.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), trajectory.error
    _check_trial(trajectory, assets.version_ref, VERSION)


def test_an_update_mid_trial_splits_its_completion_by_version(
    host: BackgroundServer, assets: Assets, tasks: Path
) -> None:
    """UpdateWeights over gRPC while the trial's first completion is at the engine (keep mode):
    the completion goes on, its first tokens sampled by the old version and the rest by the new,
    and the Trajectory says so per token, each logprob from the weights that sampled it. Those
    after the update match the new weights on the whole context: no KV the old weights computed
    was kept.

    On a 2-core machine the update can miss the completion either way: vLLM's decode loop can
    starve it for seconds, past the completion's end (every token carries the old label), or
    the pause can land while the request waits for its first step (every token carries the new
    one). Such a try proves nothing, and the next updates to the next of AFTER; a pause that
    never held a completion mid-decode fails every try."""
    assert _status(host).loaded_policy_version == VERSION
    refs = {VERSION: assets.version_ref} | {
        v: (assets.base_ref, assets.version_ref)[i % 2] for i, v in enumerate(AFTER)
    }
    old = VERSION
    for new in AFTER:
        if _update_mid_trial(host, assets, tasks, old, new, refs):
            _check_served(host, assets, refs[new], refs[old])
            return
        old = new
    pytest.fail(f"no update landed inside the first completion, in {len(AFTER)} tries")


def _update_mid_trial(
    host: BackgroundServer, assets: Assets, tasks: Path, old: int, new: int, refs: dict[int, Reference]
) -> bool:
    """One try of the test above: True when the split was caught and checked, False when the
    update reached the engine before the first completion's first token or after its last. (Whether the proxy had
    its answer when the update returned says nothing: the answer may be on its way.)"""
    request = _request(f"vllm-in-flight-{new}", tasks, 1024)
    request.sampling.seed = 11  # the same completion each run, long enough to be caught

    def call_at_engine() -> bool:
        started, answered = host.model_calls()
        return started >= 1 and answered < started

    async def update_mid_trial() -> tuple[pb.UpdateWeightsResponse, pb.Trajectory]:
        trial = asyncio.create_task(rollout(host.address, request))
        async with grpc.aio.insecure_channel(host.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            await stub.GetStatus(pb.GetStatusRequest())  # connected now, so the update goes out at once
            deadline = time.monotonic() + 120
            while not call_at_engine():
                assert not trial.done(), "the trial ended before its first model call was seen"
                assert time.monotonic() < deadline, "gave up waiting for the trial's first model call"
                await asyncio.sleep(0.002)
            loaded = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=new, location=str(assets.after[new])))
        return loaded, (await trial)[request.request_id]

    loaded, trajectory = asyncio.run(update_mid_trial())
    assert loaded.loaded_version == new and loaded.update_path == "reload", loaded
    assert trajectory.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), trajectory.error
    first = trajectory.sequences[0]
    runs = list(first.version_runs)
    assert first.unreported_version_tokens == 0 and first.policy_version == runs[0], first
    if runs in ([old], [new]):
        return False
    assert list(first.version_runs) == [old, new], list(first.version_runs)
    before, since = first.version_run_lengths
    # The split falls inside the first completion (its run of sampled tokens), not between calls.
    mask = list(first.loss_mask)
    start = mask.index(1)
    first_completion = (mask[start:] + [0]).index(0)
    assert 0 < before < first_completion, (before, first_completion)
    count, diff = sampled_logprob_diff(first, refs[old], slice(None, before))
    assert count == before and diff < TOLERANCE, diff
    count, diff = sampled_logprob_diff(first, refs[new], slice(before, None))
    assert count == since and diff < TOLERANCE, diff
    assert all(list(s.version_runs) == [new] for s in trajectory.sequences[1:])
    return True
