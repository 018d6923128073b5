"""Length-dependent RoPE (Phi-3 LongRoPE, dynamic NTK) gives the same greedy tokens whatever the
schedule: chunked prefill, a prefix-cache hit from a shorter prompt, recompute preemption and
speculative decoding all equal the plain run, which equals transformers' cached generation.
Each used to rotate some tokens by the length of their step instead (a helper found it)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.input_processor import prefix_cache_extra
from pagedllm.model.layers.rope_scaling import frequency_length, prompt_frequency_key
from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model, greedy_reference_cached

# (arch, switch length: LongRoPE's original context / dynamic NTK's trained context)
CASES = {"phi3": 36, "llama-dynamic": 24}
NEW = 16


def test_frequency_length_is_the_prompt_length_then_the_position():
    positions = torch.tensor([0, 1, 2, 3, 4, 5])
    prompts = torch.tensor([4, 4, 4, 4, 4, 4])
    assert frequency_length(positions, prompts).tolist() == [4, 4, 4, 4, 5, 6]


def test_prompt_frequency_key_separates_only_what_rotates_differently():
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 36}
    assert [prompt_frequency_key(longrope, 128, n) for n in (1, 36, 37, 90)] == [
        None, None, "longrope-long", "longrope-long"]
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert [prompt_frequency_key(dynamic, 24, n) for n in (24, 25, 26)] == [
        None, "dynamic-25", "dynamic-26"]
    assert prompt_frequency_key({"rope_type": "yarn", "factor": 4.0}, 24, 99) is None
    assert prompt_frequency_key(None, 24, 99) is None
    # A salt cannot pose as another salt plus a key.
    assert prefix_cache_extra(None, None) is None
    assert prefix_cache_extra("a", "k") != prefix_cache_extra("a\x00\x00\x00\x00k", None)
    assert prefix_cache_extra("a", None) != prefix_cache_extra(None, "a")


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    hf = build_tiny_hf_model(arch, folder, sliding_window=None)  # windows would hide preemption
    return arch, str(folder), hf


def _llm(folder: str, **kw):
    from pagedllm.entrypoints.llm import LLM

    if "num_gpu_blocks_override" not in kw:
        kw["kv_cache_memory"] = 1 << 22
    return LLM(folder, dtype="float32", block_size=8, max_model_len=128, **kw)


def _tokens(llm, prompts, max_tokens=NEW):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _prompt(hf, n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()


def test_chunked_prefill_and_prefix_hits_keep_the_prompt_frequencies(model):
    arch, folder, hf = model
    switch = CASES[arch]
    prompt = _prompt(hf, switch + 4)  # past the switch: the prompt rotates on the long side
    base = _tokens(_llm(folder), [prompt])[0]
    assert base == greedy_reference_cached(hf, prompt, NEW).tokens
    chunked = _llm(folder, enable_chunked_prefill=True, max_num_batched_tokens=8)
    assert _tokens(chunked, [prompt])[0] == base
    warm = _llm(folder)
    _tokens(warm, [prompt[: switch - 2]])  # its blocks were rotated on the short side
    assert _tokens(warm, [prompt])[0] == base
    assert warm.engine.block_manager.num_used_blocks == 0
    # The same long prompt again hits its own cached blocks.
    hits = warm.engine.block_manager.prefix_cache.hits
    assert _tokens(warm, [prompt])[0] == base
    assert warm.engine.block_manager.prefix_cache.hits > hits


def test_recompute_preemption_and_speculation_keep_the_output_frequencies(model):
    arch, folder, hf = model
    switch = CASES[arch]
    prompts = [_prompt(hf, switch - 6, seed=s) for s in range(4)]  # outputs cross the switch
    base = _tokens(_llm(folder, enable_prefix_caching=False), prompts, 24)
    tight = _llm(folder, enable_prefix_caching=False, num_gpu_blocks_override=12,
                 preemption_mode="recompute")
    assert _tokens(tight, prompts, 24) == base
    assert tight.engine.stats.num_preemptions > 0
    for method in ("ngram", "draft_model"):
        spec = {"method": method, "num_speculative_tokens": 3}
        if method == "draft_model":
            spec["model"] = folder  # the target as its own draft: every draft is verified
        assert _tokens(_llm(folder, speculative_config=spec), prompts[:1], 24) == base[:1]
