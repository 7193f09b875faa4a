"""The real vLLM (set-up's CPU build) serving our PEFT adapters: launched by `start_engine`
with `--enable-lora`, an adapter `save_peft` exported is loaded while it runs, and the
prompt logprobs of requests naming it equal transformers + peft's (float32); a new
version replaces it (unload + load); tokens sampled through it carry the weights' label.
A completion in flight when the adapter is replaced finishes on the old adapter, under the
new label. Last, one adapter version (save_peft + load) against one full version (publish +
reload) on the same engine: bytes on disk and wall seconds, printed (`-s`).

One vLLM serves the module (each start takes 60-90 s on CPU); the tests run in file order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from legorl_jax.core.config import EngineConfig
from rollout_server.backends.client import SyncEngineClient, TokenCompletion
from rollout_server.backends.launch import ManagedEngine

from .vllm_host import Reference, max_abs_diff

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 2e-3  # vLLM (float32, CPU) against transformers (float32), as in test_vllm_host.py
RANK, ALPHA = 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = "policy"  # the model name requests give to sample through the adapter
FIXED_TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five\n<|im_end|>"
FULL = dict(temperature=1.0, top_p=1.0, top_k=-1)
CONTEXT = 2048  # room for a completion long enough that an adapter replacement lands in its middle
LONG = 1500  # that completion's tokens


class PeftReference(Reference):
    """transformers' float32 logprobs of the base checkpoint with a PEFT adapter on it."""

    def __init__(self, model_dir: Path, adapter_dir: Path) -> None:
        import peft

        super().__init__(model_dir)
        self.model = peft.PeftModel.from_pretrained(self.model, adapter_dir).eval()


@dataclasses.dataclass
class Assets:
    root: Path
    base: Path
    adapters: list[Path]  # two versions of the adapter, each with a random (non-zero) B
    ids: list[int]
    base_ref: Reference
    refs: list[PeftReference]


def adapted_model(base: Path, seed: int):  # noqa: ANN201 (a CausalLM; flax is imported lazily)
    """The base checkpoint with adapters whose B is drawn (a fresh B is zero: no test at all)."""
    import jax

    from legorl_jax.models import from_hf
    from legorl_jax.models.lora import adapted, add_adapters

    model = from_hf(base)
    add_adapters(model, rank=RANK, alpha=ALPHA, targets=TARGETS, seed=seed)
    key = jax.random.key(seed)
    for _, module in adapted(model):
        key, sub = jax.random.split(key)
        b = module.lora_b.get_value()
        module.lora_b.set_value(jax.random.normal(sub, b.shape, b.dtype))
    return model


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    from transformers import AutoTokenizer

    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.models.lora import save_peft

    root = tmp_path_factory.mktemp("vllm-lora")
    # head_dim 32: the smallest vLLM's CPU attention takes.
    base = build_tiny_hf_model(root / "base", seed=0, head_dim=32, max_position_embeddings=CONTEXT)
    adapters = [
        save_peft(adapted_model(base, seed), root / "adapters" / f"v{seed}", base_model=str(base)) for seed in (1, 2)
    ]
    ids = list(AutoTokenizer.from_pretrained(base)(FIXED_TEXT)["input_ids"])
    return Assets(root, base, adapters, ids, Reference(base), [PeftReference(base, a) for a in adapters])


def lora_engine_config(max_context: int = CONTEXT) -> EngineConfig:
    """float32 (else the CPU build serves the float32 checkpoint as bfloat16), LoRA up to RANK, one adapter."""
    lora = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1"]
    return EngineConfig(kind="vllm", port=0, max_batch=4, max_context=max_context, dtype="float32", extra_args=lora)


@pytest.fixture(scope="module")
def engine(assets: Assets) -> Iterator[ManagedEngine]:
    from rollout_server.backends.launch import start_engine

    launched = start_engine(lora_engine_config(), assets.base)  # returns once /health answers
    try:
        yield launched
    finally:
        launched.stop()


@pytest.fixture(scope="module")
def base_client(engine: ManagedEngine) -> Iterator[SyncEngineClient]:
    client = engine.sync_client(timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="module")
