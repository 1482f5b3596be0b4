"""Recordings of the KV cache (``vkv.recording``) and the page that replays them (``vkv view``).

Two recorded runs of vkv-tiny, each with a pool too small for its requests: one preempting by
swap, one with prefix caching (repeated prompts share blocks). The recording is checked against
the JSON Schema and, step by step, against what the engine's own accounting said after that
step (free blocks per pool, each sequence's state and block table, the preemptions). The page
is loaded in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, or Google
Chrome and its driver where Ubuntu's chromium is a snap, driven by Selenium with the driver on
``PATH``, nothing downloaded; skipped without them unless ``VKV_REQUIRE_BROWSER=1``), stepped
through by keyboard, and what it draws at every step is compared with the recording.
Screenshots go to ``$VKV_ARTIFACTS`` (CI uploads that folder), else to the test's temporary
folder.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from vkv.cli import main
from vkv.demo import PROMPTS
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.scheduler import SchedulerOutput
from vkv.engine.sequence import SequenceStatus
from vkv.net import free_port
from vkv.recording import (
    SCHEMA_FILE,
    LiveRecording,
    RecordingError,
    read_recording,
    step_record,
)
from vkv.sampling_params import SamplingParams
from vkv.view import ViewServer

CHROMIUM = shutil.which("chromium") or shutil.which("google-chrome")  # Debian's; GitHub's runner
DRIVER = shutil.which("chromedriver")
LIVE = (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)


def record_run(path: Path, caching: bool) -> list[dict]:
    """Serve 12 requests in a 24-block pool, recording; return, per step, what the engine's
    own accounting says: free blocks per pool, live sequences' states and tables, preemptions.
    With caching, every prompt starts with the same 88 tokens (5 full blocks)."""
    engine = LLMEngine(
        None,
        num_gpu_blocks=24,
        num_cpu_blocks=32,
        preemption_mode="auto" if caching else "swap",
        max_model_len=320,
        max_num_seqs=12,
        enable_prefix_caching=caching,
        record=path,
    )
    for i in range(12):
        prompt = PROMPTS[2] + PROMPTS[i % 4] if caching else PROMPTS[i]
        engine.add_request(prompt, SamplingParams(temperature=0.7, max_tokens=24 + 6 * i, seed=i))
    seqs = [engine.sequence(i) for i in range(12)]
    truth, preemptions = [], 0
    manager = engine.scheduler.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        truth.append(
            {
                "free": (manager.num_free_gpu_blocks, manager.num_free_cpu_blocks),
                "live": {s.seq_id: (s.status.name.lower(), list(s.block_table)) for s in seqs
                         if s.status in LIVE},
                "preemptions": engine.scheduler.num_preemptions - preemptions,
                "hits": engine.stats["prefix_cache_hits"],
            }
        )  # fmt: skip
        preemptions = engine.scheduler.num_preemptions
    return truth


@pytest.fixture(scope="module")
def swap_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("recording") / "swap.jsonl"
    return path, record_run(path, caching=False)


@pytest.fixture(scope="module")
def caching_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("recording") / "caching.jsonl"
    return path, record_run(path, caching=True)


@pytest.fixture(params=["swap_run", "caching_run"], ids=["swap", "prefix-caching"])
def run(request) -> tuple[Path, list[dict]]:
    return request.getfixturevalue(request.param)


def test_every_line_matches_the_json_schema(run):
    path, truth = run
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(truth), "a header, then a line per step"
    for line in lines:
        validator.validate(json.loads(line))


def test_each_step_agrees_with_the_engines_own_accounting(run):
    path, truth = run
    recording = read_recording(path)
    caching = recording.header["config"]["enable_prefix_caching"]
    hits = 0
    for step, expected in zip(recording.steps, truth, strict=True):
        for device, free in zip(("gpu", "cpu"), expected["free"], strict=True):
            pool = step[device]
            free_or_cached = pool["size"] - len(pool["held"])
            assert free_or_cached == free, f"step {step['step']}: {device} free blocks"
            owners = owners_of(step, device)
            assert sorted(owners) == pool["held"], "every block in use is in a holder's table"
            ref_counts = dict(pool["ref_counts"])
            for block in pool["held"]:
                assert ref_counts.get(block, 1) == len(owners[block]), f"step {step['step']}"
        live = {s["id"]: (s["status"], s["block_table"]) for s in step["sequences"]}
        live = {i: v for i, v in live.items() if not v[0].startswith("finished")}
        assert live == expected["live"], f"step {step['step']}"
        assert len(step["schedule"]["preempted"]) == expected["preemptions"]
        hits += step["schedule"]["prefix_hit_tokens"]
        assert hits == expected["hits"], f"step {step['step']}: prompt tokens hit so far"
    assert "tree" in recording.steps[0] if caching else "tree" not in recording.steps[0]


def test_the_runs_show_what_they_were_built_to_show(run):
    """The swap run preempts and swaps; the caching run shares blocks and keeps cached ones."""
    path, _ = run
    recording = read_recording(path)
    steps = recording.steps
    if recording.header["config"]["enable_prefix_caching"]:
        assert any(s["gpu"]["ref_counts"] for s in steps), "shared blocks"
        assert any(s["gpu"]["cached"] for s in steps), "evictable cached blocks"
        assert any(len(s["tree"]) > 2 for s in steps)
        assert any(s["schedule"]["prefix_hit_tokens"] for s in steps)
    else:
        assert any(s["schedule"]["preempted"] for s in steps)
        assert any(s["schedule"]["swap_out"] for s in steps)
        assert any(s["schedule"]["swap_in"] for s in steps)


def test_a_block_that_no_table_holds_is_recorded_as_held_by_nobody():
    """The recording shows what the allocator holds, so a leak (a bug in a student's
    BlockManager) is drawn as a held block without owners."""
    engine = LLMEngine(None, num_gpu_blocks=8, max_model_len=128)
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=2))
    engine.step()
    leaked = engine.scheduler.block_manager.gpu_allocator.allocate()
    step = step_record(engine, 1, SchedulerOutput())
    assert leaked.block_id in step["gpu"]["held"]
    assert leaked.block_id not in owners_of(step, "gpu")
    assert len(step["gpu"]["held"]) == 8 - engine.scheduler.block_manager.num_free_gpu_blocks


def test_the_24_request_demo_records_in_well_under_a_few_megabytes(tmp_path):
    path = tmp_path / "demo.jsonl"
    assert main(["demo", "--no-live", "--fast", "--record", str(path)]) == 0
    recording = read_recording(path)
    assert len(recording.steps) > 100
    assert path.stat().st_size < 2_500_000, f"{path.stat().st_size:,} bytes"


BROKEN = {
    "empty": ("", "empty, not a vkv recording"),
    "cut short": ('{"schema":"vkv-record/1","kind":"header"}\n{"kind":"st', ":2: cut short"),
    "another schema": ('{"schema":"vkv-record/9","kind":"header"}\n', ":1: not a vkv-record/1"),
    "a step missing": (
        '{"schema":"vkv-record/1"}\n{"kind":"step","step":2}\n',
        ":2: expected step 1",
    ),
    "a part missing": (
        '{"schema":"vkv-record/1"}\n{"kind":"step","step":1,"schedule":{},"gpu":{}}\n',
        ":2: step 1 has no 'cpu'",
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_recording_is_refused_naming_its_line(case, tmp_path, capsys):
    text, said = BROKEN[case]
    path = tmp_path / "broken.jsonl"
    path.write_text(text)
    with pytest.raises(RecordingError, match=said.replace("'", ".")):
        read_recording(path)
    assert main(["view", str(path)]) == 2
    assert said in capsys.readouterr().out  # one line, however long its path


# -- the page, in headless Chromium -----------------------------------------------------------

needs_browser = pytest.mark.skipif(
    not (CHROMIUM and DRIVER) and os.environ.get("VKV_REQUIRE_BROWSER") != "1",
    reason="Debian's chromium and chromium-driver (VKV_REQUIRE_BROWSER=1 fails instead)",
)

# What the page draws, read in one call: per pool, each cell's state, reference count, owners.
DRAWN = """
const pools = {};
for (const device of ["gpu", "cpu"]) {
  pools[device] = [...document.querySelectorAll(`#${device} .cell`)].map((c) =>
    [Number(c.dataset.block), c.dataset.state, Number(c.dataset.ref || 0), c.dataset.owners || ""]);
}
const rows = [...document.querySelectorAll("#sequences tbody tr")].map((r) =>
  [Number(r.dataset.seq), r.dataset.status]);
