"""Connects the training loop to what lies outside the learner: the tasks and
the in-process rollout server (rollout side) and the embedded demo model.

The loop (`train/loop.py`) imports neither side; the commands hand it the
`RunInputs` built here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from legorl_jax.core.config import Config, cache_root
from legorl_jax.demo.cli_model import ensure_cli_demo_model
from legorl_jax.demo.demo_model import ensure_demo_model
from legorl_jax.fleet import LocalServer
from legorl_jax.train.loop import RunInputs, Trainer
from rollout_server.demo_families import Split, demo_task_splits
from rollout_server.server import RolloutServer
from rollout_server.tasks import load_tasks


def task_ids(config: Config, split: Split) -> list[str]:
    """The ids of the configured training or evaluation tasks (`split` "train" or "eval")."""
    tasks = load_tasks(config.tasks.train if split == "train" else config.tasks.eval)
    if config.tasks.demo:
        tasks.extend(demo_task_splits(config.tasks.demo_variants)[split])
    return [t.name for t in tasks]


def model_dir(config: Config, progress: bool) -> Path:
    """The configured model directory, or the configured embedded demo model (built once into the cache)."""
    if config.model.path is not None:
        return Path(config.model.path)
    cache = cache_root() / "demo_model"
    if config.model.demo_model == "cli":
        return ensure_cli_demo_model(cache, progress=progress)
    return ensure_demo_model(cache, progress=progress)


def local_server(config: Config) -> LocalServer:
    """Starts a rollout server for `config` in this process on given weights;
    the loop's fleet when the config lists no servers."""

    @contextlib.asynccontextmanager
    async def start(weights: Path) -> AsyncIterator[str]:
        server = RolloutServer(config, weights, address="127.0.0.1:0")
        try:
            yield await server.start()
        finally:
            await server.stop(grace_s=30)

    return start


def run_inputs(config: Config, *, progress: bool) -> RunInputs:
    return RunInputs(
        model_dir=lambda: model_dir(config, progress),
        task_ids=lambda split: task_ids(config, split),
        local_server=local_server(config),
    )


def trainer(config: Config, *, progress: bool | None = None) -> Trainer:
    """A `Trainer` for `config`; `progress` None takes `logging.progress`."""
    shown = config.logging.progress if progress is None else progress
    return Trainer(config, run_inputs(config, progress=shown), progress=shown)
