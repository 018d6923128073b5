"""Speculative decoding with structured outputs (issue 25) on the tiny random Llama (fp32): the
grammar cuts each proposal at its first rejected token and masks every verification row as if
the drafts before it had been generated, so JSON-schema / regex / choice requests give the
speculation-off tokens (greedy and seeded sampling), valid under the grammar, with drafts really
accepted; the matchers advance only by the emitted tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.sequence import Sequence, SequenceGroup
from pagedllm.structured.mask import unpack_bitmask
from tests.spec_decode.test_spec_engine import OracleProposer

S = StructuredOutputsParams
# learn_step_cost off: these tests count drafts, which a timing-learned policy may cut.
SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64, '
        '"learn_step_cost": false}')
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"enum": ["xy", "z"]}}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# Repetitive prompts: the n-gram proposer finds the phrase again in the output.
PROMPTS = ["abab abab abab abab abab", "hello hello hello hello", 'the "a": "a", "a": "a" cat']
CONSTRAINTS = {
    "json": (S(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "regex": (S(regex="(ab ?){3,12}[0-9]{2}"), lambda t: re.fullmatch("(ab ?){3,12}[0-9]{2}", t)),
    "choice": (S(choice=["hello hello hello", "abab abab", "no"]),
               lambda t: t in ("hello hello hello", "abab abab", "no")),
}
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=32),
    "seeded": SamplingParams(temperature=0.8, seed=11, max_tokens=32),
}


def run(llm, spec: StructuredOutputsParams, params: SamplingParams) -> list[tuple[list[int], str, str]]:
    sp = params.clone()
    sp.structured_outputs = spec
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=tiny_loaded, max_model_len=256, kv_cache_memory=1 << 22)
    return {(c, p): run(llm, CONSTRAINTS[c][0], PARAMS[p]) for c in CONSTRAINTS for p in PARAMS}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_ngram_equals_speculation_off(tiny_llm_factory, reference, constraint, params):
    spec, valid = CONSTRAINTS[constraint]
    llm = tiny_llm_factory(speculative_config=SPEC)
    got = run(llm, spec, PARAMS[params])
    assert got == reference[(constraint, params)]
    for _, text, reason in got:
        if reason == "stop":
            assert valid(text), text
    st = llm.engine.stats
    assert st.spec_accepted_tokens > 0  # proposals survived the grammar and were accepted
    assert llm.engine.structured.num_matchers == 0


def oracle(llm, reference, key):
    """Proposes the reference output of ``key`` for each prompt."""
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    return OracleProposer({tuple(i): ref[0] for i, ref in zip(ids, reference[key], strict=True)})


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_oracle_drafts_accepted_under_grammar(tiny_llm_factory, reference, constraint):
    # Proposing the reference output itself: every draft passes the grammar and is accepted.
    llm = tiny_llm_factory(speculative_config=SPEC)
    llm.engine.engine_core.speculator.proposer = oracle(llm, reference, (constraint, "greedy"))
    assert run(llm, CONSTRAINTS[constraint][0], PARAMS["greedy"]) == reference[(constraint, "greedy")]
    st = llm.engine.stats
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0


class OffGrammarProposer:
    """Proposes the reference's next token, then a token no grammar here allows ("}" + "}")."""

    def __init__(self, inner: OracleProposer, bad: int) -> None:
        self.inner, self.bad = inner, bad

    def propose(self, token_ids, num_prompt_tokens, k, request_id):  # type: ignore[no-untyped-def]
        return (self.inner.propose(token_ids, num_prompt_tokens, 1, request_id) + [self.bad] * k)[:k]

    def on_request_finished(self, token_ids, num_prompt_tokens, request_id):  # type: ignore[no-untyped-def]
        pass


def test_proposals_cut_at_first_rejected_token(tiny_llm_factory, reference):
    llm = tiny_llm_factory(speculative_config=SPEC)
    bad = llm.get_tokenizer().encode("}}}")[0]
    spec = llm.engine.engine_core.speculator
    spec.proposer = OffGrammarProposer(oracle(llm, reference, ("regex", "greedy")), bad)
    assert run(llm, CONSTRAINTS["regex"][0], PARAMS["greedy"]) == reference[("regex", "greedy")]
    st = llm.engine.stats
    # Only the first (valid) token of each proposal is verified, and it is always accepted.
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0
    assert len(st.spec_draft_per_pos) == 1


def test_draft_bitmask_rows_and_rollback(tiny_llm_factory):
    llm = tiny_llm_factory()
    mgr = llm.engine.structured
    tok = llm.get_tokenizer()
    sp = SamplingParams(structured_outputs=S(regex="ab(cd)+"))
    mgr.validate(sp.structured_outputs)
    seq = Sequence(0, tok.encode("x"), seed=0)
    group = SequenceGroup("r", [seq], sp, None, 0, RequestMetrics(0.0), 16)
    mgr.submit(group)
    draft = tok.encode("abcdcd", add_special_tokens=False)
    bad = tok.encode("zz", add_special_tokens=False)
    assert mgr.valid_draft_length(seq, group, draft) == len(draft)
    assert mgr.valid_draft_length(seq, group, draft[:1] + bad) == 1
    mask = mgr.fill_draft_bitmask([(seq, group, draft)])
    assert mask is not None and mask.rows == list(range(len(draft) + 1))
    # Row j allows draft[j]; the walk left the matcher at the start (it accepts "ab" again).
    allowed = unpack_bitmask(mask.bitmask, llm.engine.model_config.vocab_size)
    for j, t in enumerate(draft):
        assert allowed[j, t]
    eos = llm.engine.eos_token_ids[0]
    assert allowed[len(draft), eos] and not allowed[0, eos]
    assert mgr.valid_draft_length(seq, group, draft) == len(draft)
    mgr.release(group)
