"""OLMoE's own rules (``pagedllm/model/olmoe.py``): ``clip_qkv`` clamps q / k / v as transformers
does (after the full-width q/k norms), the MoE block (top-k of the softmax, not renormalised)
equals transformers', and the config fields are read or refused by name. Its greedy tokens
against transformers, GGUF and tensor parallelism are checked by ``test_architectures.py``."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.olmoe import OlmoeForCausalLM
from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model, compare_to_reference, greedy_reference

STEPS = 12
CLIP = 0.75  # below most |q|, |k| after the norms and many |v|: the clamp changes the tokens


def _engine(folder):
    from pagedllm.entrypoints.llm import LLM

    return LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)


def test_clip_qkv_equals_transformers(tmp_path):
    """With ``clip_qkv`` the greedy tokens and logprobs equal transformers' (which clamps), and
    they are not the unclamped model's: ignoring the field would fail."""
    hf = build_tiny_hf_model("olmoe", tmp_path, clip_qkv=CLIP)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (6, 19)]
    refs = [greedy_reference(hf, p, STEPS) for p in prompts]
    hf.config.clip_qkv = None
    unclamped = [greedy_reference(hf, p, STEPS) for p in prompts]
    assert any(r.tokens != u.tokens for r, u in zip(refs, unclamped, strict=True))
    llm = _engine(tmp_path)
    assert llm.engine.model_config.clip_qkv == CLIP
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    counted = 0
    for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), refs, strict=True):
        c = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, ref)
    assert counted >= 0.75 * STEPS * len(prompts)


def test_moe_block_equals_transformers(tmp_path):
    """The loaded (CPU-packed) block gives transformers' OlmoeSparseMoeBlock output: softmax over
    the 8 experts, top 2, weights not renormalised (``norm_topk_prob`` false)."""
    hf = build_tiny_hf_model("olmoe", tmp_path)
    model = _engine(tmp_path).engine.executor.worker.model
    block = model.layers[0].mlp
    assert not block.gate.normalize and not block.gate.softmax_after_top_k
    x = torch.randn(13, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(x[None])[0]
    torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)


def test_config_fields_read_and_refused():
    """The expert fields under both names, the defaults of the released models, the q/k norm
    switches; a clip_qkv that is not positive is refused, naming it."""
    base = {"num_hidden_layers": 2, "intermediate_size": 64}
    f = OlmoeForCausalLM.hf_config_fields({**base, "num_experts": 64})
    assert f["num_experts"] == 64 and f["num_experts_per_tok"] == 8
    assert f["norm_topk_prob"] is False and f["clip_qkv"] is None
    assert f["qk_norm"] and f["qk_norm_full_width"] and not f["attention_bias"]
    f = OlmoeForCausalLM.hf_config_fields(
        {**base, "num_local_experts": 4, "norm_topk_prob": True, "attention_bias": True}
    )
    assert f["num_experts"] == 4 and f["norm_topk_prob"] is True
    assert f["attention_bias"] and f["o_proj_bias"]
    with pytest.raises(ValueError, match="clip_qkv"):
        OlmoeForCausalLM.hf_config_fields({**base, "num_experts": 4, "clip_qkv": 0})
