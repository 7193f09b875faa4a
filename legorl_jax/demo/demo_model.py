"""The embedded default's model: built once from nothing, then cached.

`ensure_demo_model(cache_dir)` returns an HF checkpoint directory (config,
safetensors, tokenizer with Qwen3's chat template) that `from_hf`, the
embedded engine and `transformers` load. Building it:

1. record demonstrations (`demonstrations.py`) with the base demo tokenizer and
   train the final byte-level BPE on their text, so prompts (system prompt,
   tool schemas, tool results) encode short;
2. record them again with the final tokenizer: these token ids are what SFT trains on;
3. initialise a small Qwen3 model (`build_tiny_hf_model`) and warm-start it
   with SFT (`sft.py`) until it solves the demo tasks sometimes, not always
   (a CLI build first trains on lego demonstrations, `lego_stage`, while step 2
   records through the CLIs);
4. export with `to_hf`, write `build_info.json` (figures of the build), and
   move the directory into place with one rename, so a crash never leaves a
   half-written model that a later run would trust.

The cache key hashes everything the result depends on: the build spec, every
file of the tasks, the lego configurations, and the source that shapes the
episodes and their tokens (the lego harness, the proxy's rendering and
trajectory assembly, the tokenizer and chat template, these modules).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from legorl_jax.core.build_once import build_once
from legorl_jax.core.config import DEFAULT_CONFIG, Config, load_config
from legorl_jax.demo import demonstrations, sft
from legorl_jax.demo.demonstrations import Demonstration, record_demonstrations
from legorl_jax.demo.sft import SFTConfig, evaluate, prepare, sample_groups, train_sft
from legorl_jax.models import demo_assets, from_hf, to_hf
from legorl_jax.models import tokenizer as demo_tokenizer
from legorl_jax.models.demo_assets import build_tiny_hf_model
from legorl_jax.models.tokenizer import ENDOFTEXT, build_demo_tokenizer
from rollout_server import harnesses as harness_modules
from rollout_server.demo_families import demo_task_splits
from rollout_server.harnesses import lego
from rollout_server.harnesses.lego import LegoOptions
from rollout_server.proxy import render as proxy_render
from rollout_server.proxy import trajectory as proxy_trajectory
from rollout_server.tasks import Task

log = logging.getLogger(__name__)

BUILD_INFO = "build_info.json"
# Repeats of the demonstration text in the tokenizer corpus: enough for BPE to
# merge the prompt boilerplate into long tokens next to the built-in corpus.
_CORPUS_COPIES = 10
_TOKENIZER_TASKS = 12
_TEXT_CONTEXT = 131072


class DemoModelSpec(BaseModel):
    """Everything about the build that is not read from tasks or source files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(2048, ge=512)
    # Sized for the time budget: a few minutes of SFT on 2 CPU cores over ~1k-token episodes.
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int = Field(32, gt=0)
    intermediate_size: int = Field(384, gt=0)
    seed: int = 0
    max_context: int = Field(2048, gt=0, description="Longest episode the demonstrations may take (tokens).")
    max_tokens: int = Field(256, gt=0, description="Longest completion the demonstrations may need (tokens).")
    harnesses: tuple[dict[str, Any], ...] = Field(
        (), description="lego options per configuration; empty takes configs/demo.yaml's harness_mix."
    )
    cli_harnesses: tuple[str, ...] = Field(
        (),
        description="Record the demonstrations through these real harness CLIs in Docker (cli_demonstrations.py) "
        "instead of lego; `harnesses` is then unused.",
    )
    tokenizer_tasks: int = Field(
        _TOKENIZER_TASKS, gt=0, description="Tasks whose demonstrations the tokenizer is trained on (a sample)."
    )
    # One working plan and the weak teacher's habit (see demonstrations.PLANS).
    plans: tuple[str, ...] = ("direct", "describe")
    plan_repeats: dict[str, int] = Field(
        {"describe": 2},
        description="Copies of each plan's demonstrations in the SFT data (default 1): with the habit twice as "
        "often as the working plan, the warm start acts on about a third of its episodes.",
    )
    sft: SFTConfig = SFTConfig()
    lego_stage: SFTConfig | None = Field(
        None,
        description="For a CLI build: first train on the lego demonstrations of configs/demo.yaml's tasks, "
        "recorded with this build's tokenizer, with this config; then on the CLI ones with `sft`. None: CLI only.",
    )

    @model_validator(mode="after")
    def _lego_stage_needs_clis(self) -> DemoModelSpec:
        if self.lego_stage is not None and not self.cli_harnesses:
            raise ValueError("lego_stage is a first stage for a CLI build: set cli_harnesses, or use sft alone")
        return self


