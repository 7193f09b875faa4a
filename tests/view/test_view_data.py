"""The viewer's reading of a run directory and its JSON API, without a browser."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from legorl_jax.view.app import create_app
from legorl_jax.view.data import JsonlIndex, policy_lag, summarize_rollout


def lines(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_index_reads_appends_skips_malformed_and_waits_for_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    index = JsonlIndex(path, lambda r: r)
    index.refresh()
    assert index.rows == [] and index.malformed == 0  # no file yet: empty, not an error
    path.write_text(lines({"step": 1}) + "{not json\n" + "[1, 2]\n" + '{"step": 2')
    index.refresh()
    assert [r["step"] for r in index.rows] == [1] and index.malformed == 2
    with path.open("a") as f:
        f.write(', "x": 1}\n' + lines({"step": 3}))
    index.refresh()
    assert [r["step"] for r in index.rows] == [1, 2, 3]
    assert index.read(1) == {"step": 2, "x": 1} and index.read(7) is None


def test_index_starts_over_when_a_resume_rewrites_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(lines({"step": 1, "r": 0.1}, {"step": 2, "r": 0.2}))
    index = JsonlIndex(path, lambda r: r)
    index.refresh()
    epoch = index.epoch
    # cut back to step 1, then a longer step 2 written again: same size or more, different bytes
    path.write_text(lines({"step": 1, "r": 0.1}, {"step": 2, "r": 0.25, "again": True}))
    index.refresh()
    assert index.epoch == epoch + 1
    assert [r.get("again") for r in index.rows] == [None, True]


def test_summary_and_policy_lag() -> None:
    record = {
        "step": 3,
        "kind": "train",
        "task": "t",
        "harness": "h",
        "status": "ok",
        "reward": 1.0,
        "error": None,
        "sequences": [
            {"spans": [[5, 9], [12, 13]], "advantage": 0.5, "policy_version": 1},
            {"spans": [[2, 4]], "advantage": None, "policy_version": 2},
        ],
    }
    row = summarize_rollout(record)
    assert row["sampled_tokens"] == 7 and row["advantage"] == 0.5 and row["policy_version"] == 1
    assert policy_lag([row, {**row, "policy_version": 2}]) == [{"step": 3, "policy_lag/max": 1, "policy_lag/mean": 0.5}]
    assert summarize_rollout({"sampled": ["old format"]})["sequences"] == 0  # a run logged before token records


def test_api_over_a_run_with_bad_lines(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(lines({"step": 1, "kind": "train", "reward/mean": 0.5}) + "garbage\n")
    (tmp_path / "rollouts.jsonl").write_text(lines({"step": 1, "kind": "train", "task": "t", "reward": 0.0}))
    client = TestClient(create_app(tmp_path))
    assert client.get("/").status_code == 200 and "app.js" in client.get("/").text
    assert client.get("/static/app.js").status_code == 200
    state = client.get("/api/run").json()
    assert state["exists"] and state["malformed"] == {"metrics.jsonl": 1, "rollouts.jsonl": 0}
    assert client.get("/api/metrics").json()["rows"][0]["reward/mean"] == 0.5
    rows = client.get("/api/rollouts").json()
    assert rows["total"] == 1 and rows["rows"][0]["task"] == "t"
    again = client.get(f"/api/rollouts?since=1&epoch={rows['epoch']}").json()
    assert again["rows"] == [] and again["total"] == 1
    assert client.get("/api/rollouts/0").json()["task"] == "t"
    missing = client.get("/api/rollouts/5")
    assert missing.status_code == 404 and "no trajectory #5" in missing.json()["error"]


def test_api_over_a_missing_run_dir_is_empty(tmp_path: Path) -> None:
    client = TestClient(create_app(tmp_path / "not-yet"))
    assert client.get("/api/run").json()["exists"] is False
    assert client.get("/api/metrics").json()["rows"] == []
    assert client.get("/api/rollouts").json()["rows"] == []


def test_command_refuses_a_missing_run_dir_or_a_taken_port_and_help_names_the_options(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "legorl_jax.cli", "view"]
    done = subprocess.run(cli + [str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "is not a directory" in done.stdout
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(cli + [str(tmp_path), "--port", port], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stdout
    help_text = subprocess.run(cli + ["--help"], capture_output=True, text=True, timeout=60).stdout
    assert "RUN_DIR" in help_text and "--host" in help_text and "--port" in help_text


def test_command_serves_the_run(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(lines({"step": 1, "kind": "train", "loss": 0.5}))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli = [sys.executable, "-m", "legorl_jax.cli", "view", str(tmp_path), "--port", str(port)]
    server = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/metrics", timeout=5) as reply:
                    assert json.load(reply)["rows"][0]["loss"] == 0.5
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    server.terminate()
                    pytest.fail(f"legorl view did not serve: {server.communicate(timeout=30)[0]}")
                time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(timeout=30)
