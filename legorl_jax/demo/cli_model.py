"""The CLI demo's model: the demo model's build (`demo_model.py`), warm-started on demonstrations
recorded through the real harness CLIs instead of lego.

What differs from the lego demo model is only its spec: where the demonstrations
come from (`cli_harnesses`), a tokenizer trained on text that holds the CLIs'
long system prompts and tool schemas (a larger vocabulary, so they compress), a
context that fits the longest CLI episode, and fewer tasks (a CLI episode takes
seconds in Docker, a lego one milliseconds). Built once and cached like the demo
model (`core/build_once.py`); `python -m legorl_jax.demo.cli_model` builds it and
prints its directory.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from legorl_jax.core.config import DEFAULT_CONFIG, REPO_ROOT, load_config
from legorl_jax.demo.demo_model import DemoModelSpec, ensure_demo_model
from legorl_jax.demo.sft import SFTConfig
from rollout_server.demo_families import demo_task_splits
from rollout_server.tasks import Task

# Every CLI whose oracle episodes are graded as planned (tests/harnesses/test_cli_demonstrations.py).
CLI_HARNESSES = ("mini-swe-agent", "opencode", "codex", "claude-code", "gemini-cli", "qwen-code", "openhands")
# Training variants per family that are demonstrated: 6 families x 2 x 7 CLIs x 2 plans = 168 episodes.
TASKS_PER_FAMILY = 2

CLI_DEMO_SPEC = DemoModelSpec(
    cli_harnesses=CLI_HARNESSES,
    # Measured (scripts/cli_episode_stats.py): with the 2,048-token vocabulary the first prompts run to
    # 24k tokens (Claude Code); a vocabulary trained on them at 8,192 cuts that (docs/benchmarks.md).
    vocab_size=8192,
    max_context=16384,
    max_tokens=256,
    # The CLIs' prompts hardly depend on the task: one task's episodes teach the tokenizer their text.
    tokenizer_tasks=1,
    # A step takes 8 demonstrations of one CLI: their shared system prompt (99% of an OpenCode or Codex
    # episode) is laid out once, with their own tokens after it, in a row of up to the context (a CLI whose
    # trie is longer than a row would have it split, its prompt copied); one row per call bounds memory on a
    # small CPU machine (docs/benchmarks.md, "SFT packing").
    # The bound: at 300 steps (after the lego stage) the seven-CLI estimate was still rising (0.06 at 200,
    # 0.098 at 300), and that warm start gave OpenHands, whose calls carry a second argument, 3 tool calls
    # in 64 training trials and 1 pass: too few for RL to move it, and it ended below its start. 500
    # steps (~10 more minutes) fit the 45-minute build; the target sits at the top of the four-CLI
    # build's plateau (0.05-0.14 from step ~300 to 900), below the lego model's 0.25. The first such build
    # reached it at step 300 (0.155), and its run rose on all seven CLIs (docs/benchmarks.md, "The CLI run").
    sft=SFTConfig(
        max_steps=500,
        batch_size=8,
        # A check costs a few steps (17-51 s with its compiles); the estimate stayed 0.00 to step 100 and
        # rose slowly after, so checks every 50 steps find the target within 50 of where 25 would.
        eval_every=50,
        eval_groups=8,
        batch_by_config=True,
        row_tokens=16384,
        micro_batch_tokens=16384,
        target_pass=0.15,
    ),
    # From scratch the CLI steps sat at a loss of ~0.7 for 200 steps (9 s each) before the model learnt
    # to copy the task's values; after the lego stage (~1 s a step) the loss was 0.17 by step 100, so the
    # CLI stage is bounded at a third of its old 900 steps (docs/benchmarks.md, "The CLI run").
    lego_stage=SFTConfig(),
)


def cli_demo_tasks(per_family: int = TASKS_PER_FAMILY) -> list[Task]:
    """The first `per_family` training variants of each family configs/demo.yaml trains on."""
    train = demo_task_splits(load_config(DEFAULT_CONFIG).tasks.demo_variants)["train"]
    picked: dict[str, list[Task]] = {}
    for task in train:
        family = next((tag for tag in task.config.metadata.get("tags", ()) if tag != "demo"), task.name)
        if len(picked.setdefault(family, [])) < per_family:
            picked[family].append(task)
    return [task for tasks in picked.values() for task in tasks]


def ensure_cli_demo_model(cache_dir: Path, *, progress: bool = True, spec: DemoModelSpec = CLI_DEMO_SPEC) -> Path:
    """The cached CLI demo model's HF directory, built first when no cached copy matches."""
    return ensure_demo_model(cache_dir, progress=progress, spec=spec, tasks=cli_demo_tasks())


def main() -> None:
    parser = argparse.ArgumentParser(description="Build (once) the CLI demo's model and print its directory.")
    parser.add_argument("--cache", type=Path, default=REPO_ROOT / ".cache" / "demo_model")
    args = parser.parse_args()
    # force: importing orbax (through the builder) installed a root handler at WARNING, which hid the
    # recording's progress lines.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    print(ensure_cli_demo_model(args.cache))


if __name__ == "__main__":
    main()
