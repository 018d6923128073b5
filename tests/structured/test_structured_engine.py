"""Structured outputs on the tiny random Llama: the mask, EOS, forks (n > 1), preemption by
swap and recompute, prefix caching, invalid constraints, and the scheduler waiting for a
compile. Every LLM built by ``tiny_llm_factory`` must end with every KV block free."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm.sampling.sampler import Sampler, SamplingBatch
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured.mask import (
    TokenBitmask,
    apply_token_bitmask_,
    apply_token_bitmask_torch_,
    unpack_bitmask,
)

S = StructuredOutputsParams
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
PROMPTS = ["hello there", "the cat sat"]


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=g,
                         dtype=torch.int32)


def test_unpack_bitmask_bits() -> None:
    bm = torch.tensor([[0b1011, -(2**31)]], dtype=torch.int32)  # ids 0, 1, 3 and 63
    allowed = unpack_bitmask(bm, 64)[0].nonzero().flatten().tolist()
    assert allowed == [0, 1, 3, 63]
    with pytest.raises(ValueError, match="words"):
        unpack_bitmask(bm, 65)


@pytest.mark.parametrize("apply", [apply_token_bitmask_, apply_token_bitmask_torch_])
@pytest.mark.parametrize("vocab", [100, 96])
def test_apply_bitmask_one_op_on_chosen_rows(apply, vocab) -> None:  # type: ignore[no-untyped-def]
    logits = torch.randn(4, vocab + 5)  # padded logits: columns past the bitmask are disallowed
    bm = _random_bitmask(4, vocab, 0)
    out = apply(logits.clone(), bm, [1, 3])
    allowed = unpack_bitmask(bm, vocab)
    for row in [1, 3]:
        expect = logits[row, :vocab].masked_fill(~allowed[row], float("-inf"))
        assert torch.equal(out[row, :vocab], expect)
        width = bm.shape[1] * 32
        assert torch.isinf(out[row, width:]).all()
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    out_all = apply(logits.clone(), bm)
    assert torch.equal(out_all[:, :vocab], logits[:, :vocab].masked_fill(~allowed, float("-inf")))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_respects_mask(temperature: float) -> None:
    vocab = 64
    logits = torch.randn(2, vocab)
    bm = torch.zeros(2, 2, dtype=torch.int32)
    bm[1, 1] = 1 << 5  # row 1 may only take token 37
    params = [SamplingParams(temperature=temperature, seed=3)] * 2
    batch = SamplingBatch(params, [3, 3], [[], []], [[1], [1]], [0])
    free = Sampler(vocab)(logits, batch)
    batch.token_bitmask = TokenBitmask(bm, [1])
    masked = Sampler(vocab)(logits, batch)
    assert masked.sampled_token_ids == [free.sampled_token_ids[0], 37]
    # logprobs stay those of the raw model distribution
    assert masked.sampled_logprobs[1] == pytest.approx(float(logits[1].log_softmax(-1)[37]))


def test_grammar_wins_over_min_tokens_when_only_eos_is_left() -> None:
    vocab = 64
    logits = torch.randn(1, vocab)
    bm = torch.zeros(1, 2, dtype=torch.int32)
    bm[0, 0] = 1 << 2  # the grammar allows only EOS (id 2) now
    batch = SamplingBatch([SamplingParams(temperature=1.0, min_tokens=5)], [1], [[7]], [[1]], [2],
                          token_bitmask=TokenBitmask(bm, [0]))
    assert Sampler(vocab)(logits, batch).sampled_token_ids == [2]


def _texts(llm, prompts, sp):  # type: ignore[no-untyped-def]
    return [[(c.text, c.finish_reason) for c in o.outputs]
            for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (S(regex="[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        (S(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
        # characters outside the BMP (json.dumps' surrogate-pair escapes made them CESU-8)
        (S(choice=["🌶", "maybe 🌶", "€"]), lambda t: t in ("🌶", "maybe 🌶", "€")),
        (S(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (S(json=json.dumps(SCHEMA), disable_any_whitespace=True),
         lambda t: " " not in t and jsonschema.validate(json.loads(t), SCHEMA) is None),
        (S(grammar='root ::= "ab" [0-9]+ "!"'), lambda t: re.fullmatch("ab[0-9]+!", t)),
        (S(grammar='start: "ab" DIGITS "!"\nDIGITS: /[0-9]+/'), lambda t: re.fullmatch("ab[0-9]+!", t)),
        # allOf of a type and a bound, merged into one schema (xgrammar alone kept one of them)
        (S(json={"allOf": [{"type": "integer"}, {"minimum": 1000, "maximum": 1200}]}),
         lambda t: 1000 <= int(t) <= 1200),
    ],
    ids=["regex", "choice", "choice_emoji", "json", "json_compact", "ebnf", "lark", "all_of_merged"],
)
def test_outputs_follow_the_constraint_n2(tiny_llm_factory, spec, check) -> None:
    llm = tiny_llm_factory()
    sp = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=120, structured_outputs=spec)
    for outs in _texts(llm, PROMPTS, sp):
        for text, reason in outs:
            assert reason == "stop", text  # ended by EOS, allowed only once the grammar accepts
            assert check(text), text
    assert llm.engine.structured.num_matchers == 0  # matchers released with their requests


def test_eos_only_when_grammar_accepts(tiny_llm_factory) -> None:
    llm = tiny_llm_factory()
    eos = llm.engine.eos_token_ids
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=20,
                                            structured_outputs=S(regex="aaaa")), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == "aaaa" and c.finish_reason == "stop" and c.token_ids[-1] in eos
    # Cut by max_tokens before the grammar can end: "length", a valid prefix, no EOS.
    c = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2,
                                          structured_outputs=S(regex="[0-9]{30}")),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and re.fullmatch("[0-9]+", c.text)


def test_ignore_eos_goes_on_unconstrained_after_the_grammar_ends(tiny_llm_factory) -> None:
    llm = tiny_llm_factory()
    eos = llm.engine.eos_token_ids
    c = llm.generate("hi", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                          structured_outputs=S(regex="ab")),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    first_eos = next(k for k, t in enumerate(c.token_ids) if t in eos)  # the grammar's ending
    assert llm.get_tokenizer().decode(c.token_ids[:first_eos]) == "ab"


PREEMPT_PROMPTS = [list(range(10, 42)) + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_output_valid_and_equal(tiny_llm_factory, mode) -> None:
    sp = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=40,
                        structured_outputs=S(regex="[a-z]{200}"))
    alone = tiny_llm_factory(block_size=16, max_model_len=96)
    ref = [_texts(alone, [p], sp)[0] for p in PREEMPT_PROMPTS]
    llm = tiny_llm_factory(block_size=16, num_gpu_blocks_override=12, max_model_len=96,
                           preemption_mode=mode, enable_prefix_caching=False)
    got = _texts(llm, PREEMPT_PROMPTS, sp)
    assert got == ref
    assert all(re.fullmatch("[a-z]+", t) for outs in got for t, _ in outs)
    assert llm.engine.scheduler.preemptions_by_mode[mode] > 0


def test_prefix_cache_hit_keeps_output(tiny_llm_factory) -> None:
    llm = tiny_llm_factory(block_size=4, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(json=SCHEMA))
    prompt = "the cat sat on the mat and the dog sat on the log"
    first = llm.generate(prompt, sp, use_tqdm=False)[0]
    second = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (S(regex="(ab"), "structured_outputs.regex"),
        (S(json={"type": "objec"}), "structured_outputs.json"),
        (S(json="{not json"), "structured_outputs.json"),
        (S(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
        (S(regex="a", whitespace_pattern=" *"), "structured_outputs.whitespace_pattern"),
        (S(regex="[^\\x00-\\U0010FFFF]"), "structured_outputs.regex is invalid: it matches no string"),
        (S(regex="a^b"), "structured_outputs.regex is invalid: '^' is supported only at the start"),
        (S(regex="a\\Zb"), "structured_outputs.regex is invalid: '\\Z' is not supported"),
        (S(json={"type": "integer", "not": {"const": 3}}), "structured_outputs.json is invalid: 'not' at /"),
        (S(json={"type": "array", "uniqueItems": True}), "structured_outputs.json is invalid: 'uniqueItems'"),
    ],
)
def test_invalid_constraint_is_value_error(tiny_llm_factory, spec, field) -> None:
    llm = tiny_llm_factory()
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("hi", SamplingParams(structured_outputs=spec), use_tqdm=False)
    # the engine is fine afterwards
    assert llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs


def test_compile_failure_inside_engine_aborts_only_that_request(tiny_llm_factory) -> None:
    llm = tiny_llm_factory()
    eng = llm.engine
    eng.add_request("bad", "hi", SamplingParams(structured_outputs=S(regex="(ab")))  # unvalidated
    eng.add_request("good", "hi", SamplingParams(max_tokens=4, temperature=0))
    finished = {}
    for _ in range(100):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
        if not eng.has_unfinished_requests():
            break
    assert finished == {"bad": "abort", "good": "length"}


def test_waiting_for_grammar_does_not_stall_others(tiny_llm_factory) -> None:
    llm = tiny_llm_factory()
    eng = llm.engine
    sched = eng.scheduler
    eng.add_request("slow", "hi", SamplingParams(max_tokens=2, structured_outputs=S(regex="a+")))
    eng.add_request("plain", "hi", SamplingParams(max_tokens=2, temperature=0))
    is_ready = sched.is_ready
    sched.is_ready = lambda g: g.request_id != "slow"  # its compile "is still running"
    eng.step()
    assert [g.request_id for g in sched.running] == ["plain"]
    assert [g.request_id for g in sched.waiting] == ["slow"]
    sched.is_ready = is_ready
    while eng.has_unfinished_requests():
        eng.step()
