"""DirectoryPublisher on a local path and on a tensorstore kvstore (memory://,
standing in for gs://): exact round trip, LATEST, keep-N collection, torn
publishes, and the rollout host resolving what was published."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tensorstore as ts
from flax import nnx

from legorl_jax.core.weight_layout import MANIFEST_FILE
from legorl_jax.models import CausalLM, hf_io
from legorl_jax.train.publish import DirectoryPublisher, PublishError
from rollout_server.weights import resolve_location

SMALL_SHARDS = 16 * 2**10  # several shard files for the tiny model


def versions_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def kv_keys(url: str, context: ts.Context) -> set[str]:
    return {k.decode() for k in ts.KvStore.open(url + "/", context=context).result().list().result()}


class Faulty:
    """Test instrument: wraps a callable and raises on its `fail_at`-th call,
    a crash half-way through writing a version."""

    def __init__(self, wrapped: Callable[..., Any], fail_at: int) -> None:
        self.wrapped, self.fail_at, self.calls = wrapped, fail_at, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("injected: disk gone mid-publish")
        return self.wrapped(*args, **kwargs)


def test_local_publish_round_trips_exactly(
    tmp_path: Path, model: CausalLM, hf_dir: Path, assert_loads_identical: Callable[..., None]
) -> None:
    publisher = DirectoryPublisher(tmp_path / "weights", keep=2, tokenizer_from=hf_dir, max_shard_bytes=SMALL_SHARDS)
    assert publisher.latest() is None
    location = publisher.publish(model, 0)
    assert location == str((tmp_path / "weights" / "v00000000").absolute())
    assert publisher.latest() == location
    assert (Path(location) / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert len(json.loads((Path(location) / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert_loads_identical(location, model)
    assert versions_on_disk(tmp_path / "weights") == ["LATEST", "v00000000"]


def test_keep_n_collects_old_and_abandoned_versions(tmp_path: Path, model: CausalLM) -> None:
    root = tmp_path / "weights"
    publisher = DirectoryPublisher(f"file://{root}", keep=2)
    (root / ".publishing-v00000001-deadbeef").mkdir(parents=True)  # a publish killed earlier
    for version in (1, 2, 3, 4):
        publisher.publish(model, version)
    assert versions_on_disk(root) == ["LATEST", "v00000003", "v00000004"]
    # A resumed run republishes from its checkpoint: later versions belong to the
    # abandoned timeline and go; the one just published always stays.
    location = publisher.publish(model, 3)
    assert versions_on_disk(root) == ["LATEST", "v00000003"]
    assert publisher.latest() == location
    with pytest.raises(ValueError, match="keep"):
        DirectoryPublisher(root, keep=0)
    with pytest.raises(ValueError, match="non-negative"):
        publisher.publish(model, -1)


def test_torn_local_publish_leaves_latest(
    tmp_path: Path, model: CausalLM, monkeypatch: pytest.MonkeyPatch, assert_loads_identical: Callable[..., None]
) -> None:
    root = tmp_path / "weights"
    publisher = DirectoryPublisher(root, keep=3, max_shard_bytes=SMALL_SHARDS)
    good = publisher.publish(model, 1)
    faulty = Faulty(hf_io.save_file, fail_at=2)
    monkeypatch.setattr(hf_io, "save_file", faulty)
    with pytest.raises(OSError, match="injected"):
        publisher.publish(model, 2)
    assert faulty.calls == 2
    assert publisher.latest() == good
    assert versions_on_disk(root) == ["LATEST", "v00000001"]  # no partial v2, no staging debris
    assert_loads_identical(good, model)
    monkeypatch.setattr(hf_io, "save_file", faulty.wrapped)
    location = publisher.publish(model, 2)
    assert publisher.latest() == location and location.endswith("v00000002")


def test_kvstore_publish_gc_and_download(
    tmp_path: Path, model: CausalLM, hf_dir: Path, assert_loads_identical: Callable[..., None]
) -> None:
    context = ts.Context()
    url = "memory://run/weights"
    publisher = DirectoryPublisher(url, keep=2, tokenizer_from=hf_dir, max_shard_bytes=SMALL_SHARDS, context=context)
    for version in (0, 1, 2):
        location = publisher.publish(model, version)
    assert location == f"{url}/v00000002"
    assert publisher.latest() == location
    keys = kv_keys(url, context)
    assert {k.split("/")[0] for k in keys} == {"LATEST", "v00000001", "v00000002"}
    assert "v00000002/tokenizer.json" in keys and "v00000002/model.safetensors.index.json" in keys

    local = resolve_location(location, tmp_path / "cache", context=context)
    assert_loads_identical(local, model)
    resumed = CausalLM(model.config, rngs=nnx.Rngs(7))
    publisher.publish(resumed, 2)  # a resumed run's new v2 at the same URI must not be served stale
    assert resolve_location(location, tmp_path / "cache", context=context) == local
    assert_loads_identical(local, resumed)
    older = resolve_location(f"{url}/v00000001", tmp_path / "cache", keep=1, context=context)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [older.name]  # cache keeps 1


def test_torn_kvstore_upload_leaves_latest(
    tmp_path: Path, model: CausalLM, assert_loads_identical: Callable[..., None]
) -> None:
    context = ts.Context()
    url = "memory://torn"
    publisher = DirectoryPublisher(url, keep=3, max_shard_bytes=SMALL_SHARDS, context=context)
    good = publisher.publish(model, 1)
    store = publisher._store
    store.upload = Faulty(store.upload, fail_at=5)  # type: ignore[method-assign,union-attr]
    with pytest.raises(OSError, match="injected"):
        publisher.publish(model, 2)
    assert publisher.latest() == good
    torn = {k.split("/")[1] for k in kv_keys(url, context) if k.startswith("v00000002/")}
    assert len(torn) == 4 and any(k.startswith("model-") for k in torn)  # it really stopped half-way
    # The retry writes one file where the torn upload left shards: none may linger.
    retry = DirectoryPublisher(url, keep=3, context=context)
    assert retry.publish(model, 2) == retry.latest() == f"{url}/v00000002"
    uploaded = {k.split("/")[1] for k in kv_keys(url, context) if k.startswith("v00000002/")}
    assert uploaded == {"config.json", "generation_config.json", "model.safetensors", MANIFEST_FILE}
    assert_loads_identical(resolve_location(f"{url}/v00000002", tmp_path / "cache", context=context), model)


def test_bad_roots_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(PublishError, match="cannot create publish root"):
        DirectoryPublisher(tmp_path / "file" / "weights")
    with pytest.raises(PublishError, match="tensorstore"):
        DirectoryPublisher("nosuchscheme://bucket/weights")
    with pytest.raises(ValueError, match="not a directory"):
        DirectoryPublisher(tmp_path / "w", tokenizer_from=tmp_path / "missing")
