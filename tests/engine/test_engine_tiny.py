"""End-to-end engine behaviour on the tiny random Llama, checked against transformers.

Every LLM here runs the block-manager invariant check after each step, and the fixture asserts
that every block is free when the test ends.
"""

import pytest
import torch

from pagedllm.sampling_params import SamplingParams

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog and then",
    "a block table maps",
    "paged attention stores keys and values in blocks; continuous batching lets new requests join",
    "x",
]


def hf_greedy(hf_model, ids, n):
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=n,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def reference(request, tiny_tokenizer):
    hf = request.getfixturevalue("hf_tiny_model")
    return {p: hf_greedy(hf, tiny_tokenizer(p).input_ids, 24) for p in PROMPTS}


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_greedy_batch_equals_transformers(tiny_llm_factory, reference, block_size):
    llm = tiny_llm_factory(block_size=block_size)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == reference[p], p
        assert o.outputs[0].finish_reason == "length"
        assert o.prompt == p


def test_alone_equals_batched(tiny_llm_factory, reference):
    llm = tiny_llm_factory()
    for p in PROMPTS:
        assert llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[p]


def test_tiny_pool_preempts_and_keeps_outputs(tiny_llm_factory, reference):
    # 6 blocks x 8 tokens: the 5 prompts (up to ~40 tokens) + 24 outputs cannot all fit.
    llm = tiny_llm_factory(block_size=8, num_gpu_blocks_override=12, max_model_len=96)
    outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for p, o in zip(PROMPTS * 2, outs):
        assert o.outputs[0].token_ids == reference[p]


def test_seeded_sampling_survives_batching_and_preemption(tiny_llm_factory):
    params = [
        SamplingParams(
            temperature=0.8,
            seed=11 + i,
            frequency_penalty=1.0,
            repetition_penalty=1.2,
            top_p=0.9,
            max_tokens=24,
            ignore_eos=True,
        )
        for i in range(len(PROMPTS))
    ]
    big = tiny_llm_factory()
    alone = [
        big.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(PROMPTS, params)
    ]
    batched = [o.outputs[0].token_ids for o in big.generate(PROMPTS, params, use_tqdm=False)]
    small = tiny_llm_factory(block_size=8, num_gpu_blocks_override=12, max_model_len=96)
    pressed = [
        o.outputs[0].token_ids for o in small.generate(PROMPTS * 2, params * 2, use_tqdm=False)
    ]
    assert small.engine.stats.num_preemptions > 0
    assert batched == alone
    assert pressed == alone * 2
    assert len({tuple(t) for t in alone}) == len(PROMPTS)


