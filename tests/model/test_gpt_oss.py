"""GPT-OSS's own rules (``pagedllm/model/gpt_oss.py``): an MXFP4 folder loading (whole and as one
tensor-parallel rank) the same weights as its unquantized twin, the MoE block (biased router,
interleaved biased experts, clamped SwiGLU) equal to transformers', a speculative verify pass
bitwise equal to plain decoding, and the config defaults and refusals. Greedy tokens against
transformers and tensor parallelism: ``test_architectures.py``; the attention sinks on every
backend: ``tests/attention/test_sinks.py``; the dequantizer itself: ``test_mxfp4.py``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model.gpt_oss import GptOssForCausalLM
from tests.model.arch_utils import build_tiny_hf_model
from tests.model.test_mxfp4 import encode_mxfp4


def test_mxfp4_folder_loads_the_unquantized_weights(tmp_path):
    """A tiny GPT-OSS whose experts hold MXFP4-representable values, saved plain and as a
    checkpoint with ``*_blocks`` / ``*_scales`` expert tensors and an mxfp4
    ``quantization_config``: both load to the same state dict, whole and as one tensor-parallel
    rank's slices, and the engine on the MXFP4 folder gives transformers' greedy tokens."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import load_hf_weights
    from pagedllm.model.loader.sharded import load_weight_shard
    from pagedllm.model.sharding import TensorParallelShard, shard_state_dict
    from pagedllm.sampling_params import SamplingParams
    from tests.model.arch_utils import greedy_reference

    hf = build_tiny_hf_model("gpt_oss", tmp_path / "plain")
    quantized = {}
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, proj)  # [E, K, rows]
                blocks, scales, values = encode_mxfp4(p.transpose(1, 2).contiguous())
                p.copy_(values.transpose(1, 2))
                quantized[id(p)] = (blocks, scales)
    hf.save_pretrained(tmp_path / "plain")
    (tmp_path / "mxfp4").mkdir()
    for f in (tmp_path / "plain").iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / "mxfp4" / f.name).write_bytes(f.read_bytes())
    state = load_file(str(tmp_path / "plain" / "model.safetensors"))
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = quantized[id(getattr(layer.mlp.experts, proj))]
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    cfg_file = tmp_path / "mxfp4" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    cfg_file.write_text(json.dumps(cfg))

    cfg_p, plain = load_hf_weights(tmp_path / "plain")
    _, mx = load_hf_weights(tmp_path / "mxfp4")
    assert mx.keys() == plain.keys()
    for name, t in plain.items():
        assert torch.equal(mx[name], t), name
    shard = TensorParallelShard.for_rank(cfg_p, 1, 2)
    mine = load_weight_shard(tmp_path / "mxfp4", "hf", cfg_p, shard)
    ref = shard_state_dict(plain, shard, cfg_p.head_dim)
    assert mine.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(mine[name], t), name

    prompt = torch.randint(3, cfg_p.vocab_size, (20,), generator=torch.Generator().manual_seed(4))
    want = greedy_reference(hf, prompt.tolist(), 8).tokens
    llm = LLM(str(tmp_path / "mxfp4"), dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate([prompt.tolist()], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_moe_block_equals_transformers(tmp_path):
    """The loaded (CPU-packed) MoE block gives transformers' GptOssMLP output: the router with
    its bias, top-k then softmax, the interleaved gate / up with biases, the clamped SwiGLU and
    the down bias; with the clamp lifted the output differs (the tiny model's limit of 1
    matters)."""
    from pagedllm.entrypoints.llm import LLM

    hf = build_tiny_hf_model("gpt_oss", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)
    block = llm.engine.executor.worker.model.layers[0].mlp
    assert block.experts.packed and block.gate.packed is not None
    assert block.gate.packed.bias is not None
    x = torch.randn(1, 29, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ref_mlp = hf.model.layers[0].mlp
    with torch.no_grad():
        want, _ = ref_mlp(x)
        got = block(x[0])
        ref_mlp.experts.limit = math.inf
        unclamped, _ = ref_mlp(x)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    assert float((unclamped - want).abs().max()) > 1e-2


# The config.json of openai/gpt-oss-20b (as published), minus the tokenizer ids.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {"quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_config_of_the_released_model_and_defaults():
    """gpt-oss-20b's config.json: sinks, biases, window 128 on the even layers, YaRN with
    truncate false, 32 experts top-4 with biases and the clamped SwiGLU. Without layer_types
    and RoPE keys, transformers' defaults (alternating; theta 150000, YaRN factor 32)."""
    from pagedllm.model.loader.hf_loader import hf_arch_config
    from pagedllm.model.sharding import TensorParallelShard

    c = hf_arch_config(GPT_OSS_20B)
    assert c.architecture == "GptOssForCausalLM" and c.attention_sinks and c.moe_bias
    assert (c.attention_bias, c.o_proj_bias, c.head_dim) == (True, True, 64)
    assert [c.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert c.rope_theta == 150000 and c.rope_scaling["truncate"] is False
    assert (c.num_experts, c.num_experts_per_tok, c.router_top_k_then_softmax) == (32, 4, True)
    assert (c.swiglu_limit, c.swiglu_alpha) == (7.0, 1.702)
    shard = TensorParallelShard.for_rank(c, 1, 4)
    assert shard.weight_slice("model.layers.3.self_attn.sinks", 64) == (0, 16, 32)
    bare = {k: v for k, v in GPT_OSS_20B.items() if k not in ("layer_types", "rope_scaling")}
    bare.pop("rope_theta")
    d = hf_arch_config(bare)
    assert d.layer_types == c.layer_types and d.rope_theta == 150000.0
    assert d.rope_scaling == {**GPT_OSS_20B["rope_scaling"], "rope_type": "yarn"}


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_local_experts": 0}, "num_local_experts"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ],
)
def test_config_refusals(change, match):
    from pagedllm.model.loader.hf_loader import hf_arch_config

    with pytest.raises(ValueError, match=match):
        hf_arch_config({**GPT_OSS_20B, **change})


def test_split_refuses_a_wrong_expert_shape():
    from pagedllm.model.loader.hf_loader import hf_arch_config

    c = hf_arch_config(GPT_OSS_20B)
    with pytest.raises(ValueError, match="gate_up_proj"):
        GptOssForCausalLM.split_hf_weight(
            "model.layers.0.mlp.experts.gate_up_proj", torch.zeros(32, 2880, 64), c
        )


def test_gguf_file_is_refused_with_the_reason():
    from pagedllm.model.registry import entry_for_gguf

    with pytest.raises(ValueError, match="Hugging Face folder"):
        entry_for_gguf("gpt-oss", "x.gguf")


def test_speculative_verify_equals_plain_decoding_bitwise(tmp_path):
    """Speculation whose drafts are all accepted (an oracle proposer: the plain run's own
    tokens) gives the plain run's tokens and logprobs bit for bit: the verify pass attends with
    sinks through the prefill kernel, the plain run through the decode kernel."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams
    from tests.spec_decode.test_spec_engine import SPEC, OracleProposer

    build_tiny_hf_model("gpt_oss", tmp_path)
    prompts = [[10, 11, 12, 13, 14] * 4, list(range(20, 50))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    plain = LLM(str(tmp_path), **kw).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(tmp_path), speculative_config=SPEC, **kw)
    ref = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}
    spec.engine.engine_core.speculator.proposer = OracleProposer(ref)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.stats.spec_accepted_tokens > 0
    for a, b in zip(plain, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in pa.items()} == {t: p.logprob for t, p in pb.items()}
