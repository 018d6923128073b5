"""The KV dashboard on a real server (tiny model): /debug/kv JSON and SSE, API key, and the
/dashboard page driven in headless Chromium (system /usr/bin/chromium + chromedriver, which
``.ci/run`` installs) while requests stream.

To hold the engine still while the page and the test compare what they see, the test wraps
``engine.step`` with a gate: while the gate is closed the engine thread only serves its command
queue (so snapshots keep working), with requests mid-stream.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.debug_routes import dashboard_enabled, is_loopback
from tests.engine.test_kv_snapshot import SECRET_WORDS, check_snapshot
from tests.entrypoints.server_utils import ServerThread, wait_idle

PREFIX = "zanzibar quokka xylophone marmalade, "
PROMPTS = [PREFIX + "the quick brown fox", PREFIX + "hello world, hello engine", "wombat kumquat"]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


class StepGate:
    """Slow the engine down (``delay`` per step) and let the test freeze it between steps."""

    def __init__(self, async_engine, delay: float = 0.03) -> None:
        self.ae = async_engine
        self.eng = async_engine.engine
        self.orig = self.eng.step
        self.delay = delay
        self.open = threading.Event()
        self.open.set()
        self.eng.step = self.step

    def step(self):
        while not self.open.is_set():
            self.ae._drain_commands()  # serve snapshots (and adds / aborts) while frozen
            time.sleep(0.005)
        time.sleep(self.delay)
        return self.orig()

    def freeze(self) -> None:
        """Close the gate and wait until the engine thread is parked in it."""
        self.open.clear()
        done = self.ae.call_in_engine_thread(lambda e: e.stats.num_steps)
        done.result(10)
        time.sleep(0.15)  # older than the server's shared capture (0.1 s): the next is fresh

    def thaw(self) -> None:
        self.open.set()

    def restore(self) -> None:
        self.open.set()
        self.eng.step = self.orig


def make_app(tiny_loaded, **kw):
    return build_app(
        {
            "max_model_len": 128,
            "block_size": 4,
            "num_gpu_blocks_override": 1000,
            "swap_space": 1 << 16,
            "check_invariants": True,
            "num_threads": 1,
        },
        loaded=tiny_loaded,
        served_model_name="tiny",
        log_stats_interval=0,
        enable_dashboard=True,
        **kw,
    )


@pytest.fixture(scope="module")
def server(tiny_loaded):
    srv = ServerThread(make_app(tiny_loaded)).start()
    yield srv
    srv.stop()


@pytest.fixture
def gate(server):
    g = StepGate(server.app.state.async_engine)
    yield g
    g.restore()
    wait_idle(server.engine, timeout=30)


def stream_in_background(url: str, prompt: str, n: int, max_tokens: int, headers=None):
    """Start a streaming completion in a thread; returns (thread, result dict)."""
    out: dict = {}

    def run() -> None:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": 1,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(base_url=url, timeout=120, headers=headers) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            out["status"] = r.status_code
            out["text"] = r.read().decode()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_for(cond, timeout=20.0, what="condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_loopback_rule():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("")
    assert dashboard_enabled("127.0.0.1", False)
    assert not dashboard_enabled("0.0.0.0", False)
    assert dashboard_enabled("0.0.0.0", True)


def test_serve_flag():
    import argparse

    from pagedllm.entrypoints.openai.cli_serve import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    assert p.parse_args(["serve"]).enable_dashboard is False
    assert p.parse_args(["serve", "--enable-dashboard"]).enable_dashboard is True


def test_off_by_default_in_create_app(tiny_loaded):
    app = build_app(
        {"max_model_len": 64, "num_gpu_blocks_override": 64, "num_threads": 1},
        loaded=tiny_loaded,
    )
    paths = {getattr(r, "path", None) for r in app.routes}
    assert "/debug/kv" not in paths


def test_snapshot_api_while_streaming(server, gate):
    threads = [
        stream_in_background(server.url, PROMPTS[0], n=3, max_tokens=60),
        stream_in_background(server.url, PROMPTS[1], n=2, max_tokens=60),
    ]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        wait_for(
            lambda: c.get("/debug/kv").json()["counters"]["num_seqs_running"] >= 5,
            what="both requests running",
        )
        gate.freeze()
        snap = c.get("/debug/kv").json()
        check_snapshot(snap, server.engine)
        assert snap["counters"]["blocks_shared"] > 0  # parallel samples share the prompt
        assert {r["n"] for r in snap["requests"]} == {3, 2}
        # Aggregated and table-less variants agree on the totals.
        agg = c.get("/debug/kv", params={"max_cells": 10, "tables": "none"}).json()
        assert sum(agg["blocks"]["cells"]["used"]) == snap["counters"]["blocks_used"]
        assert all(s["block_table"] is None for r in agg["requests"] for s in r["seqs"])
        rid = snap["requests"][0]["request_id"]
        one = c.get("/debug/kv", params={"tables": rid}).json()
        assert all(
            (s["block_table"] is not None) == (r["request_id"] == rid)
            for r in one["requests"]
            for s in r["seqs"]
        )
        # The SSE stream: several snapshots, then the client goes away.
        events = []
        with c.stream("GET", "/debug/kv/stream", params={"interval": 0.1}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            buf = ""
            for chunk in r.iter_text():
                buf += chunk
                while "\n\n" in buf:
                    ev, buf = buf.split("\n\n", 1)
                    assert ev.startswith("event: snapshot\ndata: ")
                    events.append(json.loads(ev.split("data: ", 1)[1]))
                if len(events) >= 3:
                    break
        for e in events:
            check_snapshot(e, server.engine)
            payload = json.dumps(e)
            assert not any(w in payload for w in SECRET_WORDS)
        payload = json.dumps(snap) + json.dumps(agg)
        assert not any(w in payload for w in SECRET_WORDS), "prompt text in a snapshot"
        gate.thaw()
        hist = wait_for(
            lambda: c.get("/debug/kv/history").json()["samples"], what="history samples"
        )
        assert {"kv_usage", "useful_token_fraction", "running", "waiting"} <= set(hist[-1])
    for t, out in threads:
        t.join(60)
        assert out["status"] == 200
        assert not any(w in out["text"] for w in ["zanzibar"])  # completions carry no prompt


def test_api_key_guards_debug_endpoints(tiny_loaded):
    srv = ServerThread(make_app(tiny_loaded, api_key="sekrit")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/debug/kv").status_code == 401
            assert c.get("/debug/kv/stream").status_code == 401
            assert c.get("/debug/kv/history").status_code == 401
            auth = {"Authorization": "Bearer sekrit"}
            assert c.get("/debug/kv", headers=auth).status_code == 200
            # The page itself holds no data: served without the key; it asks for it.
            r = c.get("/dashboard")
            assert r.status_code == 200 and "text/html" in r.headers["content-type"]
            js = c.get("/dashboard/dashboard.js")
            assert js.status_code == 200
            # Each request row reads "n=2 p=73 o=85 20b c=64"; the page explains the letters.
            assert "n=${r.n} p=${r.prompt_tokens} o=${r.output_tokens} ${nb}b" in js.text
            assert " c=${r.cached_tokens}" in js.text
            legend = r.text.split('id="q-legend"')[1].split("</div>")[0]
            for term in (
                "<b>n</b>=samples",
                "<b>p</b>=prompt tokens",
                "<b>o</b>=output tokens",
                "<b>N</b>b=blocks",
                "<b>c</b>=cached tokens",
            ):
                assert term in legend
    finally:
        srv.stop()


# ---- headless Chromium ------------------------------------------------------------------------
def _chromium_driver(tmp_path: Path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip(
            "Debian's chromium / chromium-driver are not installed "
            "(.ci/run installs them: apt-get install -y chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1400,1300",
    ):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def test_dashboard_in_chromium(server, gate, tmp_path):
    driver = _chromium_driver(tmp_path)
    threads = []
    try:
        driver.set_page_load_timeout(30)
        driver.get(server.url + "/dashboard")
        js = driver.execute_script
        wait_for(
            lambda: js("return window.kvdash && window.kvdash.numSnapshots") >= 1,
            30,
            "the first snapshot in the page",
        )
        # Parallel sampling (n=4) on a shared prefix, plus a plain request.
        threads = [
            stream_in_background(server.url, PROMPTS[0], n=4, max_tokens=80),
            stream_in_background(server.url, PROMPTS[1], n=2, max_tokens=80),
            stream_in_background(server.url, PROMPTS[2], n=1, max_tokens=80),
        ]
        with httpx.Client(base_url=server.url, timeout=30) as c:
            wait_for(
                lambda: c.get("/debug/kv").json()["counters"]["num_seqs_running"] >= 7,
                what="all requests running",
            )
            time.sleep(0.5)
            gate.freeze()  # mid-stream
            truth = c.get("/debug/kv").json()
        check_snapshot(truth, server.engine)
        used = truth["counters"]["blocks_used"]
        assert used > 0
        step = truth["counters"]["num_steps"]
        wait_for(
            lambda: js("return window.kvdash.snapshot.counters.num_steps") == step,
            20,
            "the page to show the frozen step",
        )
        grid = driver.find_element("id", "grid")
        assert int(grid.get_attribute("data-used-drawn")) == used
        assert int(js("return window.kvdash.drawnCells")) == 1000  # one square per block
        assert driver.find_element("id", "c-used").text == str(used)
        # Queues list the three running requests; click the n=4 one.
        assert len(driver.find_elements("css selector", "#q-running li[data-rid]")) == 3
        req = next(r for r in truth["requests"] if r["n"] == 4)
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(5):  # the list may be redrawn between find and click
            try:
                driver.find_element(
                    "css selector", f'#q-running li[data-rid="{req["request_id"]}"]'
                ).click()
                break
            except StaleElementReferenceException:
                time.sleep(0.1)
        svg = driver.find_element("id", "bt-svg")
        wait_for(lambda: int(svg.get_attribute("data-arrows") or 0) > 0, 10, "block table")
        seq = req["seqs"][0]
        assert int(js("return +document.getElementById('bt-svg').dataset.seq")) == seq["seq_id"]
        arrows = js(  # one read: the table is redrawn with every snapshot
            "return Array.from(document.querySelectorAll('#bt-svg path.arrow'))"
            ".map(a => [+a.dataset.logical, +a.dataset.physical])"
        )
        assert [p for _, p in arrows] == seq["block_table"]
        assert [i for i, _ in arrows] == list(range(len(seq["block_table"])))
        assert len(driver.find_elements("css selector", "#bt-seqs button")) == 4
        # The page carries no prompt text.
        assert not any(w in driver.page_source for w in SECRET_WORDS)
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
        # Charts: a new history point arrives within a few seconds while the engine runs.
        chart = driver.find_element("id", "ch-usage")
        before = chart.get_attribute("data-last-time") or ""
        gate.thaw()
        wait_for(
            lambda: (chart.get_attribute("data-last-time") or "") not in ("", before),
            15,
            "the charts to update",
        )
        assert int(chart.get_attribute("data-points")) >= 1
        for cid in ("ch-useful", "ch-reqs", "ch-tput"):
            assert int(driver.find_element("id", cid).get_attribute("data-points")) >= 1
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
        out = os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT")
        if out:  # docs: PAGEDLLM_DASHBOARD_SCREENSHOT=docs/kv-dashboard.png pytest -k chromium
            shutil.copy(tmp_path / "dashboard.png", out)
    finally:
        driver.quit()
        gate.thaw()
        for t, _ in threads:
            t.join(60)


def test_dashboard_on_a_100k_block_pool(tiny_loaded, tmp_path):
    app = build_app(
        {
            "max_model_len": 128,
            "block_size": 4,
            "num_gpu_blocks_override": 100_000,
            "swap_space": 0,
            "num_threads": 1,
        },
        loaded=tiny_loaded,
        served_model_name="tiny",
        log_stats_interval=0,
        enable_dashboard=True,
    )
    srv = ServerThread(app).start()
    driver = _chromium_driver(tmp_path)
    try:
        driver.get(srv.url + "/dashboard")
        js = driver.execute_script
        wait_for(
            lambda: js("return window.kvdash && window.kvdash.numSnapshots") >= 1,
            30,
            "the first snapshot",
        )
        t, out = stream_in_background(srv.url, PROMPTS[0], n=2, max_tokens=8)
        t.join(60)
        assert out["status"] == 200
        wait_for(lambda: js("return window.kvdash.drawnCells") > 0, 10, "grid")
        cells = js("return window.kvdash.drawnCells")
        assert 0 < cells <= 8192  # aggregated: no 100,000 squares
        assert js("return window.kvdash.snapshot.blocks.mode") == "cells"
        assert "aggregated" in driver.find_element("id", "grid-note").text
        driver.save_screenshot(str(tmp_path / "dashboard-100k.png"))
    finally:
        driver.quit()
        srv.stop()
