"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 (free port) in a thread."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx


class ServerThread:
    """Run a FastAPI app with uvicorn in a background thread until ``stop()``."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def engine(self):
        return self.app.state.async_engine.engine


def wait_idle(engine, timeout: float = 5.0) -> None:
    """Poll until the engine has no request and every KV block is free."""
    bm = engine.block_manager
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks:
            bm.check_invariants()
            return
        time.sleep(0.02)
    raise AssertionError(
        f"not idle after {timeout}s: {bm.num_free_blocks}/{bm.num_blocks} blocks free, "
        f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting"
    )


def sse_events(client: httpx.Client, path: str, body: dict, headers=None) -> list[Any]:
    """POST a streaming request and return the parsed ``data:`` events ("[DONE]" kept as str)."""
    events: list[Any] = []
    with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events


def check_chunk_shape(events: list[Any], n: int = 1, chat: bool = True) -> dict[int, str]:
    """C18 invariants; returns the streamed text per choice index."""
    chunks = [e for e in events if e != "[DONE]"]
    assert not any("error" in c for c in chunks), chunks
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    texts: dict[int, str] = {}
    finished: set[int] = set()
    seen_role: set[int] = set()
    for c in chunks:
        for ch in c["choices"]:
            i = ch["index"]
            assert "finish_reason" in ch
            assert i not in finished, f"choice {i} got a chunk after its finish_reason"
            if chat:
                if i not in seen_role:
                    assert ch["delta"].get("role") == "assistant", ch
                    seen_role.add(i)
                texts[i] = texts.get(i, "") + (ch["delta"].get("content") or "")
            else:
                texts[i] = texts.get(i, "") + ch["text"]
            if ch["finish_reason"] is not None:
                finished.add(i)
    assert finished == set(range(n)), (finished, n)
    return texts


def assert_error(r: httpx.Response, status: int, param: str | None = "__any__", code=None):
    """The response is ``status`` with exactly the OpenAI error envelope; returns its error."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def healthy(server, client) -> None:
    """After an error case: a normal request succeeds, /health is 200, every block is free."""
    r = client.post(
        "/v1/completions", json={"prompt": "hello world", "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200
    wait_idle(server.engine)


def start_tiny_server(loaded: Any, **engine_args: Any) -> ServerThread:
    """A started ``ServerThread`` serving ``loaded`` as "tiny": max_model_len 128, 4 MiB of
    KV cache, invariant checks, one thread; ``engine_args`` override or add engine options."""
    from pagedllm.entrypoints.openai.app import build_app

    args = {
        "max_model_len": 128,
        "kv_cache_memory": 1 << 22,
        "check_invariants": True,
        "num_threads": 1,
        **engine_args,
    }
    return ServerThread(build_app(args, loaded=loaded, served_model_name="tiny")).start()


def start_serve_process(serve_args: list[str], start_timeout: float = 300.0):
    """Run ``pagedllm serve`` (this interpreter, ``serve_args`` after ``serve``) on a free port
    as a subprocess and wait until ``/health`` answers 200. Returns ``(proc, url)``; stdout and
    stderr go to ``proc.stdout``. The caller stops it (``proc.kill()`` in a ``finally``).

    Raises:
        AssertionError: the process exited or did not get healthy within ``start_timeout``.
    """
    import os
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd + serve_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ}
    )
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() - t0 > start_timeout:  # a loaded 2-core host can be slow
            proc.kill()
            raise AssertionError("server did not start")
        time.sleep(0.3)


def stream_through_sigterm(
    proc, url: str, body: dict, probe_body: dict
) -> tuple[list[str], httpx.Response]:
    """Stream ``body`` from a ``pagedllm serve`` process; once its first event arrived, send
    SIGTERM, wait until ``/health`` answers 503 (draining) and POST ``probe_body``; then read the
    stream to its end. Returns (the stream's non-empty lines, the probe's response)."""
    import signal

    lines: list[str] = []
    probe = None
    with (
        httpx.Client(base_url=url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 1 and probe is None:
                proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                while httpx.get(url + "/health").status_code != 503:
                    assert time.monotonic() - t0 < 30, "the server did not start draining"
                    time.sleep(0.01)
                probe = httpx.post(url + "/v1/completions", json=probe_body)
    assert probe is not None, "the stream ended before its first event"
    return lines, probe


def check_drained_stream(proc, lines: list[str], probe: httpx.Response, num_tokens: int):
    """After ``stream_through_sigterm``: the probe got 503 ``server_draining``, the stream ran
    to its end (``num_tokens`` tokens, ``finish_reason`` length, ``[DONE]``), the process exited
    0 after logging the drain. Returns the stream's chunks."""
    assert_error(probe, 503, None, "server_draining")
    assert probe.headers["retry-after"] == "1"
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(ch["choices"][0]["token_ids"]) for ch in chunks) == num_tokens  # all of it
    assert proc.wait(timeout=60) == 0
    assert b"draining: 1 request(s) in flight" in proc.stdout.read()
    return chunks
