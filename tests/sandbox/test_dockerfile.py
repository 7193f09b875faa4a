"""The local sandbox's Dockerfile subset: what it replays, what it skips, what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_server.sandbox.dockerfile import DockerfileError, env_pairs, parse


def steps_of(tmp_path: Path, text: str) -> list[tuple[str, list[str]]]:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return [(s.instruction, s.args) for s in parse(path)]


def test_filesystem_steps_in_order(tmp_path: Path) -> None:
    text = """# comment
FROM legorl/base:bookworm
LABEL x=y
workdir /app
COPY --chown=agent:agent app/ /app/
ADD ["data dir/", "/srv/"]
ENV A=1 B="two words"
RUN echo one \\
    && echo two
RUN ["python3", "-c", "print(1)"]
CMD ["bash"]
"""
    assert steps_of(tmp_path, text) == [
        ("WORKDIR", ["/app"]),
        ("COPY", ["app/", "/app/"]),
        ("ADD", ["data dir/", "/srv/"]),
        ("ENV", ["A=1", "B=two words"]),
        ("RUN", ["echo one  && echo two"]),
        ("RUN", ["python3 -c 'print(1)'"]),
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("FROM x\nCOPY --from=builder /a /b\n", "multi-stage"),
        ("FROM x\nCOPY only-one\n", "source and a destination"),
        ("FROM x\nONBUILD RUN true\n", "ONBUILD is not supported"),
        ('FROM x\nCOPY ["a", \n', "bad JSON"),
    ],
)
def test_unsupported_lines_are_named(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(DockerfileError, match=needle):
        parse_file = tmp_path / "Dockerfile"
        parse_file.write_text(text)
        parse(parse_file)


def test_env_spellings() -> None:
    assert env_pairs(["A=1", "B=2"]) == {"A": "1", "B": "2"}
    assert env_pairs(["PATH_EXTRA", "/opt/bin", "x"]) == {"PATH_EXTRA": "/opt/bin x"}
    with pytest.raises(DockerfileError):
        env_pairs(["A=1", "B"])
