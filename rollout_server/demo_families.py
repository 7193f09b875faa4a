"""Generated demo tasks: a few task families, each with slots whose values vary.

A family is one environment (one Docker image, shared by all its variants)
and templates for the instruction, the reference solution and the checker.
A variant fills the slots; variants are split, once and for all by a seeded
shuffle, into a training set and a held-out evaluation set, so evaluation asks
for slot combinations the policy never trained on.

`generated_tasks(split)` writes the variants as ordinary Harbor task
directories (content-addressed, under the cache directory) and loads them, so
a remote rollout server with the same code generates the identical set.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from legorl_jax.core.build_once import build_once
from legorl_jax.core.config import DemoVariantsConfig, cache_root
from rollout_server.tasks import Task, demo_tasks, load_tasks

Split = Literal["train", "eval"]

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "pepper")
# Each word appears a different number of times, so a wrong word gives a wrong count.
_WORD_LINES = [w for i, w in enumerate(WORDS) for _ in range(i + 1)]
random.Random(0).shuffle(_WORD_LINES)
_SETTINGS = {"color": "red", "size": "small", "mode": "fast", "level": "low"}
_INBOX = {
    "report.txt": "quarterly numbers\n",
    "photo.jpg": "not really a photo\n",
    "song.mp3": "la la la\n",
    "notes.md": "# notes\n",
    "data.csv": "a,b\n1,2\n",
    "script.sh": "echo hi\n",
}

DOCKERFILE = "FROM legorl/base:bookworm\nWORKDIR /app\nCOPY --chown=agent:agent app/ /app/\n"

# The checker runs as root and only reads what the agent left: exit 0 is a pass, anything
# else (a wrong answer, or a checker that broke on what it found) a graded 0.
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if python3 /tests/check.py >&2; then reward=1; else reward=0; fi
echo "$reward" > /logs/verifier/reward.txt
"""

_CHECK_HEAD = """import json
import sys
from pathlib import Path

EXPECT = json.loads({expect!r})
MAX_ANSWER_BYTES = 65536


def wrong(why):
    print(why, file=sys.stderr)
    sys.exit(3)


def answer(path):
    \"\"\"The text of an answer file. A FIFO, device, directory, huge or non-UTF-8 file is a wrong answer.\"\"\"
    path = Path(path)
    if not path.is_file():
        wrong(f"{{path}} is missing or not a regular file")
    with path.open("rb") as fh:
        data = fh.read(MAX_ANSWER_BYTES + 1)
    if len(data) > MAX_ANSWER_BYTES:
        wrong(f"{{path}} is larger than {{MAX_ANSWER_BYTES}} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        wrong(f"{{path}} is not UTF-8")


"""

_COUNT_CHECK = """if answer(EXPECT["path"]).strip() != str(EXPECT["count"]):
    wrong(f"{EXPECT['path']} does not hold {EXPECT['count']}")
"""

_WORD_CHECK = """if answer(EXPECT["path"]).strip() != EXPECT["word"]:
    wrong(f"{EXPECT['path']} does not hold exactly {EXPECT['word']}")
"""

_SETTINGS_CHECK = """if answer("/app/settings.conf") != EXPECT["content"]:
    wrong("settings.conf differs from the expected content")
"""

_MOVE_CHECK = """if answer(EXPECT["dest"]) != EXPECT["content"]:
    wrong(f"{EXPECT['dest']} is changed")
if Path(EXPECT["source"]).exists():
    wrong(f"{EXPECT['source']} is still there")
for name in EXPECT["others"]:
    if not Path("/app/inbox", name).is_file():
        wrong(f"/app/inbox/{name} was disturbed")
"""


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    # Path under environment/app -> content: one mapping for every variant, or one per variant (a new image each).
    environment: Mapping[str, str] | Callable[[Mapping[str, str]], Mapping[str, str]]
    slots: Mapping[str, tuple[str, ...]]
    instruction: str
    solution: str
    # What the checker compares against, computed from the slots (never from an agent's output),
    # and the checker's body (it sees that as EXPECT and calls wrong(why) on a wrong answer).
    expect: Callable[[Mapping[str, str]], dict[str, object]]
    check: str

    def environment_for(self, slots: Mapping[str, str]) -> Mapping[str, str]:
        return self.environment(slots) if callable(self.environment) else self.environment

    def variants(self) -> list[dict[str, str]]:
        names = list(self.slots)
        return [dict(zip(names, values, strict=True)) for values in itertools.product(*self.slots.values())]


def _settings_after(slots: Mapping[str, str]) -> dict[str, object]:
    lines = [f"{k}={v}" for k, v in _SETTINGS.items()] + [f"{slots['key']}={slots['value']}"]
    return {"content": "".join(f"{line}\n" for line in lines)}


