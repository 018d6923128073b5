"""The bundled SmolLM2-135M-Instruct: greedy output equals transformers' ``generate`` (fp32).

Real-model tests (marked slow, run in CI). The reference is transformers' LlamaForCausalLM holding
the same weights (tests/model/test_loader.py checks those equal transformers' own GGUF loading).
Prompts come from tests/data/real_prompts.json with the chat template applied; the test checks
that the reference has no near-tie (top-2 logit gap < 1e-3) on any step it compares, so a
rounding difference cannot legitimately flip a token.
"""

import json
from pathlib import Path

import pytest
import torch

from pagedllm.entrypoints.llm import LLM, apply_chat_template
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
PROMPTS = json.loads((Path(__file__).parents[1] / "data" / "real_prompts.json").read_text())


@pytest.fixture(scope="module")
def hf_smollm(smollm):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.model.loader import hf_config_dict

    model = LlamaForCausalLM(LlamaConfig(**hf_config_dict(smollm.config))).eval()
    missing, unexpected = model.load_state_dict(smollm.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    return [
        apply_chat_template(smollm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def reference(hf_smollm, prompt_ids):
    """Greedy tokens from transformers for each prompt, with the smallest top-2 logit gap.

    One batched ``generate`` for all prompts (left-padded; transformers derives the attention
    mask's position ids), 32 steps instead of 32 per prompt. It gives the per-prompt tokens and
    top-2 gaps (checked on these 12 prompts) 2.2x faster (2 cores, load average 4)."""
    width = max(len(ids) for ids in prompt_ids)
    pad = [width - len(ids) for ids in prompt_ids]
    out = hf_smollm.generate(
        torch.tensor([[0] * n + ids for n, ids in zip(pad, prompt_ids)]),
        attention_mask=torch.tensor([[0] * n + [1] * len(ids) for n, ids in zip(pad, prompt_ids)]),
        max_new_tokens=NUM_TOKENS,
        min_new_tokens=NUM_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    refs = []
    for row in range(len(prompt_ids)):
        top2 = [s[row].topk(2).values for s in out.scores]
        gap = min((t[0] - t[1]).item() for t in top2)
        refs.append((out.sequences[row, width:].tolist(), gap))
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_prompts_have_no_near_ties(reference):
    assert len(reference) >= 8
    for tokens, gap in reference:
        assert len(tokens) == NUM_TOKENS and gap > 1e-3


def test_greedy_equals_transformers(smollm, prompt_ids, reference):
    llm = LLM(loaded=smollm, check_invariants=True, max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    for o, (ref, _) in zip(outs, reference):
        assert o.outputs[0].token_ids == ref
    # The chat API renders the same template.
    chat = llm.chat([{"role": "user", "content": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == reference[0][0]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_same_tokens_in_a_batch_of_32_and_any_block_size(smollm, prompt_ids, reference, block_size):
    """A batch of 32 mixed-length prompts (the real ones plus filler of other lengths)."""
    filler = [
        [
            int(t)
            for t in torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n))
        ]
        for n in range(5, 5 + 7 * (32 - len(prompt_ids)), 7)
    ]
    batch = prompt_ids + filler
    assert len(batch) == 32
    llm = LLM(loaded=smollm, block_size=block_size, check_invariants=True, max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    for o, (ref, _) in zip(outs, reference):
        assert o.outputs[0].token_ids == ref
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_same_tokens_under_recompute_preemption(smollm, prompt_ids, reference):
    """A pool too small for all sequences at once forces preemption by recompute."""
    longest = max(len(p) for p in prompt_ids) + NUM_TOKENS
    blocks = 3 * (-(-longest // 16))  # room for about three sequences
    llm = LLM(
        loaded=smollm, num_gpu_blocks_override=blocks, check_invariants=True, max_model_len=512
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for o, (ref, _) in zip(outs, reference):
        assert o.outputs[0].token_ids == ref
    assert llm.engine.block_manager.num_free_blocks == blocks


@pytest.mark.parametrize("width,lp,es", [(3, 1.0, False), (2, 0.5, True)])
def test_beam_search_equals_transformers(smollm, hf_smollm, prompt_ids, width, lp, es):
    llm = LLM(loaded=smollm, check_invariants=True, max_model_len=512)
    eos = llm.engine.eos_token_ids
    for ids in prompt_ids[:3]:
        out = hf_smollm.generate(
            torch.tensor([ids]), num_beams=width, num_return_sequences=width, max_new_tokens=16,
            length_penalty=lp, early_stopping=es, do_sample=False, eos_token_id=eos,
            pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True,
        )
        ref = []
        for row in out.sequences[:, len(ids):].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), None)
            ref.append(row if cut is None else row[: cut + 1])
        ours = llm.beam_search({"prompt_token_ids": ids}, beam_width=width, max_tokens=16,
                               length_penalty=lp, early_stopping=es, use_tqdm=False)[0]
        assert [c.token_ids for c in ours.outputs] == ref
        for c, score in zip(ours.outputs, out.sequences_scores.tolist()):
            assert abs(c.cumulative_logprob / len(c.token_ids) ** lp - score) < 1e-3
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