def demo_training_tasks(config: Config | None = None) -> list[Task]:
    """The generated demo tasks a config trains on (default: configs/demo.yaml's)."""
    config = config or load_config(DEFAULT_CONFIG)
    return demo_task_splits(config.tasks.demo_variants)["train"]


def demo_harness_options(config: Config | None = None) -> list[dict[str, Any]]:
    """The lego entries of a config's harness mix (default: configs/demo.yaml)."""
    config = config or load_config(DEFAULT_CONFIG)
    options = [dict(h.options) for h in config.harness_mix.harnesses if h.name == "lego"]
    if not options:
        raise ValueError("the config's harness_mix has no lego entry to demonstrate")
    return options


def _task_files(tasks: Sequence[Task]) -> Iterator[tuple[str, bytes]]:
    for task in sorted(tasks, key=lambda t: t.name):
        for path in sorted(p for p in task.root.rglob("*") if p.is_file()):
            yield f"{task.name}/{path.relative_to(task.root).as_posix()}", path.read_bytes()


def _source_files(spec: DemoModelSpec) -> Iterator[tuple[str, bytes]]:
    """What shapes the episodes and their tokens: the harnesses (for CLIs: their modules and pinned
    installs), the proxy's rendering, the builders."""
    for module in (demo_tokenizer, demo_assets, demonstrations, sft, proxy_render, proxy_trajectory):
        yield module.__name__, Path(module.__file__ or "").read_bytes()
    for path in sorted(Path(lego.__file__ or "").parent.glob("*.py")):
        yield f"lego/{path.name}", path.read_bytes()
    if spec.cli_harnesses:
        from legorl_jax.demo import cli_demonstrations

        yield cli_demonstrations.__name__, Path(cli_demonstrations.__file__ or "").read_bytes()
        for path in sorted(Path(harness_modules.__file__ or "").parent.glob("*.py")):
            yield f"harnesses/{path.name}", path.read_bytes()
        for pin in cli_demonstrations.CLI_PINS:
            yield pin.name, pin.read_bytes()
    yield "chat_template.jinja", demo_tokenizer.load_chat_template().encode()
    yield __name__, Path(__file__).read_bytes()


def cache_key(spec: DemoModelSpec, tasks: Sequence[Task], harnesses: Sequence[dict[str, Any]]) -> str:
    """sha256 over the spec, the lego configurations, the task files and the builder's source."""
    digest = hashlib.sha256()
    digest.update(spec.model_dump_json().encode())
    digest.update(json.dumps(list(harnesses), sort_keys=True).encode())
    for name, data in (*_task_files(tasks), *_source_files(spec)):
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / BUILD_INFO).is_file() and (model_dir / "config.json").is_file()


def _record(
    tokenizer_dir: Path,
    tasks: Sequence[Task],
    options: list[LegoOptions],
    spec: DemoModelSpec,
    max_context: int,
    *,
    through_clis: bool = True,
) -> list[Demonstration]:
    """Demonstrations through the spec's CLIs when it names any (and `through_clis`), else through lego."""
    from transformers import AutoTokenizer  # deferred: seconds to import, only the build needs it

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if spec.cli_harnesses and through_clis:
        from legorl_jax.demo.cli_demonstrations import record_cli_demonstrations, working_demonstrations

        episodes = record_cli_demonstrations(
            tokenizer,
            tasks,
            spec.cli_harnesses,
            plans=spec.plans,
            max_context=max_context,
            max_tokens=spec.max_tokens,
        )
        return working_demonstrations(episodes)
    return record_demonstrations(
        tokenizer, tasks, options, plans=spec.plans, max_context=max_context, max_tokens=spec.max_tokens
    )