def _moved(slots: Mapping[str, str]) -> dict[str, object]:
    name = slots["file"]
    return {
        "dest": f"/app/{slots['dir']}/{name}",
        "source": f"/app/inbox/{name}",
        "content": _INBOX[name],
        "others": sorted(set(_INBOX) - {name}),
    }


# Content families: every variant has the same instruction and a different
# environment, so a held-out variant asks the same question of data never seen.
_LEVELS = ("INFO", "INFO", "WARN", "ERROR", "DEBUG")
_EVENTS = ("request served", "cache miss", "disk slow", "user login", "job done", "retrying")
_SEEDS = tuple(str(i) for i in range(24))


def _log_lines(seed: str) -> list[str]:
    """The level of each line of the seed's log (the messages never contain a level word)."""
    rng = random.Random(f"log/{seed}")
    return [rng.choice(_LEVELS) for _ in range(rng.randint(8, 24))]


def _log_text(slots: Mapping[str, str]) -> dict[str, str]:
    rng = random.Random(f"log-text/{slots['seed']}")
    lines = [f"12:{i:02d}:07 {level} {rng.choice(_EVENTS)}" for i, level in enumerate(_log_lines(slots["seed"]))]
    return {"app.log": "".join(f"{line}\n" for line in lines)}


def _csv_rows(seed: str) -> list[str]:
    rng = random.Random(f"csv/{seed}")
    return [f"{rng.randint(1, 99)},{rng.choice(WORDS)}" for _ in range(rng.randint(5, 30))]


def _csv_text(slots: Mapping[str, str]) -> dict[str, str]:
    return {"data.csv": "".join(f"{row}\n" for row in _csv_rows(slots["seed"]))}


# Slot values appear in the instruction exactly as the command spells them (a
# space before, no quotes around), so they are the same tokens in both places:
# a small model can learn to copy them rather than to translate them.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "write-word",
            "Write one given word into a named file.",
            {"out/.keep": ""},
            {"name": ("notes", "alpha", "draft", "memo", "result", "final"), "word": WORDS},
            "Create the file /app/out/{name}.txt containing the word {word} and nothing else.",
            "echo {word} > /app/out/{name}.txt",
            lambda slots: {"path": f"/app/out/{slots['name']}.txt", "word": slots["word"]},
            _WORD_CHECK,
        ),
        Family(
            "count-word",
            "Count the lines that are exactly a given word.",
            {"words.txt": "".join(f"{w}\n" for w in _WORD_LINES)},
            {"word": WORDS, "out": ("count", "total", "answer")},
            "Count the lines of /app/words.txt that are exactly {word} and write the number to /app/{out}.txt only.",
            "grep -cx {word} /app/words.txt > /app/{out}.txt",
            lambda slots: {"path": f"/app/{slots['out']}.txt", "count": _WORD_LINES.count(slots["word"])},
            _COUNT_CHECK,
        ),
        Family(
            "add-setting",
            "Append one key=value line to a settings file.",
            {"settings.conf": "".join(f"{k}={v}\n" for k, v in _SETTINGS.items())},
            {"key": ("color", "size", "mode", "level", "theme", "speed"), "value": ("blue", "large", "slow", "high")},
            "Add the line {key}={value} at the end of /app/settings.conf and keep the other lines.",
            "echo {key}={value} >> /app/settings.conf",
            _settings_after,
            _SETTINGS_CHECK,
        ),
        Family(
            "count-errors",
            "Count the ERROR lines of a log.",
            _log_text,
            {"seed": _SEEDS},
            "Count the lines of /app/app.log that contain ERROR and write the number to /app/errors.txt only.",
            "grep -c ERROR /app/app.log > /app/errors.txt",
            lambda slots: {"path": "/app/errors.txt", "count": _log_lines(slots["seed"]).count("ERROR")},
            _COUNT_CHECK,
        ),
        Family(
            "count-lines",
            "Count the lines of a CSV file.",
            _csv_text,
            {"seed": _SEEDS},
            "Write the number of lines in /app/data.csv to /app/lines.txt only.",
            "wc -l < /app/data.csv > /app/lines.txt",
            lambda slots: {"path": "/app/lines.txt", "count": len(_csv_rows(slots["seed"]))},
            _COUNT_CHECK,
        ),
        Family(
            "move-file",
            "Move one file from an inbox into a new directory.",
            {f"inbox/{name}": content for name, content in _INBOX.items()},
            {"file": tuple(_INBOX), "dir": ("archive", "backup", "done", "keep")},
            "Move /app/inbox/{file} into a new directory /app/{dir} and leave the other files.",
            "mkdir -p /app/{dir} && mv /app/inbox/{file} /app/{dir}/",
            _moved,
            _MOVE_CHECK,
        ),
    )
}


