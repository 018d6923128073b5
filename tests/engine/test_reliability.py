"""Issue 24's engine items on the tiny random Llama: prompt logprobs after a prefix-cache hit,
streamed text that never stays held back, requests that can never be scheduled (refused up front
naming ``n`` / ``best_of``, or finished by length) and no hang after a swap-out.

Every test ends with an idle engine whose pool is consistent and entirely free.
"""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def make_engine(tiny_loaded, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("kv_cache_memory", 1 << 21)
    return LLMEngine(EngineConfig(check_invariants=True, num_threads=1, **kw), loaded=tiny_loaded)


def run_all(eng: LLMEngine, max_steps: int = 2000) -> dict:
    """Step until idle (at most ``max_steps``); returns the final output of every request."""
    final = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert not eng.has_unfinished_requests(), "the engine did not finish within the step cap"
    return final


def assert_pool_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts() == [0] * bm.num_blocks


# ---- item 1: prompt logprobs on a prompt whose first blocks are cached ---------------------------
def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_loaded):
    eng = make_engine(tiny_loaded, block_size=16)
    prompt = [(7 * i + 3) % 300 + 2 for i in range(33)]  # 33 tokens: 2 full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    eng.add_request("first", prompt, params)
    first = run_all(eng)["first"]
    eng.add_request("second", prompt, params)
    second = run_all(eng)["second"]
    # The second request took no cache hit and computed every prompt position again.
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    assert len(second.prompt_logprobs) == 33 and second.prompt_logprobs[0] is None
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None
        assert list(a) == list(b)
        for tid in a:
            assert b[tid].logprob == pytest.approx(a[tid].logprob, abs=1e-5)
            assert b[tid].rank == a[tid].rank
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # The blocks it computed are still cached for the others: 32 tokens hit without logprobs.
    eng.add_request("third", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    third = run_all(eng)["third"]
    assert third.num_cached_tokens == 32
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_free(eng)


# ---- item 2: held-back text is released after a bounded number of tokens ------------------------
def byte_token_ids(tok, *byte_values: int) -> list[int]:
    """The ids of the single-byte tokens of a byte-level BPE tokenizer (GPT-2's byte alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [tok.convert_tokens_to_ids(char[b]) for b in byte_values]


def stream_deltas(tok, ids: list[int]) -> tuple[list[str], str]:
    from pagedllm.engine.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, byte_token_ids(tok, *b"hi "))
    deltas = [d.append(t) for t in ids]
    return deltas, "".join(deltas) + d.flush()


def test_invalid_utf8_is_released_after_four_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    (cont,) = byte_token_ids(tok, 0x80)
    deltas, text = stream_deltas(tok, [cont] * 7)
    # Each lone continuation byte is U+FFFD; at most 4 tokens are ever held back.
    assert deltas == ["", "", "", "\ufffd", "\ufffd", "\ufffd", "\ufffd"]
    assert text == tok.decode([cont] * 7) == "\ufffd" * 7
    # A valid character completed after invalid bytes is never split: E2 82 AC is the euro sign,
    # F0 9F 98 80 an emoji spread over four byte tokens.
    ids = byte_token_ids(tok, 0x80, 0x80, 0x80, 0xE2, 0x82, 0xAC, 0x80, 0xF0, 0x9F, 0x98, 0x80)
    deltas, text = stream_deltas(tok, ids)
    assert text == tok.decode(ids) == "\ufffd\ufffd\ufffd\u20ac\ufffd\U0001f600"
    assert deltas == ["", "", "", "\ufffd", "\ufffd", "\ufffd\u20ac", "", "", "", "\ufffd", "\U0001f600"]
    # An emoji begun right after 3 held-back tokens: the cut leaves its bytes together.
    ids = byte_token_ids(tok, 0x80, 0xF0, 0x9F, 0x98, 0x80, 0x80)
    deltas, text = stream_deltas(tok, ids)
    assert deltas == ["", "", "", "\ufffd", "\U0001f600", ""]
    assert text == tok.decode(ids) == "\ufffd\U0001f600\ufffd"


def test_streamed_text_of_forced_invalid_bytes(tiny_loaded):
    """A lone continuation byte forced with logit_bias: the text grows while the request runs
    (one U+FFFD per token once 4 are held) and ends equal to the non-streamed text."""
    eng = make_engine(tiny_loaded)
    (cont,) = byte_token_ids(eng.tokenizer, 0x80)
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={cont: 100.0}, ignore_eos=True)
    eng.add_request("bytes", "hello world", params)
    texts = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            texts.append(out.outputs[0].text)
    assert out.finished and out.outputs[0].token_ids == [cont] * 8
    assert texts == ["", "", "", "\ufffd", "\ufffd" * 2, "\ufffd" * 3, "\ufffd" * 4, "\ufffd" * 8]
    assert texts[-1] == eng.tokenizer.decode([cont] * 8)
    assert_pool_free(eng)


# ---- item 5: no request waits forever ------------------------------------------------------------
SMALL_POOL = dict(block_size=16, num_gpu_blocks_override=16, max_num_seqs=4, max_model_len=256)


def test_more_samples_than_max_num_seqs_are_refused(tiny_loaded):
    eng = make_engine(tiny_loaded, **SMALL_POOL)
    with pytest.raises(ValueError) as e:
        eng.validate_request([5] * 10, SamplingParams(n=5, max_tokens=4))
    assert str(e.value) == "n must be <= max_num_seqs (4), got 5"
    with pytest.raises(ValueError) as e:
        eng.validate_request([5] * 10, SamplingParams(n=2, best_of=6, max_tokens=4))
    assert str(e.value) == "best_of must be <= max_num_seqs (4), got 6"
    assert eng.validate_request([5] * 10, SamplingParams(n=4, max_tokens=4)) == 4
    assert not eng.has_unfinished_requests()


def test_swapped_group_comes_back_and_later_requests_finish(tiny_loaded):
    """Issue 24's hang: a long greedy request fills the pool, a 3-sample group is swapped out
    (5 samples are refused), a small request arrives; all finish within a few hundred steps."""
    eng = make_engine(tiny_loaded, **SMALL_POOL)
    long_prompt = [(11 * i + 5) % 350 + 2 for i in range(150)]
    eng.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
    for _ in range(3):
        eng.step()
    with pytest.raises(ValueError, match="^n must be"):
        eng.add_request("n5", [7] * 20, SamplingParams(n=5, max_tokens=40, ignore_eos=True))
    eng.add_request("n3", [7] * 20, SamplingParams(n=3, max_tokens=40, seed=3, ignore_eos=True))
    eng.add_request("small", [9, 10, 11], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    final = run_all(eng, max_steps=400)
    assert set(final) == {"long", "n3", "small"}
    assert [len(c.token_ids) for c in final["long"].outputs] == [70]
    assert [len(c.token_ids) for c in final["n3"].outputs] == [40] * 3
    assert [len(c.token_ids) for c in final["small"].outputs] == [5]
    assert eng.scheduler.preemptions_by_mode["swap"] >= 1
    assert_pool_free(eng)


# ---- item 6: a default max_tokens times n may exceed the pool ------------------------------------
def test_samples_outgrowing_the_pool_finish_by_length(tiny_loaded, caplog):
    eng = make_engine(tiny_loaded, **SMALL_POOL)
    prompt = [(3 * i + 1) % 350 + 2 for i in range(40)]  # 2 full blocks + 8 tokens
    params = SamplingParams(n=3, max_tokens=None, seed=5, ignore_eos=True)
    assert eng.validate_request(prompt, params) == 216  # all the room left in max_model_len
    with caplog.at_level("WARNING", logger="pagedllm.core.scheduler"):
        eng.add_request("n3", prompt, params)
        out = run_all(eng, max_steps=400)["n3"]
    # 16 blocks: 2 shared prompt blocks, then 4 of its own for each sample (tokens 32..95); a
    # 97th token needs 3 more blocks and only 2 are left: each sample ends with 57 tokens.
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert [len(c.token_ids) for c in out.outputs] == [57] * 3
    assert len(set(c.text for c in out.outputs)) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "request n3 finished by length: its 3 sequence(s) need 3 more KV blocks, more than the "
        "pool (16 blocks of 16 tokens) would have free with every other request preempted"
    ]
    assert_pool_free(eng)
    # Afterwards a normal request runs and the pool is free again.
    eng.add_request("after", [4, 5, 6], SamplingParams(temperature=0, max_tokens=3))
    assert len(run_all(eng)["after"].outputs[0].token_ids) == 3
    assert_pool_free(eng)


def test_too_many_samples_blame_n_or_best_of(tiny_loaded):
    eng = make_engine(tiny_loaded, block_size=16, num_gpu_blocks_override=16, max_model_len=256)
    prompt = [5] * 200  # 13 blocks with a first output token, 12 of them full and shared
    with pytest.raises(ValueError) as e:
        eng.validate_request(prompt, SamplingParams(n=5, max_tokens=8))
    assert (e.value.param, str(e.value)) == (  # type: ignore[attr-defined]
        "n",
        "n: the request's 5 samples need at least 17 KV blocks (a prompt of 200 tokens shared, "
        "1 output token(s) each), more than the whole pool (16 blocks of 16 tokens)",
    )
    with pytest.raises(ValueError) as e:
        eng.validate_request(prompt, SamplingParams(n=1, best_of=5, max_tokens=8))
    assert e.value.param == "best_of"  # type: ignore[attr-defined]
    assert str(e.value).startswith("best_of: the request's 5 samples")
    assert eng.validate_request(prompt, SamplingParams(n=4, max_tokens=8)) == 8
    with pytest.raises(ValueError) as e:
        eng.validate_request([5] * 10, SamplingParams(max_tokens=250))
    assert e.value.param == "max_tokens"  # type: ignore[attr-defined]
    # Beams must all fit at their longest: 4 beams of 40 + 60 tokens need 1 + 4 * 5 blocks.
    with pytest.raises(ValueError) as e:
        eng.validate_request([5] * 40, SamplingParams(n=4, use_beam_search=True, max_tokens=60, temperature=0))
    assert str(e.value).startswith("n: the request's 4 samples need at least 22 KV blocks")
