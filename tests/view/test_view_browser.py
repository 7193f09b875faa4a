"""`legorl view` in headless Chromium, against a run a short real training made.

The run is the end-to-end test's (a tiny random Qwen3 on `coinflip`, local
sandbox, 2 steps); each test serves a copy of its logs so that appending to
them (a live run writing a step) touches no other test. With
LEGORL_SCREENSHOT_DIR set, the trajectory page is saved there as viewer.png
(the README's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from loop.test_train_e2e import train_command
from process_report import failure_report
from selenium import webdriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait
from transformers import AutoTokenizer

from legorl_jax.view.app import create_app

pytestmark = pytest.mark.browser

# The network is closed: no first-run, sync, update or QUIC traffic, and no GPU.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_S = 20


@pytest.fixture(scope="module")
def trained_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("view-run")
    # The coin-flip task gives a group reward contrast half the time: with 8 rounds of sampling a step
    # trains (and the trajectory test finds a trained sequence) but for 1 run in 256 per step.
    command = train_command(model_dir, out, steps=2) + ["--set", "rl.max_sampling_rounds=8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, failure_report(done)
    return out / "e2e"


@pytest.fixture
def run_dir(trained_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        shutil.copy(trained_run / name, run / name)
    return run


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in CHROMIUM_FLAGS + ["--window-size=1400,1000"]:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: Selenium then never looks for (or downloads) a driver of its own.
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(chromium: WebDriver) -> WebDriver:
    """The shared browser with a blank page and an empty console log: the last
    test's page went on polling its stopped viewer, and those refused
    connections are no error of this test's page."""
    chromium.get("about:blank")
    chromium.get_log("browser")
    return chromium