def adapter_client(engine: ManagedEngine) -> Iterator[SyncEngineClient]:
    """Requests naming the adapter: vLLM samples them through it."""
    client = engine.sync_client(timeout=300, model=ADAPTER)
    yield client
    client.close()


def prompt_logprobs(client: SyncEngineClient, ids: list[int]) -> list[float | None]:
    """The engine's prompt logprobs of `ids` (temperature 1), entries 1 .. n-1."""
    (choice,) = client.complete(ids, max_tokens=1, prompt_logprobs=0, **FULL)
    assert choice.prompt_logprobs is not None and len(choice.prompt_logprobs) == len(ids)
    return choice.prompt_logprobs[1:]


def served_diff(client: SyncEngineClient, assets: Assets, ref: Reference) -> float:
    return max_abs_diff(prompt_logprobs(client, assets.ids), ref.logprobs(assets.ids))


def test_the_adapter_serves_peft_logprobs(
    assets: Assets, base_client: SyncEngineClient, adapter_client: SyncEngineClient
) -> None:
    assert "added successfully" in base_client.load_adapter(ADAPTER, str(assets.adapters[0]))
    adapter_diff = served_diff(adapter_client, assets, assets.refs[0])
    base_diff = served_diff(base_client, assets, assets.base_ref)
    print(f"\nmax |vLLM - transformers+peft| {adapter_diff:.3g}; base {base_diff:.3g}")
    assert adapter_diff < TOLERANCE and base_diff < TOLERANCE
    # The check tells the adapter from the base: the adapter moves the logprobs by far more than the tolerance.
    apart = max_abs_diff(assets.refs[0].logprobs(assets.ids), assets.base_ref.logprobs(assets.ids))
    print(f"max |adapter - base| (transformers) {apart:.3g}")
    assert apart > 100 * TOLERANCE, apart


def test_a_new_version_replaces_the_adapter(
    assets: Assets, base_client: SyncEngineClient, adapter_client: SyncEngineClient
) -> None:
    """replace_adapter from the new version's own directory: the same name serves the new weights."""
    base_client.replace_adapter(ADAPTER, str(assets.adapters[1]))
    diff = served_diff(adapter_client, assets, assets.refs[1])
    print(f"\nreplaced: max |vLLM - transformers+peft| {diff:.3g}")
    assert diff < TOLERANCE
    apart = max_abs_diff(assets.refs[0].logprobs(assets.ids), assets.refs[1].logprobs(assets.ids))
    assert apart > 100 * TOLERANCE, apart


def test_an_unloaded_adapter_is_refused_and_loads_again(
    assets: Assets, base_client: SyncEngineClient, adapter_client: SyncEngineClient
) -> None:
    from rollout_server.backends.client import EngineError

    base_client.unload_adapter(ADAPTER)
    with pytest.raises(EngineError) as refused:
        prompt_logprobs(adapter_client, assets.ids)
    assert refused.value.status == 404, refused.value
    base_client.load_adapter(ADAPTER, str(assets.adapters[0]))
    assert served_diff(adapter_client, assets, assets.refs[0]) < TOLERANCE


def test_tokens_sampled_through_the_adapter_carry_the_weights_label(
    assets: Assets, base_client: SyncEngineClient, adapter_client: SyncEngineClient
) -> None:
    assert base_client.label_weights("7")
    (choice,) = adapter_client.complete(
        assets.ids, max_tokens=6, ignore_eos=True, return_weight_versions=True, seed=3, **FULL
    )
    assert choice.weight_versions == [("7", 0, 6)]
    # Each sampled token's logprob is the adapted model's, in its context.
    expected = assets.refs[0].logprobs(assets.ids + choice.token_ids)[len(assets.ids) - 1 :]
    diff = max_abs_diff(choice.logprobs, expected)
    print(f"\nsampled through the adapter: max |vLLM - transformers+peft| {diff:.3g}")
    assert diff < TOLERANCE