def _demonstration_text(tokenizer_dir: Path, demos: Sequence[Demonstration]) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = []
    for demo in demos:
        for ids, _ in demo.sequences:
            text = tokenizer.decode(list(ids))
            assert isinstance(text, str)  # one sequence in, one text out (decode is typed for batches too)
            texts.append(text)
    return texts


class _Stopped(Exception):
    """A stage running beside another stopped because the other failed."""


def _train(
    model: Any,
    data: sft.SFTData,
    config: SFTConfig,
    desc: str,
    progress: bool,
    stop: threading.Event | None = None,
) -> tuple[Any, Any]:
    """`train_sft` with a progress bar that shows the loss and pass estimate at each check;
    once `stop` is set it raises `_Stopped` at the next step."""
    from tqdm.auto import tqdm

    with tqdm(total=config.max_steps, desc=desc, unit="step", disable=not progress, leave=False) as bar:

        def on_step(step: int, loss: float, estimate: float | None) -> None:
            if stop is not None and stop.is_set():
                raise _Stopped(f"{desc}: stopped at step {step}")
            if estimate is not None:  # before the update that draws it: the last check is shown, not the one before
                bar.set_postfix({"loss": f"{loss:.3f}", "pass_est": f"{estimate:.2f}"}, refresh=False)
            bar.update(1)

        return train_sft(model, data, config, on_step=on_step)


def _sft_data(demos: Sequence[Demonstration], spec: DemoModelSpec, tokenizer_dir: Path) -> sft.SFTData:
    """The SFT rows of `demos`, each plan repeated as `spec.plan_repeats` says."""
    weighted = [demo for demo in demos for _ in range(spec.plan_repeats.get(demo.plan, 1))]
    return prepare(weighted, _token_id(tokenizer_dir, ENDOFTEXT), max_len=spec.max_context)


def _lego_stage(
    model: Any,
    spec: DemoModelSpec,
    tokenizer_dir: Path,
    tasks: Sequence[Task],
    options: list[LegoOptions],
    progress: bool,
    stop: threading.Event,
) -> tuple[Any, dict[str, Any]]:
    """A CLI build's first stage: SFT on lego demonstrations under the CLI model's tokenizer
    (a trained copy of `model`; it stays as it was).

    What the CLI demonstrations need most is to copy the task's values into a command, and a
    model learns that only after hundreds of steps; a lego row is ~1k tokens where a CLI row
    holds a system prompt of up to 15k, so those steps cost a tenth here (docs/benchmarks.md,
    "The CLI run").
    """
    assert spec.lego_stage is not None
    started = time.monotonic()
    demos = _record(tokenizer_dir, tasks, options, spec, spec.max_context, through_clis=False)
    data = _sft_data(demos, spec, tokenizer_dir)
    model, result = _train(model, data, spec.lego_stage, "lego stage", progress, stop)
    return model, {
        "demonstrations": len(demos),
        "sft_steps": result.steps,
        "reached_target": result.reached_target,
        "pass_estimates": result.pass_estimates,
        "loss_last": result.losses[-1],
        "seconds": time.monotonic() - started,
    }