return {step: Number(document.body.dataset.step), pools, rows};
"""


def mark(step: dict) -> str | None:
    """The timeline's mark for a step: what it did first in this order, or nothing."""
    schedule = step["schedule"]
    if schedule["preempted"]:
        return "preempt"
    if schedule["swap_in"] or schedule["swap_out"]:
        return "swap"
    if schedule["copy"]:
        return "copy"
    return "hit" if schedule["prefix_hit_tokens"] else None


def owners_of(step: dict, device: str) -> dict[int, list[int]]:
    """Each block's owners: the running (GPU) or swapped (CPU) sequences whose table holds it."""
    holder = "running" if device == "gpu" else "swapped"
    owners: dict[int, list[int]] = {}
    for seq in step["sequences"]:
        if seq["status"] == holder:
            for block in seq["block_table"]:
                owners.setdefault(block, []).append(seq["id"])
    return owners


def expected_drawing(step: dict) -> dict:
    pools = {}
    for device in ("gpu", "cpu"):
        pool = step[device]
        owners, ref_counts = owners_of(step, device), dict(pool["ref_counts"])
        cells = [[block, "free", 0, ""] for block in range(pool["size"])]
        for block in pool["held"]:
            held_by = ",".join(map(str, owners.get(block, [])))
            cells[block] = [block, "held", ref_counts.get(block, 1), held_by]
        for block, _ in pool["cached"]:
            cells[block] = [block, "cached", 0, ""]
        pools[device] = cells
    rows = [[s["id"], s["status"]] for s in step["sequences"]]
    return {"step": step["step"], "pools": pools, "rows": rows}


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.fail("VKV_REQUIRE_BROWSER=1 but chromium or chromedriver is not on PATH")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def open_page(browser, server: ViewServer) -> str:
    """Load the page and wait for it to draw the first step (or its error); the outcome."""
    browser.get(server.url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = browser.execute_script("return document.body.dataset.ready")
        if ready:
            return ready
        time.sleep(0.05)
    raise AssertionError("the page never drew a step nor an error")


def screenshot(browser, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("VKV_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(folder / name))


@needs_browser
def test_the_page_draws_every_step_as_recorded(run, browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    path, _ = run
    recording = read_recording(path)
    with ViewServer(path) as server:
        assert open_page(browser, server) == "true"
        marks = browser.execute_script(
            "return [...document.querySelectorAll('#timeline .mark')].map((m) => m.title)"
        )
        assert marks == [f"step {s['step']}: {kind}" for s in recording.steps if (kind := mark(s))]
        body = browser.find_element("tag name", "body")
        for step in recording.steps:
            assert browser.execute_script(DRAWN) == expected_drawing(step)
            if step["schedule"]["preempted"]:
                shown = dict(browser.execute_script(DRAWN)["rows"])
                for seq_id in step["schedule"]["preempted"]:
                    assert shown[seq_id] in ("waiting", "swapped"), f"step {step['step']}"
            body.send_keys(Keys.ARROW_RIGHT)
        assert browser.find_element("id", "stepinfo").text.startswith(
            f"step {len(recording.steps)} of {len(recording.steps)}"
        ), "the last step stays"
        body.send_keys(Keys.HOME)
        assert browser.execute_script("return document.body.dataset.step") == "1"
        caching = recording.header["config"]["enable_prefix_caching"]
        screenshot(browser, f"view-{'caching' if caching else 'swap'}.png", tmp_path)


@needs_browser
def test_clicking_a_shared_block_lists_its_owners(caching_run, browser, tmp_path):
    path, _ = caching_run
    recording = read_recording(path)
    index, block, owners = next(
        (i, block, owners_of(s, "gpu")[block])
        for i, s in enumerate(recording.steps)
        for block, _ in s["gpu"]["ref_counts"]
    )
    with ViewServer(path) as server:
        assert open_page(browser, server) == "true"
        slider = browser.find_element("id", "slider")
        browser.execute_script(
            "arguments[0].value = arguments[1];arguments[0].dispatchEvent(new Event('input'));",
            slider,
            index + 1,
        )
        browser.find_element("css selector", f"#gpu .cell[data-block='{block}']").click()
        details = browser.find_element("id", "details").text
        assert f"GPU block {block}: held, reference count {len(owners)}" in details
        assert f"owners (sequences whose block table holds it): {', '.join(map(str, owners))}" in (
            details
        )
        screenshot(browser, "view-shared-block.png", tmp_path)


@needs_browser
def test_a_truncated_recording_is_an_error_in_the_page(browser, tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"schema":"vkv-record/1","kind":"header"}\n{"kind":"st')
    with ViewServer(path) as server:
        assert open_page(browser, server) == "error"
        error = browser.find_element("id", "error")
        assert error.is_displayed()
        assert error.text == (
            "This recording cannot be shown: line 2: cut short (the run stopped while writing it?)"
        )


# -- live: vkv demo --web, and the page following an engine -------------------------------------


def test_a_live_recording_keeps_the_newest_steps_with_their_numbers():
    live = LiveRecording(max_steps=3)
    for line in ["header", "s1", "s2", "s3", "s4", "s5"]:
        live(line)
    assert live.text() == "header\ns3\ns4\ns5\n"
    assert live.after(0, timeout=0) == [(3, "s3"), (4, "s4"), (5, "s5")], "dropped ones skipped"
    assert live.after(4, timeout=0) == [(5, "s5")]
    assert live.after(5, timeout=0) == [], "nothing newer within the timeout"


def test_vkv_demo_web_serves_the_run_as_it_records_it(tmp_path):
    """The live recording of ``vkv demo --web`` is the file ``--record`` writes, line for line;
    its event stream sends each step after the one asked for."""
    port, path = free_port(), tmp_path / "run.jsonl"
    command = [sys.executable, "-m", "vkv.cli", "demo", "--web", "--port", str(port)]
    command += [
        "--no-live",
        "--fast",
        "--requests",
        "4",
        "--max-tokens",
        "24",
        "--record",
        str(path),
    ]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in demo.stdout:
            if "keeps showing it" in line:
                break
        else:
            raise AssertionError(f"vkv demo --web ended: {demo.wait()}")
        url = f"http://127.0.0.1:{port}/"
        with urllib.request.urlopen(url + "recording.jsonl", timeout=10) as answer:
            assert answer.headers["X-VKV-Live"] == "1"
            assert answer.read().decode() == path.read_text()
        steps = len(read_recording(path).steps)
        with urllib.request.urlopen(url + f"events?after={steps - 2}", timeout=10) as stream:
            events = [stream.readline().decode() for _ in range(6)]
        lines = path.read_text().splitlines()
        assert events == [
            f"id: {steps - 1}\n", f"data: {lines[-2]}\n", "\n",
            f"id: {steps}\n", f"data: {lines[-1]}\n", "\n",
        ]  # fmt: skip
    finally:
        demo.kill()
        demo.wait()


@needs_browser
def test_the_live_page_follows_the_engine_step_by_step(browser, tmp_path):
    live, path = LiveRecording(), tmp_path / "run.jsonl"
    engine = LLMEngine(
        None, num_gpu_blocks=12, num_cpu_blocks=16, preemption_mode="swap",
        max_model_len=192, max_num_seqs=6, record=[path, live],
    )  # fmt: skip
    for i in range(6):
        engine.add_request(PROMPTS[i], SamplingParams(temperature=0.7, max_tokens=30, seed=i))
    with ViewServer(live) as server:
        assert open_page(browser, server) == "true"
        assert browser.find_element("id", "stepinfo").text == "waiting for the engine's first step"
        number = 0
        while engine.has_unfinished_requests():
            engine.step()
            number += 1
            deadline = time.monotonic() + 30
            while browser.execute_script("return document.body.dataset.step") != str(number):
                assert time.monotonic() < deadline, f"the page never showed step {number}"
                time.sleep(0.02)
            step = json.loads(live.steps[-1])
            assert browser.execute_script(DRAWN) == expected_drawing(step)
        assert number > 10 and any(json.loads(s)["schedule"]["preempted"] for s in live.steps)
        screenshot(browser, "view-live.png", tmp_path)
    assert live.text() == path.read_text(), "the live page saw what the file holds"


def test_vkv_serve_shows_its_engine_live_on_the_view_port(tmp_path):
    port, view_port = free_port(), free_port()
    command = [sys.executable, "-m", "vkv.cli", "serve", "--port", str(port)]
    command += ["--view-port", str(view_port)]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and serve.poll() is None, (
                    "vkv serve never came up"
                )
                time.sleep(0.2)
        body = json.dumps({"model": "vkv-tiny", "prompt": "def", "max_tokens": 5}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=60).close()
        recording = tmp_path / "live.jsonl"
        with urllib.request.urlopen(f"http://127.0.0.1:{view_port}/recording.jsonl") as answer:
            assert answer.headers["X-VKV-Live"] == "1"
            recording.write_bytes(answer.read())
        steps = read_recording(recording).steps
        assert len(steps) >= 5, "a prefill and a decode step per token after the first"
        assert steps[0]["schedule"]["scheduled"][0][2] is True, "the first step is the prefill"
        assert steps[-1]["sequences"][0]["status"] == "finished_length_capped"
    finally:
        serve.kill()
        serve.wait()