@dataclass(frozen=True)
class Variant:
    family: Family
    slots: Mapping[str, str]

    @property
    def name(self) -> str:
        return "-".join([self.family.name, *self.slots.values()]).replace(".", "_")

    def files(self) -> dict[str, str]:
        """The Harbor task directory, as relative path -> text."""
        family = self.family
        expect = json.dumps(family.expect(self.slots), sort_keys=True)
        # 512 MB: the CLI harnesses' node runtimes (OpenCode's first) are killed at start-up in 256.
        toml = (
            f'version = "1.0"\n\n[task]\nname = "{self.name}"\ndescription = "{family.description}"\n\n'
            f'[metadata]\ndifficulty = "easy"\ncategory = "generated"\ntags = ["demo", "{family.name}"]\n\n'
            "[verifier]\ntimeout_sec = 30.0\n\n[agent]\ntimeout_sec = 120.0\n\n"
            "[environment]\ncpus = 1\nmemory_mb = 512\n"
        )
        files = {
            "task.toml": toml,
            "instruction.md": family.instruction.format(**self.slots) + "\n",
            "environment/Dockerfile": DOCKERFILE,
            # One POSIX command line: the demonstrations replay it verbatim through sh and bash tools alike.
            "solution/solve.sh": "#!/bin/sh\n" + family.solution.format(**self.slots) + "\n",
            "tests/test.sh": TEST_SH,
            "tests/check.py": _CHECK_HEAD.format(expect=expect) + family.check,
        }
        files.update({f"environment/app/{path}": text for path, text in family.environment_for(self.slots).items()})
        return files


def split_variants(
    families: list[str], *, train_per_family: int, eval_per_family: int, seed: int
) -> dict[Split, list[Variant]]:
    """Per family, a seeded shuffle of every slot combination: the first `eval_per_family`
    are held out, the next `train_per_family` train."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown demo task families {unknown}; known: {sorted(FAMILIES)}")
    out: dict[Split, list[Variant]] = {"train": [], "eval": []}
    for name in families:
        family = FAMILIES[name]
        variants = [Variant(family, slots) for slots in family.variants()]
        if train_per_family + eval_per_family > len(variants):
            raise ValueError(
                f"family {name} has {len(variants)} variants, fewer than "
                f"train_per_family + eval_per_family = {train_per_family + eval_per_family}"
            )
        random.Random(f"{seed}/{name}").shuffle(variants)
        out["eval"] += variants[:eval_per_family]
        out["train"] += variants[eval_per_family : eval_per_family + train_per_family]
    return out


def _write(variants: list[Variant], root: Path) -> Path:
    """Writes the task directories under root/<content hash>; a finished tree is reused as is."""
    digest = hashlib.sha256()
    for variant in variants:
        for path, text in sorted(variant.files().items()):
            digest.update(f"\0{variant.name}/{path}\0{text}".encode())

    def write(tmp: Path) -> None:
        for variant in variants:
            for path, text in variant.files().items():
                out = tmp / variant.name / path
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(text, encoding="utf-8")
                if path.endswith(".sh"):
                    out.chmod(0o755)
        (tmp / ".complete").write_text("")

    return build_once(root / digest.hexdigest()[:20], write, lambda d: (d / ".complete").is_file())


def default_cache_root() -> Path:
    return cache_root() / "demo_tasks"


def generated_tasks(
    split: Split,
    families: list[str],
    *,
    train_per_family: int,
    eval_per_family: int,
    seed: int = 0,
    cache_root: Path | None = None,
) -> list[Task]:
    """The `split` variants of the given families, written as Harbor tasks and loaded."""
    variants = split_variants(families, train_per_family=train_per_family, eval_per_family=eval_per_family, seed=seed)[
        split
    ]
    if not variants:
        return []
    return load_tasks([_write(variants, cache_root or default_cache_root())])


def demo_task_splits(spec: DemoVariantsConfig) -> dict[Split, list[Task]]:
    """The configured demo variants, by split."""
    return {
        split: generated_tasks(
            split,
            spec.families,
            train_per_family=spec.train_per_family,
            eval_per_family=spec.eval_per_family,
            seed=spec.seed,
        )
        for split in ("train", "eval")
    }


def all_demo_tasks(spec: DemoVariantsConfig) -> list[Task]:
    """Every task `tasks.demo` puts on a rollout server: the hand-written demo tasks and all generated variants."""
    splits = demo_task_splits(spec)
    return [*demo_tasks(), *splits["train"], *splits["eval"]]
