#!/usr/bin/env python3
"""An adapter version against a full version, into the real vLLM (set-up's CPU build).

One vLLM, launched as the project launches it (`start_engine`, float32, with
`--enable-lora`), serves a tiny random Qwen3. Each round draws adapters (random
non-zero B) and publishes them both ways, in alternating order:
- adapter: `save_peft` into the version's own directory, then the served adapter
  replaced (`replace_adapter`: vLLM's /v1/unload_lora_adapter, /v1/load_lora_adapter)
  and the weights labelled;
- full: `DirectoryPublisher.publish` of the merged model (float32), then the
  client's `update_weights` (pause → reload → reset prefix cache → label → resume).
It prints bytes on disk and the median wall seconds of each part, and the ratios
full / adapter. Then what decoding costs (median seconds of one completion): the
base model, through the adapter, and through it after vLLM's own in-place
replacement (load_inplace), which the client's replace_adapter avoids. Last, the
bytes of both at Qwen3-0.6B's shape, computed from its shapes (torch's meta
device: nothing is allocated).

    LEGORL_VLLM=.cache/vllm-venv/bin/vllm .venv/bin/python scripts/bench_lora_publish.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from legorl_jax.models.transformer import CausalLM
    from legorl_jax.train.publish import DirectoryPublisher
    from rollout_server.backends.client import SyncEngineClient
    from rollout_server.backends.launch import ManagedEngine

ADAPTER = "policy"  # the model name requests give to sample through the adapter
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Qwen3-0.6B's config.json (the fields that set parameter shapes).
QWEN3_06B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
)  # fmt: skip


def adapted(base: Path, rank: int, seed: int) -> CausalLM:
    """The base checkpoint with rank-`rank` adapters on TARGETS, B drawn (a fresh B is zero)."""
    import jax

    from legorl_jax.models import from_hf
    from legorl_jax.models.lora import adapted as adapted_projections
    from legorl_jax.models.lora import add_adapters

    model = from_hf(base)
    add_adapters(model, rank=rank, alpha=2.0 * rank, targets=TARGETS, seed=seed)
    key = jax.random.key(seed)
    for _, module in adapted_projections(model):
        key, sub = jax.random.split(key)
        assert module.lora_b is not None
        b = module.lora_b.get_value()
        module.lora_b.set_value(jax.random.normal(sub, b.shape, b.dtype))
    return model


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


Timed = tuple[dict[str, float], Path]  # (wall seconds of "publish" and "load", the version's directory)


def adapter_version(client: SyncEngineClient, model: CausalLM, out: Path, version: int) -> Timed:
    """save_peft into the version's own directory, then the served adapter replaced and labelled."""
    from legorl_jax.models.lora import save_peft

    start = time.perf_counter()
    save_peft(model, out)
    published = time.perf_counter()
    client.replace_adapter(ADAPTER, str(out))
    client.label_weights(str(version))
    return {"publish": published - start, "load": time.perf_counter() - published}, out


def full_version(client: SyncEngineClient, publisher: DirectoryPublisher, model: CausalLM, version: int) -> Timed:
    """The merged model published, then the client's update_weights (which labels it)."""
    start = time.perf_counter()
    location = publisher.publish(model, version)
    published = time.perf_counter()
    client.update_weights(location, version=str(version))
    return {"publish": published - start, "load": time.perf_counter() - published}, Path(location)


def decode_s(client: SyncEngineClient, tokens: int) -> float:
    """Wall seconds of one completion of `tokens` tokens (seeded, ignoring EOS)."""
    start = time.perf_counter()
    client.complete([1, 2, 3], max_tokens=tokens, seed=1, ignore_eos=True)
    return time.perf_counter() - start


def load_inplace(client: SyncEngineClient, adapter_dir: Path) -> None:
    """vLLM's own in-place replacement (load_inplace), which the client's replace_adapter avoids."""
    import httpx

    body = {"lora_name": ADAPTER, "lora_path": str(adapter_dir), "load_inplace": True}
    httpx.post(f"{client.base_url}/v1/load_lora_adapter", json=body, timeout=60).raise_for_status()