def build_demo_model(
    out_dir: Path,
    spec: DemoModelSpec,
    tasks: Sequence[Task],
    harnesses: Sequence[dict[str, Any]],
    *,
    progress: bool,
    lego_tasks: Sequence[Task] = (),
) -> dict[str, Any]:
    """Build the model into `out_dir` (see the module docstring); returns the build figures.

    `harnesses` are the lego configurations: what a lego build records, and a CLI build's
    `lego_stage` on `lego_tasks`."""
    started = time.monotonic()
    options = [LegoOptions(**h) for h in harnesses]
    work = out_dir / ".build"
    # The tokenizer only needs the shape of the text: a sample of the tasks is enough.
    sample = list(tasks)[:: max(1, len(tasks) // spec.tokenizer_tasks)]
    # Only text for the tokenizer: under the base vocabulary a CLI's prompt runs past the policy's context.
    base_demos = _record(build_demo_tokenizer(work / "base_tokenizer"), sample, options, spec, _TEXT_CONTEXT)
    corpus = _demonstration_text(work / "base_tokenizer", base_demos) * _CORPUS_COPIES
    tokenizer_dir = build_demo_tokenizer(work / "tokenizer", corpus=corpus, vocab_size=spec.vocab_size)
    init_dir = build_tiny_hf_model(
        work / "init",
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        seed=spec.seed,
        tokenizer_dir=tokenizer_dir,
    )
    model = from_hf(init_dir)
    stage: dict[str, Any] = {}
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lego-stage") as pool:
        # The lego stage needs only the tokenizer, and recording through the CLIs mostly waits on
        # Docker and the CLIs, so the stage trains meanwhile (docs/benchmarks.md, "The CLI run").
        first = None
        if spec.lego_stage is not None:
            first = pool.submit(_lego_stage, model, spec, tokenizer_dir, lego_tasks, options, progress, stop)
        try:
            demos = _record(tokenizer_dir, tasks, options, spec, spec.max_context)
            recorded = time.monotonic()
            data = _sft_data(demos, spec, tokenizer_dir)
            # Before and after on the stopping check's sample of groups: over every demonstration (each
            # habit episode twice) the seven-CLI build's first pass ran past 8 minutes.
            probe = sample_groups(data, spec.sft.eval_groups, spec.sft.seed)
            initial = evaluate(model, probe)
        except BaseException:
            stop.set()  # the stage stops at its next step, not minutes of training later
            raise
        if first is not None:
            model, stage = first.result()
    model, result = _train(model, data, spec.sft, "warm-starting the demo model", progress)
    final = evaluate(model, probe)
    to_hf(model, out_dir, tokenizer_from=init_dir)
    shutil.rmtree(work)
    return {
        "demonstrations": len(demos),
        "sequences": int(data.tokens.shape[0]),
        "padded_length": int(data.tokens.shape[1]),
        "assistant_tokens": int(data.mask.sum()),
        **({"lego_stage": stage} if stage else {}),
        "sft_steps": result.steps,
        "reached_target": result.reached_target,
        "initial": vars(initial),
        "final": vars(final),
        "pass_estimates": result.pass_estimates,
        "loss_first": result.losses[0],
        "loss_last": result.losses[-1],
        "record_s": recorded - started,
        "build_s": time.monotonic() - started,
    }


def _token_id(tokenizer_dir: Path, token: str) -> int:
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for added in vocab["added_tokens"]:
        if added["content"] == token:
            return int(added["id"])
    raise ValueError(f"{tokenizer_dir}: tokenizer has no {token}")


def ensure_demo_model(
    cache_dir: Path,
    *,
    progress: bool = True,
    spec: DemoModelSpec = DemoModelSpec(),
    tasks: Sequence[Task] | None = None,
) -> Path:
    """The cached demo model's HF directory, built first when no cached copy matches.

    `tasks` default to the generated demo tasks configs/demo.yaml trains on; the model directory is
    `cache_dir/demo-model-<key prefix>`. Concurrent builders each build in a
    private temp dir; the first rename wins and the others use its result.
    """
    tasks = list(tasks) if tasks is not None else demo_training_tasks()
    # A CLI build's lego stage records configs/demo.yaml's lego configurations on its training tasks.
    lego_tasks = demo_training_tasks() if spec.lego_stage is not None else []
    lego = not spec.cli_harnesses or spec.lego_stage is not None
    harnesses = [dict(h) for h in spec.harnesses] or (demo_harness_options() if lego else [])
    key = cache_key(spec, [*tasks, *lego_tasks], harnesses)
    target = Path(cache_dir) / f"demo-model-{key[:20]}"

    def build(tmp: Path) -> None:
        # The lego spec builds in minutes; the CLI spec records through Docker first and trains on
        # longer rows (docs/benchmarks.md has both builds' times).
        log.info("building the demo model into %s (one time: recording demonstrations, then SFT)", target)
        info = build_demo_model(tmp, spec, tasks, harnesses, progress=progress, lego_tasks=lego_tasks)
        info["cache_key"] = key
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    return build_once(target, build, _is_complete)