def test_chunked_prefill_equals_whole_prefill(tiny_llm_factory, reference):
    llm = tiny_llm_factory(enable_chunked_prefill=True, max_num_batched_tokens=5, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == reference[p]


def test_max_tokens_and_max_model_len(tiny_llm_factory, tiny_tokenizer):
    llm = tiny_llm_factory(max_model_len=32)
    ids = tiny_tokenizer(PROMPTS[1]).input_ids
    out = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 32 - len(ids)
    assert out.outputs[0].finish_reason == "length"


def test_max_model_len_past_the_trained_positions_warns(tiny_llm_factory, caplog):
    """The tiny model's max_position_embeddings is 512: longer runs (rotary positions go on),
    with a warning; vLLM refuses it unless told to allow it."""
    with caplog.at_level("WARNING", logger="pagedllm.engine.llm_engine"):
        tiny_llm_factory(max_model_len=512)
    assert "max_position_embeddings" not in caplog.text
    with caplog.at_level("WARNING", logger="pagedllm.engine.llm_engine"):
        tiny_llm_factory(max_model_len=1024)
    assert "max_model_len (1024) exceeds the model's max_position_embeddings (512)" in caplog.text


def test_stop_token_ids_and_min_tokens(tiny_llm_factory, reference, tiny_tokenizer):
    llm = tiny_llm_factory()
    ref = reference[PROMPTS[0]]
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[k]]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ref[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[k]
    # The stop token's text is left out of the output.
    assert out.text == tiny_tokenizer.decode(ref[:k])


def test_stop_string_cut_and_included(tiny_llm_factory, reference, tiny_tokenizer):
    llm = tiny_llm_factory()
    ref = reference[PROMPTS[2]]
    full = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert full == tiny_tokenizer.decode(ref)
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    assert stop and full.find(stop) >= 0
    i = full.find(stop)
    out = llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == full[:i] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(
        PROMPTS[2],
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == full[: i + len(stop)]


def test_eos_stops_unless_ignored(tiny_llm_factory, tiny_loaded, reference):
    # Make a reference token (first seen at k >= 2) an EOS id: generation must stop there.
    ref = reference[PROMPTS[0]]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    llm = tiny_llm_factory()
    llm.engine.eos_token_ids = [ref[k]]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == ref


def test_logprobs_are_raw_model_logprobs(tiny_llm_factory, hf_tiny_model, tiny_tokenizer):
    llm = tiny_llm_factory()
    p = PROMPTS[1]
    ids = tiny_tokenizer(p).input_ids
    o = llm.generate(
        p,
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    full = ids + o.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_tiny_model(torch.tensor([full])).logits[0].float(), -1)
    c = o.outputs[0]
    for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(ids) - 1 + j]
        assert entry[tok].rank == 1 and abs(entry[tok].logprob - row.max().item()) < 1e-4
        top2 = row.topk(2).indices.tolist()
        assert set(top2) <= set(entry) and len(entry) == 2
    assert (
        abs(c.cumulative_logprob - sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        < 1e-4
    )
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        assert abs(o.prompt_logprobs[j][ids[j]].logprob - ref[j - 1, ids[j]].item()) < 1e-4


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([10**6], SamplingParams(), "prompt"),
        ([-1], SamplingParams(), "prompt"),
        ("hello", SamplingParams(max_tokens=10**5), "max_tokens"),
        ("hello", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("hello", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        ("hello", SamplingParams(logprobs=50), "logprobs"),
        (None, SamplingParams(), "prompt"),  # was a TypeError
        ({"prompt": 5}, SamplingParams(), "prompt"),
    ],
)
def test_bad_input_rejected_before_engine(tiny_llm_factory, prompt, params, field):
    llm = tiny_llm_factory()
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate(["hello world", prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # The engine still serves a good request afterwards.
    out = llm.generate("hello world", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24


def test_numpy_and_torch_integer_token_ids_are_token_ids(tiny_llm_factory, reference):
    """Were refused as "not integers in the vocabulary" (np.int64 is no int subclass)."""
    import numpy as np

    llm = tiny_llm_factory()
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    sp = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].outputs[0].token_ids
    for given in (np.array(ids), torch.tensor(ids), [np.int32(t) for t in ids]):
        out = llm.generate({"prompt_token_ids": given}, sp, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    for bad in ([np.float32(1.0)], torch.tensor([True, False]), np.array([True])):
        with pytest.raises(ValueError, match="not integers in the vocabulary"):
            llm.generate({"prompt_token_ids": bad}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt must be a string or a sequence of token ids"):
        llm.generate({"prompt_token_ids": torch.tensor(3)}, sp, use_tqdm=False)


def test_cache_salt_must_be_a_non_empty_string(tiny_llm_factory):
    engine = tiny_llm_factory().engine
    for bad in ("", b"x", 3):
        with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
            engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=1), cache_salt=bad)
    assert not engine.has_unfinished_requests()


def test_prompt_dicts_take_a_cache_salt(tiny_llm_factory):
    """As vLLM's prompt dicts: only prompts under the same salt share prefix-cache blocks."""
    llm = tiny_llm_factory(block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=1)
    prompt = PROMPTS[2] * 3

    def cached(**salt):
        return llm.generate({"prompt": prompt, **salt}, sp, use_tqdm=False)[0].num_cached_tokens

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="a") > 0
    assert cached(cache_salt="b") == 0
    assert cached() == 0
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, sp, use_tqdm=False)


def test_bad_request_does_not_disturb_running_ones(tiny_llm_factory, reference):
    llm = tiny_llm_factory()
    eng = llm.engine
    eng.add_request("good", PROMPTS[0], GREEDY)
    eng.step()
    with pytest.raises(ValueError):
        eng.add_request("bad", [10**6], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("good", PROMPTS[1], GREEDY)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].request_id == "good" and outs[-1].outputs[0].token_ids == reference[PROMPTS[0]]


def test_abort_frees_blocks_mid_generation(tiny_llm_factory):
    llm = tiny_llm_factory()
    eng = llm.engine
    eng.add_request("a", PROMPTS[3], GREEDY)
    eng.add_request("b", PROMPTS[1], GREEDY)
    eng.step()
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort_request("a") and not eng.abort_request("nope")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_streamed_text_only_grows_and_ends_equal(tiny_llm_factory):
    llm = tiny_llm_factory()
    eng = llm.engine
    eng.add_request(
        "s",
        PROMPTS[3],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["zzzz"]),
    )
    texts = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            texts.append(o.outputs[0].text)
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)
    final = texts[-1]
    assert len(texts[-2]) <= len(final) - 0  # held-back tail released at the end