def decode_costs(engine: ManagedEngine, root: Path, tokens: int, rounds: int) -> dict[str, float]:
    """Median decode seconds: the base model, through the adapter after replace_adapter, and
    after load_inplace (every later request then carries the flag that reloads it each step)."""
    base, through = engine.sync_client(timeout=300), engine.sync_client(timeout=300, model=ADAPTER)
    adapters = sorted((root / "adapters").iterdir())
    try:
        base.replace_adapter(ADAPTER, str(adapters[0]))
        for warm_up in (base, through):
            decode_s(warm_up, tokens)
        out = {"base": [decode_s(base, tokens) for _ in range(rounds)]}
        out["adapter"] = [decode_s(through, tokens) for _ in range(rounds)]
        load_inplace(base, adapters[1])
        out["adapter after load_inplace"] = [decode_s(through, tokens) for _ in range(rounds)]
    finally:
        base.close()
        through.close()
    return {name: statistics.median(seconds) for name, seconds in out.items()}


def shape_bytes(rank: int) -> dict[str, int]:
    """Qwen3-0.6B's bytes: the adapters as save_peft writes them (float32), the full model in float32 and bf16."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_06B))
    full = sum(p.numel() for p in model.parameters())  # a tied head is one parameter: counted once
    lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    adapter = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    return {"adapter_f32": 4 * adapter, "full_f32": 4 * full, "full_bf16": 2 * full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=400, help="tokens per completion in the decode costs")
    args = parser.parse_args()

    from legorl_jax.core.config import EngineConfig
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.models.lora import save_peft
    from legorl_jax.train.publish import DirectoryPublisher
    from rollout_server.backends.launch import start_engine

    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    base = build_tiny_hf_model(root / "base", seed=0, head_dim=32, max_position_embeddings=1024)
    lora = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "1"]
    config = EngineConfig(kind="vllm", port=0, max_batch=4, max_context=1024, dtype="float32", extra_args=lora)
    engine = start_engine(config, base)
    client = engine.sync_client(timeout=300)
    publisher = DirectoryPublisher(root / "published", tokenizer_from=base)
    runs: dict[str, list[dict[str, float]]] = {"adapter": [], "full": []}
    sizes: dict[str, int] = {}
    try:
        client.load_adapter(ADAPTER, str(save_peft(adapted(base, args.rank, 0), root / "adapters" / "v0")))
        for version in range(1, args.rounds + 2):  # version 1 warms both up (the merged export compiles)
            model = adapted(base, args.rank, version)
            ways: dict[str, Callable[[], Timed]] = {
                "adapter": partial(adapter_version, client, model, root / "adapters" / f"v{version}", version),
                "full": partial(full_version, client, publisher, model, version),
            }
            # Alternating order, so that load from other processes on a shared machine hits both alike.
            for kind in sorted(ways, reverse=version % 2 == 0):
                seconds, out = ways[kind]()
                sizes[kind] = dir_bytes(out)
                if version > 1:
                    runs[kind].append(seconds)
        decode = decode_costs(engine, root, args.decode_tokens, args.rounds)
    finally:
        client.close()
        engine.stop()
    report(runs, sizes, args.rank)
    for name, wall in decode.items():
        print(f"decode {args.decode_tokens} tokens, {name}: {wall:.3f} s ({wall / decode['base']:.2f}x base)")


def report(runs: dict[str, list[dict[str, float]]], sizes: dict[str, int], rank: int) -> None:
    """Medians per part, and full / adapter ratios."""
    med = {kind: {part: statistics.median(r[part] for r in rs) for part in ("publish", "load")}
           for kind, rs in runs.items()}  # fmt: skip
    for kind in ("adapter", "full"):
        m = med[kind]
        print(f"{kind:8s} {sizes[kind]:>10,} B  publish {m['publish']:.4f} s  load {m['load']:.4f} s  "
              f"total {m['publish'] + m['load']:.4f} s  (median of {len(runs[kind])})")  # fmt: skip
    ratios = {part: med["full"][part] / med["adapter"][part] for part in ("publish", "load")}
    total = sum(med["full"].values()) / sum(med["adapter"].values())
    print(f"full / adapter: bytes {sizes['full'] / sizes['adapter']:.1f}x, publish {ratios['publish']:.1f}x, "
          f"load {ratios['load']:.1f}x, total {total:.1f}x")  # fmt: skip
    for r in sorted({rank, 32}):
        b = shape_bytes(r)
        print(f"qwen3-0.6b, rank {r}: adapter {b['adapter_f32']:,} B (float32); full {b['full_f32']:,} B float32 "
              f"({b['full_f32'] / b['adapter_f32']:.0f}x), {b['full_bf16']:,} B bf16 "
              f"({b['full_bf16'] / b['adapter_f32']:.0f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