def test_a_request_in_flight_finishes_on_the_adapter_it_started_with(
    engine: ManagedEngine, assets: Assets, base_client: SyncEngineClient
) -> None:
    """What replace_adapter does to a completion in flight through the adapter: it goes on with
    the old adapter (its request holds it; vLLM reads it again from its directory, which must
    outlive the request). The engine's weight label is global, so tokens decoded after the relabel
    carry the new version: wrong for adapters, which bind to a request when it starts (a vLLM host
    labels adapter requests itself: rollout_server/backends/adapters.py). When the relabel lands
    depends on vLLM's pace here: the replacement may be held until the request ends (every token
    "old"), or land mid-completion (a split); either way every token comes from the old adapter."""
    assert base_client.label_weights("old")

    async def replace_mid_completion() -> TokenCompletion:
        async with engine.client(model=ADAPTER) as through_adapter:
            await through_adapter.model()  # asked now, so the completion's request goes out at once
            running = asyncio.ensure_future(
                through_adapter.complete(
                    assets.ids, max_tokens=LONG, seed=9, ignore_eos=True, return_weight_versions=True, **FULL
                )
            )
            await asyncio.sleep(1.0)  # about 150 tokens decoded at 2 cores' pace: mid-completion
            assert not running.done(), "the completion ended before the replacement: too fast to test here"
            await base_client.async_client.replace_adapter(ADAPTER, str(assets.adapters[1]))
            await base_client.async_client.label_weights("new")
            return (await running)[0]

    choice = base_client.run(replace_mid_completion())
    assert choice.weight_versions is not None
    assert [v for v, _, _ in choice.weight_versions] in (["old"], ["old", "new"])
    ids = assets.ids + choice.token_ids
    old, new = (ref.logprobs(ids)[len(assets.ids) - 1 :] for ref in assets.refs)
    assert max_abs_diff(choice.logprobs, old) < TOLERANCE  # every token, any relabelled ones too, from the old
    assert max_abs_diff(choice.logprobs, new) > 100 * TOLERANCE
    split = choice.weight_versions[0][2]
    if split < len(choice.token_ids):
        labelled_new = choice.logprobs[split:]
        to_old, to_new = max_abs_diff(labelled_new, old[split:]), max_abs_diff(labelled_new, new[split:])
        print(f"\nin flight, tokens labelled new: max diff to the old adapter {to_old:.3g}, to the new {to_new:.3g}")
        assert max_abs_diff(labelled_new, new[split:]) > 100 * TOLERANCE


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_an_adapter_version_is_smaller_than_a_full_one(
    assets: Assets, base_client: SyncEngineClient, adapter_client: SyncEngineClient
) -> None:
    """One adapter version (save_peft, then replace the served adapter and label) against one
    full version (DirectoryPublisher's merged checkpoint, then the client's update_weights)."""
    from legorl_jax.models.lora import save_peft
    from legorl_jax.train.publish import DirectoryPublisher

    model = adapted_model(assets.base, seed=3)
    started = time.monotonic()
    adapter = save_peft(model, assets.root / "adapters" / "v3", base_model=str(assets.base))
    base_client.replace_adapter(ADAPTER, str(adapter))
    base_client.label_weights("8")
    adapter_s = time.monotonic() - started
    adapter_diff = served_diff(adapter_client, assets, PeftReference(assets.base, adapter))

    started = time.monotonic()
    full = Path(DirectoryPublisher(assets.root / "published", tokenizer_from=assets.base).publish(model, 8))
    base_client.update_weights(str(full), version="8")
    full_s = time.monotonic() - started
    # The merged checkpoint is the adapted model; with LoRA on, the reload keeps the adapter on the new base.
    full_diff = served_diff(base_client, assets, PeftReference(assets.base, adapter))
    stacked_diff = served_diff(adapter_client, assets, PeftReference(full, adapter))

    # One round, the merged export's compilation included: scripts/bench_lora_publish.py times warm rounds.
    adapter_bytes, full_bytes = dir_bytes(adapter), dir_bytes(full)
    print(
        f"\nadapter version: {adapter_bytes:,} bytes, {adapter_s:.3f} s; full: {full_bytes:,} bytes, {full_s:.3f} s"
        f"\nmax |vLLM - transformers+peft|: adapter {adapter_diff:.3g}, merged {full_diff:.3g}, "
        f"adapter on merged {stacked_diff:.3g}"
    )
    assert adapter_bytes < full_bytes
    assert max(adapter_diff, full_diff, stacked_diff) < TOLERANCE
