"""Every registered architecture equals transformers on a tiny random model: greedy tokens over
prefill + decode, alone and batched with mixed prompt lengths, at several block sizes, with
logprobs within 1e-4 (only steps whose reference top-2 gap exceeds 1e-3 count; most must).

Windowed models (Mistral; Gemma 2 / 3's local layers) get prompts longer than their 8-token window;
Phi-3's LongRoPE switches factor sets inside the prompt lengths. Every architecture also runs under
recompute and under swap preemption (a pool too small for the batch) with the same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.model.packed_linear import cpu_gemm_ops
from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import (
    MOE_ARCHS,
    build_tiny_hf_model,
    compare_to_reference,
    greedy_reference,
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma2", "phi3", "opt", "gpt2"]
ARCHS += ["gpt_neox", "mixtral", "qwen3_moe", "gemma_v1", "granite", "granite_tied"]
ARCHS += ["phi", "stablelm", "starcoder2", "qwen2_moe", "olmo2", "olmoe"]
ARCHS += ["granitemoe", "granitemoe_shared"]
ARCHS += ["smollm3", "cohere", "cohere_qk_norm", "ernie4_5", "exaone4"]
ARCHS += ["glm", "glm4", "gpt_oss", "stablelm_qk_norm"]
# LayerNorm families: biases everywhere, a non-gated MLP (up_proj / down_proj), no RMSNorm.
LAYER_NORM_ARCHS = ("opt", "gpt2", "gpt_neox", "phi", "starcoder2")
# Projections with biases on q / k / v (the LayerNorm families have them everywhere).
QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe", "stablelm", "granite_tied", "glm", "glm4", "gpt_oss")
QKV_BIAS_ARCHS += LAYER_NORM_ARCHS
SHARED_EXPERT_ARCHS = ("qwen2_moe", "granitemoe_shared")
GGUF_UNSUPPORTED = {
    "opt": "llama.cpp has no OPT architecture: Hugging Face folders only",
    "glm": "llama.cpp converts glm-4-9b-chat as chatglm from the original checkpoint; not read",
    "gpt_oss": "llama.cpp's gpt-oss files are refused (registry.GGUF_REFUSED)",
}
# MoE experts with biases and GPT-OSS's clamped SwiGLU: gate/up packed with its bias, no
# SwiGLU epilogue.
BIASED_EXPERT_ARCHS = ("gpt_oss",)
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
    assert llm.engine.model_config.architecture.lower().startswith(arch.replace("_", "")[:5])
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


def test_cpu_fast_path_is_used(arch_case):
    """On the CPU in fp32 every architecture runs the packed linears (bias included) and the
    fused C++ RMSNorm / rotary kernels (SiLU models also the fused SwiGLU), not the fallback.
    The LayerNorm families (no fused kernel: ATen's LayerNorm) still pack every linear, and
    GPT-NeoX's partial rotary runs on the C++ kernel; MoE layers run every expert on packed
    GEMMs."""
    from pagedllm.attention.cpu import load_cpu_ops
    from pagedllm.model.layers.layer_norm import LayerNorm
    from pagedllm.model.layers.norm import RMSNorm
    from pagedllm.model.layers.rotary import RotaryEmbedding
    from pagedllm.model.packed_linear import PackedLinear, PackedSwiGLU

    if load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    arch, folder, prompts, refs = arch_case
    llm, results = _run(folder, prompts[:2], 16)
    model = llm.engine.executor.worker.model
    assert model.backend.name == "cpu"
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, PackedLinear) and isinstance(attn.o_proj, PackedLinear)
    assert (attn.qkv_proj.bias is not None) == (arch in QKV_BIAS_ARCHS)
    for layer in model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # MoE: every expert packed, SwiGLU fused (I % 8 == 0)
            assert mlp.experts.packed
            # The SwiGLU epilogue is the own GEMM's; oneDNN packs gate/up plain.
            own = cpu_gemm_ops(load_cpu_ops(), torch.float32) is not None
            biased = arch in BIASED_EXPERT_ARCHS
            gate_up_kind = PackedSwiGLU if own and not biased else PackedLinear
            assert all(type(m) is gate_up_kind for m in mlp.experts.packed_gate_up)
            assert all(isinstance(m, PackedLinear) for m in mlp.experts.packed_down)
            if biased:
                assert all(m.bias is not None for m in mlp.experts.packed_gate_up)
                assert all(m.bias is not None for m in mlp.experts.packed_down)
            # Qwen2-MoE, Granite MoE Shared: packed as a dense MLP.
            shared = getattr(mlp, "shared_expert", None)
            assert (shared is not None) == (arch in SHARED_EXPERT_ARCHS)
            if shared is not None:
                assert type(shared.gate_up_proj) is gate_up_kind
                assert isinstance(shared.down_proj, PackedLinear)
            continue
        if arch in LAYER_NORM_ARCHS:
            assert isinstance(mlp.up_proj, PackedLinear) and mlp.up_proj.bias is not None
            assert isinstance(layer.input_layernorm, LayerNorm)
        else:
            assert isinstance(mlp.gate_up_proj, (PackedLinear, PackedSwiGLU))
            norm_cls = LayerNorm if arch.startswith(("stablelm", "cohere")) else RMSNorm
            # OLMo 2 and EXAONE 4.0 have post-norms only.
            post_only = arch in ("olmo2", "exaone4")
            norm = layer.post_attention_layernorm if post_only else layer.input_layernorm
            assert isinstance(norm, norm_cls)
        assert isinstance(mlp.down_proj, PackedLinear)
    assert model.lm_head_packed is not None
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding))]
    assert all(m.cpu_ops is not None for m in norms)
    assert norms or arch in ("opt", "gpt2")  # learned positions and LayerNorm: none to fuse
    _check(results, refs[:2])


def test_gguf_file_loads_the_same_weights(arch_case, tmp_path):
    """A llama.cpp-style GGUF of the tiny model (its names, Llama's q/k permutation, Gemma's
    ``1 + w`` norms, stacked MoE experts) loads to the same config and Hugging Face state dict as
    the folder, whole and as one tensor-parallel rank's slices, and the engine on it gives
    transformers' greedy tokens."""
    from pagedllm.model.loader import load_gguf_weights, load_hf_weights, load_model
    from pagedllm.model.registry import model_class
    from tests.model.arch_utils import build_tiny_hf_model, write_gguf_like_llama_cpp
    from tests.model.gguf_files import assert_rank_slices_equal

    arch, folder, prompts, refs = arch_case
    if arch in GGUF_UNSUPPORTED:
        pytest.skip(GGUF_UNSUPPORTED[arch])
    hf = build_tiny_hf_model(arch, tmp_path / "again")  # same seed: the same weights
    path = tmp_path / f"{arch}.gguf"
    write_gguf_like_llama_cpp(hf, path, arch)
    cfg_g, sd_g = load_gguf_weights(path)
    cfg_h, sd_h = load_hf_weights(folder)
    assert sd_g.keys() == sd_h.keys()
    for name, t in sd_h.items():
        torch.testing.assert_close(sd_g[name], t, atol=1e-6, rtol=0, msg=name)
    same = ["num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window"]
    same += ["layer_types", "qk_norm", "attention_bias", "norm_weight_offset", "rope_theta"]
    same += ["partial_rotary_factor", "rope_scaling", "max_position_embeddings", "hidden_act"]
    same += ["parallel_residual", "layer_norm_eps", "position_offset", "tie_word_embeddings"]
    same += ["mlp_bias", "o_proj_bias", "hidden_size", "intermediate_size", "num_attention_heads"]
    same += ["embedding_scale", "attention_scale", "residual_multiplier", "logits_scaling"]
    same += ["nope_layers", "layer_norm_bias", "logit_scale", "shared_input_norm"]
    same += ["qk_norm_full_width", "clip_qkv", "shared_expert_intermediate_size"]
    same += ["shared_expert_gated", "router_top_k_then_softmax", "qk_layer_norm"]
    if arch in ("mixtral", "starcoder2"):  # llama.cpp's converters record no window
        same.remove("sliding_window")
    for f in ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]:
        assert getattr(cfg_g, f) == getattr(cfg_h, f), f
    assert [cfg_g.layer_is_moe(i) for i in range(cfg_h.num_hidden_layers)] == [
        cfg_h.layer_is_moe(i) for i in range(cfg_h.num_hidden_layers)
    ]
    assert_rank_slices_equal(path, cfg_h, sd_h)  # a rank's slices read from the file
    if arch != "mistral":  # Mistral GGUF files say "llama" (no window recorded)
        # Granite MoE Shared files say "granitemoe": the same model class serves both.
        assert model_class(cfg_g.architecture) is model_class(cfg_h.architecture)
        for f in same:
            assert getattr(cfg_g, f) == getattr(cfg_h, f), f
    # Not run: Mistral / Mixtral / StarCoder2 (no window recorded, tokens differ past it) and
    # Gemma (llama.cpp records no query scale; the tiny models' query_pre_attn_scalar 24 is not
    # head_dim 16).
    if arch not in ("mistral", "mixtral", "starcoder2", "gemma2", "gemma3"):
        # The engine on the GGUF's config and weights gives transformers' greedy tokens.
        hf_loaded = load_model(str(folder))
        cfg_g.eos_token_ids, cfg_g.bos_token_id = cfg_h.eos_token_ids, cfg_h.bos_token_id
        loaded = dataclasses.replace(hf_loaded, config=cfg_g, state_dict=sd_g, source=path)
        _, results = _run(folder, prompts[:2], 16, loaded=loaded)
        _check(results, refs[:2])


