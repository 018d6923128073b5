"""Overload behaviour on the tiny random Llama: the bounded waiting queue (503 + Retry-After),
per-request deadlines (``timeout``), priority scheduling end to end, /health while the engine
thread is busy, and the graceful drain.

Determinism: instead of racing the clock, a test holds the engine thread between two steps
(``call_in_engine_thread`` waiting on an event) so that requests stay queued or in flight exactly
as long as the test needs.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, QueueFullError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import drain
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import (
    assert_error,
    check_drained_stream,
    healthy,
    start_serve_process,
    start_tiny_server,
    stream_through_sigterm,
    wait_idle,
)

C = "/v1/completions"
GREEDY = {"temperature": 0, "ignore_eos": True}


def hold_engine(ae: AsyncLLMEngine) -> threading.Event:
    """Park the engine thread between two steps until the returned event is set."""
    release = threading.Event()
    ae.call_in_engine_thread(lambda _: release.wait(60))
    return release


def hold_engine_after_first_text(ae: AsyncLLMEngine) -> threading.Event:
    """Arm before sending a request: the engine thread parks before the step that follows the
    first step that produced text (a stream's first event; a partial UTF-8 token has none)
    until the returned event is set, once. Holding after reading the first event instead
    races: on a slow machine the engine can finish the whole request in between."""
    release = threading.Event()
    eng = ae.engine
    step = eng.step
    produced = False

    def step_then_park():
        nonlocal produced
        if produced:
            del eng.step  # one hold: the class's step again
            release.wait(60)
        outputs = step()
        produced = any(c.text for o in outputs for c in o.outputs)
        return outputs

    eng.step = step_then_park
    return release


def wait_for(cond, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.01)


# ---- engine level ---------------------------------------------------------------------------
def make_engine(tiny_loaded, **kw) -> LLMEngine:
    cfg = EngineConfig(
        max_model_len=128, kv_cache_memory=1 << 21, check_invariants=True, num_threads=1, **kw
    )
    return LLMEngine(cfg, loaded=tiny_loaded)


def test_engine_refuses_beyond_max_waiting_requests(tiny_loaded):
    eng = make_engine(tiny_loaded, max_waiting_requests=2)
    eng.add_request("a", "hello", SamplingParams(max_tokens=2))
    eng.add_request("b", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        eng.add_request("c", "hello", SamplingParams(max_tokens=2))
    assert list(eng.requests) == ["a", "b"]
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("c", "hello", SamplingParams(max_tokens=2))  # room again
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_llm_generate_refuses_a_batch_over_the_limit(tiny_llm_factory):
    llm = tiny_llm_factory(max_waiting_requests=2)
    sp = SamplingParams(max_tokens=2, **GREEDY)
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        llm.generate(["a", "b", "c"], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    assert len(llm.generate(["a", "b"], sp, use_tqdm=False)) == 2


def test_async_add_refused_at_once_when_queue_full(tiny_loaded):
    async def main():
        ae = AsyncLLMEngine(make_engine(tiny_loaded, max_waiting_requests=2))
        ae.start()
        release = hold_engine(ae)
        sp = SamplingParams(max_tokens=3, **GREEDY)
        adds = [asyncio.create_task(ae.add_request(r, "hello", sp)) for r in ("a", "b")]
        await asyncio.sleep(0)  # both adds are queued for the (held) engine thread
        with pytest.raises(QueueFullError):
            await ae.add_request("c", "hello", sp)  # refused without the engine thread
        release.set()
        for t in adds:
            outs = [o async for o in await t]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        ae.shutdown()

    asyncio.run(main())


def test_deadline_aborts_frees_blocks_and_keeps_the_tokens(tiny_loaded):
    eng = make_engine(tiny_loaded)

    async def main():
        ae = AsyncLLMEngine(eng)
        ae.start()
        sp = SamplingParams(max_tokens=100, **GREEDY)
        release = hold_engine_after_first_text(ae)
        stream = await ae.add_request("t", "the quick brown fox", sp, timeout=2.0)
        first = await stream.__anext__()  # a token arrived before the deadline
        await asyncio.sleep(2.1)  # the deadline passes while the engine thread is held
        release.set()
        outs = [first] + [o async for o in stream]
        last = outs[-1]
        assert last.finished and last.outputs[0].finish_reason == "timeout"
        n = len(last.outputs[0].token_ids)
        assert 1 <= n < 100
        # What was generated is the greedy prefix of an unhurried run.
        ref = [o async for o in ae.generate("ref", "the quick brown fox", sp)][-1]
        assert ref.outputs[0].token_ids[:n] == last.outputs[0].token_ids
        ae.shutdown()

    asyncio.run(main())
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "3", True])
def test_timeout_must_be_positive_seconds(tiny_loaded, bad):
    async def main():
        ae = AsyncLLMEngine(make_engine(tiny_loaded))
        ae.start()
        with pytest.raises(ValueError, match=r"^timeout must be"):
            await ae.add_request("x", "hello", SamplingParams(max_tokens=1), timeout=bad)
        ae.shutdown()

    asyncio.run(main())


def test_llm_generate_serves_by_priority(tiny_llm_factory):
    prompts = ["the quick brown fox", "paged attention", "a block table", "the lazy dog"]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    ref = tiny_llm_factory(max_num_seqs=1).generate(prompts, sp, use_tqdm=False)
    llm = tiny_llm_factory(max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(prompts, sp, use_tqdm=False, priority=[3, 1, 2, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [3, 1, 2, 0]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    with pytest.raises(ValueError, match=r"^priority: got 1 for 4 prompts"):
        llm.generate(prompts, sp, priority=[0])
    fcfs = tiny_llm_factory()
    with pytest.raises(ValueError, match=r"^priority must be 0"):
        fcfs.generate(prompts, sp, priority=[0, 0, 1, 0])
    assert not fcfs.engine.has_unfinished_requests()  # nothing was queued


# ---- server level ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_loaded):
    srv = start_tiny_server(tiny_loaded, max_waiting_requests=1)
    yield srv
    srv.stop()


def post_in_thread(url: str, body: dict, box: dict) -> threading.Thread:
    """POST ``body`` to /v1/completions from a thread; ``box["r"]`` gets the response (its
    whole text read)."""

    def run() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post(C, json=body)
            r.read()
            box["r"] = r

    t = threading.Thread(target=run)
    t.start()
    return t


def test_full_queue_503_retry_after_and_health_stays_up(server, client):
    ae = server.app.state.async_engine
    release = hold_engine(ae)
    box: dict = {}
    t = post_in_thread(server.url, {"prompt": "hello", "max_tokens": 3, **GREEDY}, box)
    try:
        wait_for(lambda: ae._pending_adds == 1)
        r = client.post(C, json={"prompt": "hello", "max_tokens": 3})
        err = assert_error(r, 503, None, "queue_full")
        assert r.headers["retry-after"] == "1" and err["type"] == "server_error"
        # /health and /metrics answer while the engine thread is held.
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
    finally:
        release.set()
        t.join(60)
    assert box["r"].status_code == 200 and box["r"].json()["choices"][0]["finish_reason"]
    healthy(server, client)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -2}, "timeout"),
        ({"priority": 1}, "priority"),  # fcfs server: only 0 (vLLM's rule)
        ({"priority": "high"}, "priority"),
    ],
)
def test_timeout_and_priority_validation(server, client, body, param):
    assert_error(client.post(C, json={"prompt": "hi", "max_tokens": 2, **body}), 400, param)
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **body})
    assert_error(r, 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_before_any_token_is_504(server, client, stream):
    ae = server.app.state.async_engine
    release = hold_engine(ae)  # nothing is generated before the deadline passes
    box: dict = {}
    body = {"prompt": "hello", "max_tokens": 5, "timeout": 0.05, "stream": stream}
    t = post_in_thread(server.url, body, box)
    try:
        wait_for(lambda: ae._pending_adds == 1)  # it arrived; its deadline runs
        time.sleep(0.1)
    finally:
        release.set()
        t.join(60)
    if stream:  # the stream had started (200): an error event, then [DONE]
        text = box["r"].text
        assert box["r"].status_code == 200
        assert '"code":"request_timeout"' in text and text.endswith("data: [DONE]\n\n")
    else:
        assert_error(box["r"], 504, "timeout", "request_timeout")
    wait_idle(server.engine)


def test_timeout_with_tokens_returns_them(server, client):
    ae = server.app.state.async_engine
    body = {"prompt": "hello", "max_tokens": 100, "timeout": 2.0, "stream": True, **GREEDY}
    release = hold_engine_after_first_text(ae)
    with client.stream("POST", C, json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        time.sleep(2.1)
        release.set()
        rest = [line for line in lines if line]
    assert first.startswith("data: {")
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"timeout"' in rest[-2]


def test_drain_refuses_new_requests_and_lets_streams_finish(server, client):
    ae = server.app.state.async_engine
    loop = ae.event_loop
    body = {"prompt": "hello", "max_tokens": 20, "stream": True, **GREEDY}
    try:
        release = hold_engine_after_first_text(ae)  # the stream stays in flight
        with client.stream("POST", C, json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)
            fut = asyncio.run_coroutine_threadsafe(drain(server.app, 30.0), loop)
            wait_for(lambda: server.app.state.lifecycle.draining)
            refused = client.post(C, json={"prompt": "hi", "max_tokens": 2})
            assert_error(refused, 503, None, "server_draining")
            assert refused.headers["retry-after"] == "1"
            assert_error(client.get("/health"), 503, None, "server_draining")
            assert client.get("/metrics").status_code == 200
            release.set()
            rest = [line for line in lines if line]
        assert fut.result(30) == 0  # nothing had to be aborted
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        # Grace period over: the in-flight stream is aborted with an error event.
        server.app.state.lifecycle.draining = False
        release = hold_engine_after_first_text(ae)
        with client.stream("POST", C, json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)
            fut = asyncio.run_coroutine_threadsafe(drain(server.app, 0.1), loop)
            assert fut.result(30) == 1
            release.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"request_aborted"' in rest[-2]
    finally:
        server.app.state.lifecycle.draining = False
    wait_idle(server.engine)


# ---- a real `pagedllm serve` process ---------------------------------------------------------
def test_serve_sigterm_drains_in_flight_stream(tmp_path, hf_tiny_model, tiny_tokenizer):
    folder = tmp_path / "tiny"
    hf_tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    proc, url = start_serve_process(
        [str(folder), "--max-model-len", "512", "--num-threads", "1"]
        + ["--shutdown-grace-period", "60", "--served-model-name", "tiny"]
    )
    try:
        body = {"prompt": "the quick brown fox", "max_tokens": 400, "stream": True, **GREEDY}
        body["return_token_ids"] = True
        lines, probe = stream_through_sigterm(proc, url, body, {"prompt": "hi", "max_tokens": 2})
        # New requests were refused while the stream went on; the stream ran to its end.
        check_drained_stream(proc, lines, probe, 400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
