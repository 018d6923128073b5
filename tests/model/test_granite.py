"""Granite's four multipliers and Gemma 1's config reading.

The token-exact comparison with transformers is in ``test_architectures.py`` (``granite``,
``granite_tied``, ``gemma_v1``); here: each multiplier of the tiny test model moves transformers'
greedy output, so pagedllm ignoring any one of them fails that comparison; the folded residual
multiplier survives ``quantization="gguf"``; and what is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.model.arch_utils import (
    GRANITE_MULTIPLIERS,
    build_tiny_hf_model,
    greedy_reference,
    write_gguf_like_llama_cpp,
)

STEPS = 8


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17)]


@pytest.mark.parametrize("multiplier", sorted(GRANITE_MULTIPLIERS))
def test_each_multiplier_changes_the_reference(multiplier: str, tmp_path: Any) -> None:
    """The tiny Granite with ``multiplier`` reset to 1 (what a model ignoring it computes) has
    other greedy tokens, or logprobs off by far more than the 1e-4 the architecture test allows
    (``logits_scaling`` keeps the argmax: it shows in the logprobs only)."""
    model = build_tiny_hf_model("granite", tmp_path / "set")
    ignored = build_tiny_hf_model("granite", tmp_path / "ignored", **{multiplier: 1.0})
    for prompt in _prompts(model.config.vocab_size):
        ref = greedy_reference(model, prompt, STEPS)
        other = greedy_reference(ignored, prompt, STEPS)
        if ref.tokens != other.tokens:
            continue
        diff = max(abs(a - b) for a, b in zip(ref.logprobs, other.logprobs, strict=True))
        assert diff > 1e-2, (multiplier, diff)


def test_hf_config_refusals_and_defaults() -> None:
    """Granite MLP biases and bidirectional Gemma are refused by field name; Gemma's "gelu"
    is the tanh approximation (as transformers maps it); Granite without an
    ``attention_multiplier`` scales scores by 1 (transformers' default), a GGUF without
    ``attention.scale`` by head_dim ** -0.5 (llama.cpp's)."""
    from pagedllm.model.gemma import GemmaForCausalLM
    from pagedllm.model.granite import GraniteForCausalLM

    with pytest.raises(ValueError, match="mlp_bias"):
        GraniteForCausalLM.hf_config_fields({"mlp_bias": True})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM.hf_config_fields({"hidden_size": 64, "use_bidirectional_attention": True})
    gemma = GemmaForCausalLM.hf_config_fields({"hidden_size": 64, "hidden_act": "gelu"})
    assert gemma["hidden_act"] == "gelu_pytorch_tanh" and gemma["embedding_scale"] == 8.0
    granite = GraniteForCausalLM.hf_config_fields({})
    assert granite["attention_scale"] == 1.0
    assert granite["embedding_scale"] is granite["logits_scaling"] is None
    assert GraniteForCausalLM.gguf_config_fields(lambda key: None)["attention_scale"] is None


def test_folded_multiplier_survives_gguf_quantization(tmp_path: Any) -> None:
    """``quantization="gguf"`` on a Q8_0 Granite: o_proj / down_proj (their weights carry the
    residual multiplier) stay float, q/k/v and gate/up run on the file's blocks, the layers run
    as the fused C++ op either way, and the teacher-forced argmaxes agree with the dequantized
    float32 run's (0.26 when o_proj / down_proj were rebuilt from the file)."""
    import gguf

    from pagedllm import LLM, SamplingParams
    from pagedllm.attention.cpu import load_cpu_ops
    from pagedllm.model.loader import load_gguf_weights, load_model
    from pagedllm.model.quant.gguf_native import GGUFLinear

    if load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    hf = build_tiny_hf_model("granite", tmp_path / "hf")
    path = tmp_path / "granite-q8_0.gguf"
    write_gguf_like_llama_cpp(hf, path, "granite", qtype=gguf.GGMLQuantizationType.Q8_0)
    config, state = load_gguf_weights(path)
    base = load_model(str(tmp_path / "hf"))
    config.eos_token_ids, config.bos_token_id = base.config.eos_token_ids, base.config.bos_token_id
    loaded = dataclasses.replace(base, config=config, state_dict=state, source=path)
    prompt = torch.randint(
        3, hf.config.vocab_size, (48,), generator=torch.Generator().manual_seed(2)
    )
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    argmaxes = []
    for quant in (None, "gguf"):
        llm = LLM(loaded=loaded, dtype="float32", quantization=quant, max_model_len=128)
        model = llm.engine.executor.worker.model
        assert model.fused_stack is not None  # folded weights: still the one-op C++ layers
        if quant == "gguf":
            layer = model.layers[0]
            assert isinstance(layer.self_attn.qkv_proj, GGUFLinear)
            assert isinstance(layer.mlp.gate_up_proj, GGUFLinear)
            assert not isinstance(layer.self_attn.o_proj, GGUFLinear)
            assert not isinstance(layer.mlp.down_proj, GGUFLinear)
        out = llm.generate([prompt.tolist()], params, use_tqdm=False)[0]
        argmaxes.append(
            [next(t for t, lp in e.items() if lp.rank == 1) for e in out.prompt_logprobs[1:]]
        )
    ref, got = argmaxes
    agree = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    assert agree >= 0.9, agree