def test_prefill_first_keeps_greedy_outputs(tiny_llm_factory, reference):
    """``prefill_first``: requests arriving while others decode (and waiting for a slot) are
    prefilled in steps of their own; every output still equals transformers'."""
    llm = tiny_llm_factory(prefill_first=True, max_num_seqs=2)
    eng = llm.engine
    lengths = {p: 8 + 4 * i for i, p in enumerate(PROMPTS)}  # staggered finishes free slots
    got: dict[str, list[int]] = {}
    pending = list(PROMPTS)
    steps_alone = 0
    while pending or eng.has_unfinished_requests():
        if pending:  # one arrival per step while others run
            p = pending.pop(0)
            eng.add_request(
                p, p, SamplingParams(temperature=0, max_tokens=lengths[p], ignore_eos=True)
            )
        running_before = len(eng.scheduler.running)
        outs = eng.step()
        if running_before and outs and all(o.request_id not in got for o in outs):
            steps_alone += all(len(o.outputs[0].token_ids) == 1 for o in outs)
        for o in outs:
            got[o.request_id] = list(o.outputs[0].token_ids)
    assert steps_alone >= 1  # some admission ran without the running decodes
    for p in PROMPTS:
        assert got[p] == reference[p][: lengths[p]]


def test_min_tokens_holds_back_a_stop_string_completed_by_its_last_token(
    tiny_llm_factory, reference, tiny_tokenizer
):
    """Case C06: with min_tokens = max_tokens = k, a stop string that the k-th token completes
    does not cut the output (the cut would leave fewer than min_tokens tokens): k tokens,
    finish_reason "length". One token later it stops as usual."""
    llm = tiny_llm_factory()

    def first_stop(prompt: str) -> tuple[int, str] | None:
        """(k, the text's last character) where that character appears first with token k."""
        ref = reference[prompt]
        for k in range(4, len(ref)):
            text = tiny_tokenizer.decode(ref[:k])
            new_char = text[-1:].strip() and "\ufffd" not in text[-1] and text[-1] not in text[:-1]
            if new_char and text[:-1] == tiny_tokenizer.decode(ref[: k - 1]):
                return k, text[-1]
        return None

    prompt = next(p for p in PROMPTS if first_stop(p))
    ref = reference[prompt]
    k, stop = first_stop(prompt)
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=k, min_tokens=k, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ref[:k] and out.finish_reason == "length"
    assert out.text == tiny_tokenizer.decode(ref[:k])
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=k, min_tokens=k - 1, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:k]
