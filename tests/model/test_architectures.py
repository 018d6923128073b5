"""Every registered architecture equals transformers on a tiny random model: greedy tokens over
prefill + decode, alone and batched with mixed prompt lengths, at several block sizes, with
logprobs within 1e-4 (only steps whose reference top-2 gap exceeds 1e-3 count; most must).

Windowed models (Mistral; Gemma 3's local layers) get prompts longer than their 8-token window.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model, compare_to_reference, greedy_reference

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
PROMPT_LENS = [3, 11, 20, 37]
STEPS = 16


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{arch}")
    hf = build_tiny_hf_model(arch, folder)
    g = torch.Generator().manual_seed(7)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = [greedy_reference(hf, p, STEPS) for p in prompts]
    return arch, folder, prompts, refs


def _run(folder, prompts, block_size, **kw):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=block_size,
        max_model_len=128,
        kv_cache_memory=1 << 22,
        check_invariants=True,
        **kw,
    )
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        result.append((c.token_ids, lps))
    return llm, result


def _check(results, refs):
    counted = sum(
        compare_to_reference(toks, lps, ref) for (toks, lps), ref in zip(results, refs, strict=True)
    )
    assert counted >= 0.75 * STEPS * len(refs), f"only {counted} steps had a clear top-2 gap"


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_batched_greedy_equals_transformers(arch_case, block_size):
    arch, folder, prompts, refs = arch_case
    llm, results = _run(folder, prompts, block_size)
    assert llm.engine.model_config.architecture.lower().startswith(arch[:5])
    _check(results, refs)


def test_alone_equals_transformers(arch_case):
    _, folder, prompts, refs = arch_case
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    for p, ref in zip(prompts, refs, strict=True):
        c = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert compare_to_reference(c.token_ids, lps, ref) >= 0.75 * STEPS


def test_torch_native_backend_equals_transformers(arch_case):
    """The portable backend (which honours the window in its own code, not by delegation)."""
    _, folder, prompts, refs = arch_case
    _, results = _run(folder, prompts, 16, attention_backend="torch_native")
    _check(results, refs)
