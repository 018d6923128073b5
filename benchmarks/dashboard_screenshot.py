"""Screenshot of the live dashboard during a ShareGPT run with parallel sampling (issue 9 docs).

Starts ``pagedllm serve`` on the bundled model, streams ``--num-requests`` ShareGPT prompts with
``n=2`` from client threads, and saves a headless-Chromium screenshot of ``/dashboard`` while they
run. Needs Debian's chromium + chromium-driver and selenium (installed by ``.ci/run`` / dev extra).

    .venv/bin/python benchmarks/dashboard_screenshot.py --out docs/kv-dashboard-sharegpt.png
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA_DIR  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--wait", type=float, default=25.0, help="seconds of streaming before the shot")
    ap.add_argument("--out", default="docs/kv-dashboard-sharegpt.png")
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--kv-cache-memory",
            str(64 << 20),
            "--max-model-len",
            "1024",
        ],
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        records = json.loads((DATA_DIR / "sharegpt_1024.json").read_text())
        prompts = [r["conversations"][0]["value"][:1500] for r in records[: args.num_requests]]

        def client(p: str) -> None:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": p}],
                "n": 2,
                "max_tokens": 200,
                "temperature": 0.8,
                "stream": True,
            }
            try:
                with httpx.stream(
                    "POST", base + "/v1/chat/completions", json=body, timeout=600
                ) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=client, args=(p,), daemon=True) for p in prompts]
        for t in threads:
            t.start()
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
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
            f"--user-data-dir={tempfile.mkdtemp()}",
            "--window-size=1400,1300",
        ):
            opts.add_argument(a)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        try:
            driver.get(base + "/dashboard")
            time.sleep(args.wait)
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}")
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
