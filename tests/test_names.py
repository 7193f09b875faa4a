"""One name per concept: no class name is defined twice across the packages, so
a name read anywhere (a traceback, a review, a grep) points at one thing."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("legorl_jax", "rollout_server")


def class_definitions(root: Path) -> dict[str, list[str]]:
    """Class name -> "path:line" of every definition under `root`'s packages (task fixtures aside)."""
    found: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "demo_tasks" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found[node.name].append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_class_name_is_defined_twice() -> None:
    twice = {name: where for name, where in class_definitions(ROOT).items() if len(where) > 1}
    assert twice == {}


def test_the_check_sees_a_repeated_name(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text("class Twice:\n    pass\n")
    assert class_definitions(tmp_path)["Twice"] == ["legorl_jax/m.py:1", "rollout_server/m.py:1"]


def test_no_two_test_modules_outside_packages_share_a_name() -> None:
    """pytest imports a test file outside a package (no `__init__.py`) by its bare name: two
    `test_x.py` in such folders break the collection of the whole suite."""
    loose: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if not (path.parent / "__init__.py").exists():
            loose[path.name].append(str(path.relative_to(ROOT)))
    assert {name: where for name, where in loose.items() if len(where) > 1} == {}