@pytest.mark.parametrize("arch", [*MOE_ARCHS, "phi3", "gpt2", "gpt_neox", "phi", "glm4"])
def test_quantized_gguf_loads_dequantized_weights(arch, tmp_path):
    """A Q8_0 GGUF (stacked experts and fused QKV / gate-up quantized too) loads every tensor
    within one Q8_0 step (1/127 of the largest weight; the fp16 block scale rounds too) of the
    folder's, the quantized ones not exactly (they did go through the quantizer)."""
    import gguf

    from pagedllm.model.loader import load_gguf_weights, load_hf_weights
    from tests.model.arch_utils import build_tiny_hf_model, write_gguf_like_llama_cpp

    hf = build_tiny_hf_model(arch, tmp_path / "hf")
    path = tmp_path / f"{arch}-q8_0.gguf"
    write_gguf_like_llama_cpp(hf, path, arch, qtype=gguf.GGMLQuantizationType.Q8_0)
    _, sd_g = load_gguf_weights(path)
    _, sd_h = load_hf_weights(tmp_path / "hf")
    assert sd_g.keys() == sd_h.keys()
    inexact = 0
    for name, t in sd_h.items():
        torch.testing.assert_close(sd_g[name], t, atol=float(t.abs().max()) / 127, rtol=0)
        inexact += int(not torch.equal(sd_g[name], t))
    assert inexact >= len([n for n, t in sd_h.items() if t.dim() == 2]) // 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_transformers_under_preemption(arch_case, mode):
    """16 blocks of 4 tokens for prompts + generations needing 35: running requests are
    preempted (and recomputed or swapped back in) and the tokens still equal transformers'.
    Models whose every layer is windowed free the blocks behind the window, so each decoding
    sequence holds at most 3 blocks: they run every prompt twice to run out of blocks."""
    _, folder, prompts, refs = arch_case
    from pagedllm.model.loader.hf_loader import hf_arch_config, read_hf_config

    config = hf_arch_config(read_hf_config(folder), folder)
    if all(config.layer_window(i) for i in range(config.num_hidden_layers)):
        prompts, refs = prompts * 2, refs * 2
    llm, results = _run(
        folder,
        prompts,
        4,
        num_gpu_blocks_override=16,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    sched = llm.engine.scheduler
    assert sched.preemptions_by_mode[mode] > 0
    assert sched.num_preemptions == sched.preemptions_by_mode[mode]
    if mode == "swap":
        assert sched.num_blocks_swapped_in > 0
    _check(results, refs)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_2_equals_1(arch, tmp_path):
    """Every architecture: two ranks (4 query / 2 KV heads split; the LayerNorm families 4 / 4)
    give the tp = 1 greedy tokens: QKV biases are cut
    with their heads, q/k norms and Gemma's four norms stay whole, MoE experts are cut along
    their intermediate width (router whole), each rank loads only its slices from the folder."""
    from pagedllm.entrypoints.llm import LLM
    from tests.distributed.tp_utils import greedy_tokens
    from tests.model.arch_utils import build_tiny_hf_model

    build_tiny_hf_model(arch, tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 20)]
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    ref = greedy_tokens(LLM(str(tmp_path), **kw), prompts)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.executor.world_size == 2
        assert greedy_tokens(llm, prompts) == ref
    finally:
        llm.engine.shutdown()
