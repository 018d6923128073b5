"""Issue 24's engine items through the tiny server with a small pool (16 blocks of 16 tokens,
``max_num_seqs`` 4, ``max_model_len`` 256): ``echo`` + ``logprobs`` on a cached prompt, streamed
invalid bytes, no hang after a swap-out, ``n`` without ``max_tokens`` and an engine thread that
sleeps when it has nothing to do.

After every case a normal request succeeds and, once idle, every KV block is free (``healthy``;
the autouse fixture also waits for idle after each test).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.app import build_app
from pagedllm.sampling_params import SamplingParams
from tests.engine.test_reliability import byte_token_ids
from tests.entrypoints import server_utils
from tests.entrypoints.server_utils import ServerThread, assert_error, healthy
from tests.entrypoints.test_server_reliability import CHAT, CMPL, ok

SMALL_POOL = {"block_size": 16, "num_gpu_blocks_override": 16, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    app = build_app(
        {
            **SMALL_POOL,
            "max_model_len": 256,
            "check_invariants": True,
            "max_logprobs": 5,
            "num_threads": 1,
        },
        loaded=tiny_loaded,
        served_model_name="tiny",
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


# ---- item 1 -----------------------------------------------------------------------------------
def test_echo_logprobs_on_a_cached_prompt(client, server):
    prompt = [(5 * i + 7) % 350 + 2 for i in range(33)]  # 2 full blocks cached after the first
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0}
    first = ok(client, CMPL, body)["choices"][0]["logprobs"]
    second = ok(client, CMPL, body)["choices"][0]["logprobs"]
    assert len(first["token_logprobs"]) == 35 and first["token_logprobs"][0] is None
    assert second["tokens"] == first["tokens"]
    assert second["token_logprobs"][1:] == pytest.approx(first["token_logprobs"][1:], abs=1e-5)
    healthy(server, client)


# ---- item 2 -----------------------------------------------------------------------------------
def test_streamed_invalid_bytes_are_released(client, server):
    (cont,) = byte_token_ids(server.engine.tokenizer, 0x80)
    body = {
        "prompt": "hello world",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(cont): 100},
    }
    plain = ok(client, CMPL, body)["choices"][0]["text"]
    assert plain == "\ufffd" * 40
    events = server_utils.sse_events(client, CMPL, {**body, "stream": True})
    texts = server_utils.check_chunk_shape(events, chat=False)
    assert texts[0] == plain
    # the text arrives while the request runs, not in one piece at its end
    pieces = [c["choices"][0]["text"] for c in events[:-1] if c["choices"] and c["choices"][0]["text"]]
    assert len(pieces) > 1
    healthy(server, client)


# ---- item 5 -----------------------------------------------------------------------------------
def test_more_samples_than_max_num_seqs_is_a_400(client, server):
    body = {"prompt": "hello", "max_tokens": 4}
    err = assert_error(client.post(CMPL, json={**body, "n": 5}), 400, "n")
    assert err["message"] == "n must be <= max_num_seqs (4), got 5"
    err = assert_error(client.post(CMPL, json={**body, "n": 2, "best_of": 6}), 400, "best_of")
    assert err["message"] == "best_of must be <= max_num_seqs (4), got 6"
    healthy(server, client)


def test_no_hang_after_a_swap_out(client, server):
    """The issue's scenario: a 150-word greedy request (cut to fit max_model_len), 0.5 s later
    n=5 (refused, naming ``n``) and n=3 (which the growing long request may preempt), then a
    small request: all answered within seconds."""
    words = " ".join(["paged attention stores keys and values in blocks"] * 19).split()[:150]
    # the tiny tokenizer makes ~2 tokens of a word: keep prompt + 70 within max_model_len (256)
    while len(server.engine.tokenize(" ".join(words))) > 180:
        words = words[:-10]
    long_body = {"prompt": " ".join(words), "max_tokens": 70, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=server.url, timeout=30) as c:
        long = pool.submit(c.post, CMPL, json=long_body)
        time.sleep(0.5)
        n5 = pool.submit(c.post, CMPL, json={"prompt": "hello world", "n": 5, "max_tokens": 40})
        n3 = pool.submit(
            c.post, CMPL, json={"prompt": "hello world", "n": 3, "max_tokens": 40, "ignore_eos": True}
        )
        small = pool.submit(c.post, CMPL, json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        results = {k: f.result() for k, f in {"long": long, "n5": n5, "n3": n3, "small": small}.items()}
    assert time.monotonic() - t0 < 30
    assert_error(results["n5"], 400, "n")
    for name, n_choices, n_tokens in (("long", 1, 70), ("n3", 3, 40), ("small", 1, 4)):
        r = results[name]
        assert r.status_code == 200, (name, r.text)
        assert len(r.json()["choices"]) == n_choices
        assert r.json()["usage"]["completion_tokens"] == n_choices * n_tokens
    healthy(server, client)


def test_idle_engine_thread_sleeps(client, server):
    healthy(server, client)
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(1.0)
    assert (time.process_time() - c0) / (time.monotonic() - t0) < 0.05


def test_engine_with_nothing_schedulable_sleeps(tiny_loaded):
    """A step that makes no progress while a request is live (forced here) backs off: at most
    60 steps a second, and the process uses under 15% of a core instead of spinning (~100%).
    (process_time counts every thread of the test process: under the suite's two busy workers
    an idle process read 5.5% once, 2026-12-06.)"""
    eng = LLMEngine(EngineConfig(max_model_len=128, num_threads=1), loaded=tiny_loaded)
    calls = []
    real_step = eng.step
    eng.step = lambda: calls.append(1) or []  # type: ignore[method-assign]

    async def main() -> tuple[float, int]:
        ae = AsyncLLMEngine(eng, log_stats_interval=0)
        ae.start()
        stream = await ae.add_request("stuck", "hello", SamplingParams(max_tokens=2))
        await asyncio.sleep(0.2)
        t0, c0, n0 = time.monotonic(), time.process_time(), len(calls)
        await asyncio.sleep(1.0)
        cpu = (time.process_time() - c0) / (time.monotonic() - t0)
        steps = len(calls) - n0
        eng.step = real_step  # type: ignore[method-assign]
        async for out in stream:
            last = out
        ae.shutdown()
        assert last.finished
        return cpu, steps

    cpu, steps = asyncio.run(main())
    assert cpu < 0.15 and steps <= 60, (cpu, steps)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# ---- item 6 -----------------------------------------------------------------------------------
def test_chat_n3_without_max_tokens(client, server):
    body = {"messages": [{"role": "user", "content": "hello world"}], "n": 3, "ignore_eos": True}
    out = ok(client, CHAT, body)
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
    assert out["usage"]["completion_tokens"] > 3 * 16
    healthy(server, client)


def test_huge_n_or_best_of_is_blamed_on_them(client, server):
    prompt = [5] * 250  # 16 blocks with a first output token, 15 of them full and shared
    err = assert_error(
        client.post(CMPL, json={"prompt": prompt, "n": 4, "max_tokens": 4}), 400, "n"
    )
    assert err["message"].startswith("n: the request's 4 samples need at least 19 KV blocks")
    err = assert_error(
        client.post(CMPL, json={"prompt": prompt, "n": 1, "best_of": 4, "max_tokens": 4}),
        400,
        "best_of",
    )
    assert err["message"].startswith("best_of: the request's 4 samples")
    healthy(server, client)