@contextmanager
def serve(run_dir: Path) -> Iterator[str]:
    """The viewer's app on a free loopback port, in a thread."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(run_dir), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "viewer did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(timeout=WAIT_S)


def console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait(driver: WebDriver, condition, message: str) -> Any:
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(lambda d: condition(d), message)


# Read in one script: the page re-renders on every poll that finds news, which would stale element handles.
def text_of(driver: WebDriver, css: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : ''", css)


def texts_of(driver: WebDriver, css: str) -> list[str]:
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)", css)


def attribute_of(driver: WebDriver, css: str, name: str) -> str | None:
    script = "const e = document.querySelector(arguments[0]); return e && e.getAttribute(arguments[1])"
    return driver.execute_script(script, css, name)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def table_rows(driver: WebDriver) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#rollouts tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
    )


def test_curves_load_without_console_errors(browser: WebDriver, run_dir: Path) -> None:
    train = [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    with serve(run_dir) as url:
        browser.get(url)
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, 'polyline[data-key="reward/mean"]'), "no reward curve")
        assert text_of(browser, "#step-count").startswith(f"{len(train)} train steps")
        for key in ("eval_pass_rate", "time/learner_s", "logprob_diff_mean", "groups/kept", "loss", "policy_lag/max"):
            assert browser.find_elements(By.CSS_SELECTOR, f'polyline[data-key="{key}"]'), f"no curve of {key}"
        assert console_errors(browser) == []


def test_rollout_filters(browser: WebDriver, run_dir: Path) -> None:
    logged = records(run_dir / "rollouts.jsonl")
    with serve(run_dir) as url:
        browser.get(url + "#/rollouts")
        wait(browser, lambda d: len(table_rows(d)) == len(logged), "not every rollout listed")

        Select(browser.find_element(By.ID, "filter-kind")).select_by_value("eval")
        evals = [i for i, r in enumerate(logged) if r["kind"] == "eval"]
        wait(browser, lambda d: [int(row[0]) for row in table_rows(d)] == evals, "kind filter")

        step = browser.find_element(By.ID, "filter-step")
        step.send_keys("2", Keys.TAB)
        expected = [i for i in evals if logged[i]["step"] == 2]
        assert expected, "the run evaluates at step 2"
        wait(browser, lambda d: [int(row[0]) for row in table_rows(d)] == expected, "step filter")
        assert "step=2" in browser.current_url and "kind=eval" in browser.current_url

        browser.refresh()  # the filters live in the address: a reload keeps them
        wait(browser, lambda d: [int(row[0]) for row in table_rows(d)] == expected, "filters after reload")

        Select(browser.find_element(By.ID, "filter-reward")).select_by_value("ungraded")
        wait(browser, lambda d: text_of(d, "#match-count").startswith("0 of"), "reward filter")
        assert console_errors(browser) == []


def point_at(driver: WebDriver, token: WebElement, away: WebElement) -> None:
    """Hovers `token` so that a mouseover surely fires: the pointer first leaves for `away`,
    and the token is scrolled to the middle of the viewport, clear of the sticky details bar."""
    ActionChains(driver).move_to_element(away).perform()
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", token)
    ActionChains(driver).move_to_element(token).perform()


def test_trajectory_shows_the_sampled_tokens_of_an_episode(browser: WebDriver, run_dir: Path, model_dir: Path) -> None:
    logged = records(run_dir / "rollouts.jsonl")
    index = next(i for i, r in enumerate(logged) if r["kind"] == "train" and r["sequences"][0]["advantage"] is not None)
    seq = logged[index]["sequences"][0]
    # The per-token record joins to the decoded sequence; span by span it joins to the decoded spans, except
    # that a character the random model split over a span's end shows once, in the token completing it.
    assert "".join(seq["pieces"]) == AutoTokenizer.from_pretrained(model_dir).decode(seq["ids"])
    sampled = "".join("".join(seq["pieces"][start:end]) for start, end in seq["spans"])
    assert sampled.replace("\ufffd", "") == "".join(logged[index]["sampled"]).replace("\ufffd", "")
    # The learner's logprob of every sampled token, beside the engine's (the run truncates nothing).
    learner = seq["learner_logprobs"]
    assert len(learner) == len(seq["logprobs"]) and all(isinstance(x, float) for x in learner)
    gaps = [abs(a - b) for a, b in zip(learner, seq["logprobs"], strict=True)]
    sampled_at = [i for start, end in seq["spans"] for i in range(start, end)]
    with serve(run_dir) as url:
        browser.get(url + "#/rollouts")
        link = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'a[href="#/t/{index}"]'), "no link")
        link[0].click()
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#seq-0 .tok.sampled"), "no sampled tokens shown")
        tokens = browser.find_elements(By.CSS_SELECTOR, "#seq-0 .tok.sampled")
        assert "".join(t.get_attribute("textContent") for t in tokens) == sampled
        first = seq["spans"][0][0]
        title = tokens[0].get_attribute("title")
        assert f"id {seq['ids'][first]}" in title
        assert f"behaviour logprob {seq['logprobs'][0]:.4f}" in title
        assert f"learner logprob {learner[0]:.4f}" in title
        assert f"learner − behaviour {learner[0] - seq['logprobs'][0]:+.4f}" in title
        header = text_of(browser, "#seq-0 h3")
        assert f"trained with advantage {seq['advantage']:.4f}" in header
        assert f"|Δ| max {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f} over {len(gaps)} tokens" in header
        # Highlighted: exactly the tokens past the threshold the page's key states.
        assert "differ by more than 0.5 nats" in text_of(browser, "#token-key")
        marked = browser.execute_script(
            "return [...document.querySelectorAll('#seq-0 .tok.disagree')].map(e => Number(e.dataset.i))"
        )
        assert marked == [i for i, gap in zip(sampled_at, gaps, strict=True) if gap > 0.5]
        summary = text_of(browser, "#trajectory-summary")
        assert logged[index]["task"] in summary and logged[index]["status"] in summary
        assert console_errors(browser) == []

        away = browser.find_element(By.CSS_SELECTOR, "#seq-0 h3")
        point_at(browser, tokens[0], away)
        wait(browser, lambda d: text_of(d, "#token-info") == title, "hover shows no details")
        last = tokens[-1]
        last.click()  # a click (a touch screen's tap) shows a token's details too
        wait(browser, lambda d: text_of(d, "#token-info") == last.get_attribute("title"), "click shows no details")
        browser.execute_script("arguments[0].focus()", tokens[0])  # and keyboard focus
        wait(browser, lambda d: text_of(d, "#token-info") == title, "focus shows no details")
        if shots := os.environ.get("LEGORL_SCREENSHOT_DIR"):
            for fold in browser.find_elements(By.CSS_SELECTOR, "details > summary"):
                fold.click()  # the picture shows the prompt too
            point_at(browser, tokens[0], away)
            Path(shots).mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(Path(shots) / "viewer.png"))


def test_page_updates_when_the_run_appends_a_step(browser: WebDriver, run_dir: Path) -> None:
    metrics = records(run_dir / "metrics.jsonl")
    last = [r for r in metrics if r.get("kind") == "train"][-1]
    with serve(run_dir) as url:
        browser.get(url)
        wait(browser, lambda d: text_of(d, "#step-count").startswith(f"{last['step']} train steps"), "no steps")
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({**last, "step": last["step"] + 1, "reward/mean": 0.75}) + "\n")
        wait(browser, lambda d: text_of(d, "#step-count").startswith(f"{last['step'] + 1} train steps"), "no update")
        points = attribute_of(browser, 'polyline[data-key="reward/mean"]', "points")
        assert len(points.split()) == last["step"] + 1
        # a resumed run cuts its logs back to the checkpoint's step: the page follows
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
        wait(browser, lambda d: text_of(d, "#step-count").startswith(f"{last['step']} train steps"), "no cut-back")

        logged = records(run_dir / "rollouts.jsonl")
        browser.get(url + "#/rollouts")
        wait(browser, lambda d: len(table_rows(d)) == len(logged), "rollouts not listed")
        with (run_dir / "rollouts.jsonl").open("a") as f:
            f.write(json.dumps({**logged[-1], "step": last["step"] + 1, "task": "appended"}) + "\n")
        wait(browser, lambda d: table_rows(d)[-1][3] == "appended", "appended rollout not listed")
        assert console_errors(browser) == []


def test_empty_and_malformed_runs_show_a_state_not_an_error(browser: WebDriver, tmp_path: Path) -> None:
    with serve(tmp_path) as url:
        browser.get(url)
        wait(browser, lambda d: d.find_elements(By.ID, "no-steps"), "no empty state")
        browser.get(url + "#/rollouts")
        wait(browser, lambda d: d.find_elements(By.ID, "no-rollouts"), "no empty rollouts state")
        browser.get(url + "#/t/3")
        wait(browser, lambda d: "no trajectory #3" in text_of(d, "#no-trajectory"), "no missing-trajectory state")
        console_errors(browser)  # the 404 of a missing trajectory is the browser's note, not the page's error
        record = {"step": 1, "kind": "train", "loss": 0.5}
        (tmp_path / "metrics.jsonl").write_text("{torn\n" + json.dumps(record) + "\n")
        browser.get(url)
        wait(browser, lambda d: "1 malformed line(s) in metrics.jsonl" in text_of(d, "#notice"), "no malformed notice")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, 'polyline[data-key="loss"]'), "no loss curve")
        assert console_errors(browser) == []


def test_trajectory_marks_tool_calls_merges_forks_and_the_verifier(browser: WebDriver, tmp_path: Path) -> None:
    def sequence(pieces: list[str], spans: list[list[int]], model_calls: int) -> dict[str, Any]:
        sampled = sum(end - start for start, end in spans)
        return {
            "ids": list(range(len(pieces))),
            "pieces": pieces,
            "spans": spans,
            "logprobs": [-0.01] * (sampled - 1) + [-5.0],
            "advantage": -0.5,
            "policy_version": 0,
            "side_call": False,
            "model_calls": model_calls,
        }

    first = sequence(
        [
            "<|im_start|>user\nrun it",
            "<|im_end|>\n",
            "<tool_call>",
            '{"name": "bash"}',
            "</tool_call>",
            "\n<tool_response>",
            "ok",
            "</tool_response>\n",
            "done",
        ],
        [[2, 5], [8, 9]],
        model_calls=2,
    )
    first["learner_logprobs"] = [-0.02, -1.01, None, -5.2]  # token 3 disagrees; token 4 has none (not trained)
    # "" is a token that ends inside a character (the next token shows it), "\r" one that draws
    # nothing and "\n" one that only breaks the line: all still there to hover or click.
    forked = sequence(["<|im_start|>user\nagain", "<|im_end|>\n", "", "\r", "\n", "bye"], [[2, 6]], model_calls=1)
    # As logging.rollout_tokens "train" or "none" writes an untrained sequence: spans and summary, no tokens.
    untracked = {"spans": [[4, 6]], "advantage": None, "policy_version": 0, "side_call": True, "model_calls": 1}
    record = {
        "step": 1,
        "kind": "train",
        "task": "broken-tests",
        "harness": "lego",
        "status": "ok",
        "reward": 0.0,
        "error": "tests wrote no reward: reward.txt is a FIFO",
        "metrics": {"verifier_no_reward": True, "history_rewrites": 1},
        "sampled": ['<tool_call>{"name": "bash"}</tool_call>', "done", "\r\nbye", "a side answer"],
        "sequences": [first, forked, untracked],
    }
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
    with serve(tmp_path) as url:
        browser.get(url + "#/t/0")
        wait(browser, lambda d: d.find_elements(By.ID, "seq-2"), "no third sequence")
        assert "verifier wrote no reward (graded 0): tests wrote no reward" in text_of(browser, "#verifier")
        assert "merged 2 model calls" in text_of(browser, "#seq-0 h3")
        assert "forked" in text_of(browser, "#seq-1 h3") and "forked" not in text_of(browser, "#seq-0 h3")
        assert texts_of(browser, "#seq-0 .tok.toolcall") == ["<tool_call>", '{"name": "bash"}', "</tool_call>"]
        assert texts_of(browser, "#seq-0 .tok.toolresult") == ["\n<tool_response>", "ok", "</tool_response>\n"]
        assert text_of(browser, "#seq-0 .tok.sampled.unlikely") == "done"  # the p < 0.1 token
        assert texts_of(browser, "#seq-0 .tok.sampled.disagree") == ['{"name": "bash"}']  # |−1.01 − (−0.01)| > 0.5
        assert "|Δ| max 1.0000, mean 0.4033 over 3 tokens" in text_of(browser, "#seq-0 h3")
        assert "|Δ|" not in text_of(browser, "#seq-1 h3")  # no learner logprobs recorded
        assert "not trained" in text_of(browser, "#seq-2 h3")
        assert "No token record" in text_of(browser, "#seq-2") and "a side answer" in text_of(browser, "#seq-2")
        split = browser.find_element(By.CSS_SELECTOR, '#seq-1 .tok[data-i="2"]')
        split.click()
        shown = 'token 2 · id 2 · ""'
        wait(browser, lambda d: text_of(d, "#token-info").startswith(shown), "no details of an empty token")
        browser.find_element(By.CSS_SELECTOR, '#seq-1 .tok[data-i="3"]').click()
        shown = 'token 3 · id 3 · "\\r"'
        wait(browser, lambda d: text_of(d, "#token-info").startswith(shown), "no details of a carriage return")
        browser.find_element(By.CSS_SELECTOR, '#seq-1 .tok[data-i="4"]').click()
        shown = 'token 4 · id 4 · "\\n"'
        wait(browser, lambda d: text_of(d, "#token-info").startswith(shown), "no details of a line break")
        assert browser.find_element(By.CSS_SELECTOR, '#seq-1 .tok[data-i="4"]').get_attribute("textContent") == "\n"
        labels = texts_of(browser, "#seq-0 .segment .label")
        assert labels[1].startswith("model call 1") and labels[3].startswith("model call 2")
        assert console_errors(browser) == []


def test_trajectory_shows_the_policy_versions_of_a_completion_an_update_split(
    browser: WebDriver, tmp_path: Path
) -> None:
    pieces = ["<|im_start|>user\ngo", "<|im_end|>\n", "a", "b", "c", "d", "\nok", "e"]
    spans = [[2, 6], [7, 8]]
    # A weight update landed after the first call's second token: versions 3, 3, 4, 4, then 4 for call 2.
    mixed = {"ids": list(range(len(pieces))), "pieces": pieces, "spans": spans, "logprobs": [-0.1] * 5}
    mixed |= {"advantage": 0.5, "policy_version": 3, "side_call": False, "model_calls": 2}
    mixed["versions"] = [[3, 2], [4, 3]]
    # Runs that do not cover the sampled tokens (a malformed record) mark nothing.
    broken = {**mixed, "versions": [[3, 1]], "model_calls": 1}
    record = {"step": 1, "kind": "train", "task": "t", "harness": "lego", "status": "ok", "reward": 1.0}
    record |= {"metrics": {}, "sampled": ["abcd", "e", "abcd", "e"], "sequences": [mixed, broken]}
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
    with serve(tmp_path) as url:
        browser.get(url + "#/t/0")
        wait(browser, lambda d: d.find_elements(By.ID, "seq-1"), "no second sequence")
        assert "sampled by policy versions 3, 4" in text_of(browser, "#seq-0 h3")
        versions = browser.execute_script(
            "return [...document.querySelectorAll('#seq-0 .tok.sampled')].map(t => t.dataset.version)"
        )
        assert versions == ["3", "3", "4", "4", "4"]
        # One mark, before the first token of version 4, inside call 1; none at the call boundary.
        marks = browser.execute_script(
            "return [...document.querySelectorAll('#seq-0 .version-change')]"
            ".map(m => [m.dataset.version, m.nextElementSibling.dataset.i])"
        )
        assert marks == [["4", "4"]]
        mark = browser.find_element(By.CSS_SELECTOR, "#seq-0 .version-change")
        drawn = browser.execute_script("return getComputedStyle(arguments[0], '::before').content", mark)
        assert drawn == '"v4▸"' and mark.is_displayed()
        # The mark is no part of the completion's text.
        assert text_of(browser, "#seq-0 .segment.completion .tokens") == "abcd"
        labels = texts_of(browser, "#seq-0 .segment .label")
        assert labels[1] == "model call 1: sampled 4 tokens by policy versions 3 → 4"
        assert labels[3] == "model call 2: sampled 1 tokens"
        browser.find_element(By.CSS_SELECTOR, '#seq-0 .tok[data-i="4"]').click()
        wait(browser, lambda d: text_of(d, "#token-info").endswith("· policy version 4"), "no version in the details")
        assert "policy version 3" in text_of(browser, "#seq-1 h3")
        assert browser.find_elements(By.CSS_SELECTOR, "#seq-1 .version-change, #seq-1 [data-version]") == []
        assert console_errors(browser) == []
