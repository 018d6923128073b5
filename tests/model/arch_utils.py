"""Tiny random transformers models per architecture, and the greedy-reference comparison rule.

Every model is built in-process from its transformers config class (fp32, eager attention,
seeded), its norm weights perturbed so that they matter, and saved with ``save_pretrained`` next
to the tiny test tokenizer, so pagedllm loads it as any Hugging Face folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conftest import make_tiny_tokenizer
from tests.model.arch_gguf_extra import EXTRA_ARCHS, EXTRA_GGUF_WRITERS, extra_arch_kwargs
from tests.model.gguf_files import add_decoder_shape_keys

# Small but not degenerate: 2 layers, GQA 4/2 heads of 16, a window shorter than the prompts.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
WINDOW = 8
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "granitemoe_shared")
# The LayerNorm families (OPT, GPT-NeoX) have no GQA: 4 heads of 16, biases everywhere. Their
# weights are drawn wider (std 0.5): at 0.1 the biases dominate and greedy decoding repeats
# one token.
LAYER_NORM_TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256
)
PHI3_ORIGINAL_LEN = 36
# Tiny Llamas with scaled RoPE: YaRN (static) and dynamic NTK with a trained context of 24
# tokens, which the test prompts and generations cross.
ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "llama-yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama-dynamic": {
        "max_position_embeddings": 24,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    },
}

# Granite's four multipliers, each far enough from 1 (and from head_dim ** -0.5 = 0.25 for the
# attention scale) that ignoring any one changes the tiny model's greedy tokens, or for
# logits_scaling (argmax-invariant) its logprobs (tests/model/test_granite.py checks that on
# transformers).
GRANITE_MULTIPLIERS: dict[str, float] = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0625,
    "logits_scaling": 8.0,
}


def _arch_kwargs(arch: str) -> tuple[Any, dict[str, Any]]:
    """(transformers model class, extra config kwargs) for ``arch``."""
    import transformers as tf

    if arch == "llama":
        return tf.LlamaForCausalLM, {"config": tf.LlamaConfig}
    if arch in ROPE_VARIANTS:
        return tf.LlamaForCausalLM, {"config": tf.LlamaConfig, **ROPE_VARIANTS[arch]}
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM, {"config": tf.Qwen2Config}
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM, {"config": tf.Qwen3Config}
    if arch == "mistral":
        return tf.MistralForCausalLM, {"config": tf.MistralConfig, "sliding_window": WINDOW}
    if arch == "gemma3":
        return tf.Gemma3ForCausalLM, {
            "config": tf.Gemma3TextConfig,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,  # as every Gemma
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        }
    if arch == "opt":  # OPT's own config names; 258-row position table (offset 2)
        return tf.OPTForCausalLM, {
            "config": tf.OPTConfig,
            "tiny": {**LAYER_NORM_TINY, "ffn_dim": 128, "init_std": 0.5},
        }
    if arch == "gpt2":
        return tf.GPT2LMHeadModel, {
            "config": tf.GPT2Config,
            "tiny": dict(
                n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256, initializer_range=0.5
            ),
        }
    if arch == "gpt_neox":  # 16-wide heads, rotary_pct 0.25: 4 dimensions turn
        return tf.GPTNeoXForCausalLM, {
            "config": tf.GPTNeoXConfig,
            "tiny": {**LAYER_NORM_TINY, "intermediate_size": 128, "initializer_range": 0.5},
        }
    if arch == "phi":  # 16-wide heads, half of each turns; MLP 4 x hidden, as llama.cpp assumes
        return tf.PhiForCausalLM, {
            "config": tf.PhiConfig,
            "tiny": {**LAYER_NORM_TINY, "intermediate_size": 256, "initializer_range": 0.5},
        }
    if arch == "stablelm":  # GQA 4/2, a quarter of each head turns, q/k/v biases, parallel
        return tf.StableLmForCausalLM, {
            "config": tf.StableLmConfig,
            "tiny": {**TINY, "initializer_range": 0.5},
            "use_qkv_bias": True,
            "use_parallel_residual": True,
        }
    if arch == "starcoder2":  # GQA 4/2, biases everywhere, windowed, tied head (as released)
        return tf.Starcoder2ForCausalLM, {
            "config": tf.Starcoder2Config,
            "tiny": {**TINY, "initializer_range": 0.5},
            "sliding_window": WINDOW,
            "tie_word_embeddings": True,
        }
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM, {
            "config": tf.Gemma2Config,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,  # small: the cap bends the tiny model's scores
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    if arch == "phi3":
        g = torch.Generator().manual_seed(3)
        half = TINY["head_dim"] // 2
        return tf.Phi3ForCausalLM, {
            "config": tf.Phi3Config,
            "sliding_window": WINDOW,  # Phi-3 mini 4k sets one (every layer)
            # LongRoPE switching at 36 tokens: the 37-token test prompt runs on the long
            # factors, the others (never longer than 35 tokens while compared) on the short.
            "original_max_position_embeddings": PHI3_ORIGINAL_LEN,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
                "long_factor": (2 + 6 * torch.rand(half, generator=g)).tolist(),
            },
        }
    if arch == "mixtral":  # 8 experts, top-2, windowed like Mistral
        return tf.MixtralForCausalLM, {
            "config": tf.MixtralConfig,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
        }
    if arch == "qwen3_moe":  # layer 0 sparse (k weights not renormalised), layer 1 dense
        return tf.Qwen3MoeForCausalLM, {
            "config": tf.Qwen3MoeConfig,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        }
    if arch == "gemma_v1":
        return tf.GemmaForCausalLM, {
            "config": tf.GemmaConfig,
            "tie_word_embeddings": True,  # as every Gemma
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    if arch in ("granite", "granite_tied"):
        tied = arch == "granite_tied"  # tied head, and biases on q/k/v/o (scaled o_proj bias)
        return tf.GraniteForCausalLM, {
            "config": tf.GraniteConfig,
            **GRANITE_MULTIPLIERS,
            "tie_word_embeddings": tied,
            "attention_bias": tied,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    if arch == "qwen2_moe":  # as Qwen3-MoE, plus the gated shared expert of the MoE layers
        return tf.Qwen2MoeForCausalLM, {
            "config": tf.Qwen2MoeConfig,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        }
    if arch == "olmo2":  # Llama shapes; post-norms and full-width q/k norms are the model's
        return tf.Olmo2ForCausalLM, {"config": tf.Olmo2Config}
    if arch in EXTRA_ARCHS:  # tests/model/arch_gguf_extra.py
        return extra_arch_kwargs(arch)
    from tests.model.arch_gguf_moe import moe_arch_kwargs  # OLMoE, Granite MoE

    found = moe_arch_kwargs(arch)
    if found is None:
        raise ValueError(arch)
    return found


def build_tiny_hf_model(
    arch: str,
    folder: Path,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    **more_overrides: Any,
) -> Any:
    """A seeded tiny random ``arch`` model (fp32, eager attention) saved in ``folder`` with the
    tiny tokenizer; returns the transformers model (eval mode). ``overrides`` /
    ``more_overrides``: config fields that replace the defaults (e.g. ``sliding_window``,
    ``max_position_embeddings``)."""
    model_cls, extra = _arch_kwargs(arch)
    extra.update({**(overrides or {}), **more_overrides})
    config_cls = extra.pop("config")
    tok = make_tiny_tokenizer()
    cfg = config_cls(
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.eos_token_id,
        **{**extra.pop("tiny", TINY), **extra},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:  # ones / zeros at init: make norms matter
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith((".bias", "_bias")):  # GPT-OSS's experts: gate_up_proj_bias
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):  # GPT-OSS: initializer_range at init; about the scores' size
                p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


@dataclass
class Reference:
    """transformers' greedy continuation of one prompt.

    Attributes:
        tokens: the greedy tokens.
        gaps: top-1 minus top-2 logit at each step.
        logprobs: log-softmax of the chosen token at each step.
    """

    tokens: list[int]
    gaps: list[float]
    logprobs: list[float]


@torch.no_grad()
def greedy_reference(model: Any, prompt: list[int], n: int) -> Reference:
    """Greedy decoding by recomputing the whole sequence each step (no KV cache involved)."""
    ids = list(prompt)
    ref = Reference([], [], [])
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        tok = int(logits.argmax())
        ref.tokens.append(tok)
        ref.gaps.append(float(top[0] - top[1]))
        ref.logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ref


@torch.no_grad()
def greedy_reference_cached(model: Any, prompt: list[int], n: int) -> Reference:
    """Greedy decoding with transformers' KV cache: the prompt in one forward, then one token
    per forward. Length-dependent RoPE (dynamic NTK) then rotates each token with the
    frequencies of its sequence's length at that point, as a paged engine does; the rotary
    module's cached frequencies are reset first (they would leak from the previous prompt)."""
    rot = model.model.rotary_emb
    if hasattr(rot, "original_inv_freq"):
        rot.register_buffer("inv_freq", rot.original_inv_freq.clone(), persistent=False)
        rot.max_seq_len_cached = rot.original_max_seq_len
    ref = Reference([], [], [])
    out = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2).values
        tok = int(logits.argmax())
        ref.tokens.append(tok)
        ref.gaps.append(float(top[0] - top[1]))
        ref.logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return ref


def compare_to_reference(
    tokens: list[int], logprobs: list[float], ref: Reference, gap: float = 1e-3, tol: float = 1e-4
) -> int:
    """Check pagedllm's greedy tokens / logprobs against ``ref`` step by step.

    A step counts when the reference top-2 gap exceeds ``gap``: the tokens must then be equal
    and the logprobs within ``tol``. At a near-tie the two may pick different tokens; the rest of
    the sequence is then no longer comparable and the walk stops. Returns the number of steps
    that counted.
    """
    counted = 0
    for step, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        if ref.gaps[step] <= gap:
            if tok != ref.tokens[step]:
                return counted
            continue
        assert tok == ref.tokens[step], f"step {step}: {tok} != {ref.tokens[step]}"
        assert abs(lp - ref.logprobs[step]) < tol, f"step {step}: {lp} vs {ref.logprobs[step]}"
        counted += 1
    return counted


def write_gguf_like_llama_cpp(
    hf_model: Any, path: Path, arch: str, qtype: Any = None, fused_qkv: bool = False
) -> None:
    """Write ``hf_model`` (a tiny model from :func:`build_tiny_hf_model`) as a GGUF file the way
    llama.cpp's converter does: its tensor names, Llama's q/k rows permuted per head, Gemma's
    norms stored as ``1 + w``, stacked experts, fused tensors; no tokenizer. Float32, or with
    ``qtype`` (a ``gguf.GGMLQuantizationType``) every matrix whose rows fit its blocks quantized.
    Granite's multipliers go to llama.cpp's ``*_scale`` keys. ``fused_qkv``: each layer's q, k
    and v as one ``attn_qkv`` (``gguf_files``; older Phi-2 files)."""
    import gguf

    if fused_qkv:
        from tests.model.gguf_files import rewrite_gguf

        separate = path.with_name(f"{path.stem}-separate-qkv.gguf")
        write_gguf_like_llama_cpp(hf_model, separate, arch, qtype)
        rewrite_gguf(separate, path, fuse_qkv=True)
        return

    from pagedllm.model.loader.gguf_loader import GGUF_LAYER_NAMES
    from tests.model.arch_gguf_moe import MOE_GGUF_ARCH, add_moe_gguf_keys, llama_cpp_moe_tensors

    if arch in ("gpt2", "gpt_neox"):
        _write_layer_norm_gguf(hf_model, path, arch, qtype)
        return
    if arch in ROTARY_LAYER_NORM_GGUF:
        _write_rotary_layer_norm_gguf(hf_model, path, arch, qtype)
        return
    if arch in EXTRA_GGUF_WRITERS:
        EXTRA_GGUF_WRITERS[arch](hf_model, path, qtype)
        return
    gguf_arch = {"mistral": "llama", "gemma_v1": "gemma", "granite_tied": "granite"}.get(arch, arch)
    gguf_arch = MOE_GGUF_ARCH.get(arch, gguf_arch)
    c = hf_model.config
    names = dict(GGUF_LAYER_NAMES)
    gemma = gguf_arch in ("gemma", "gemma2", "gemma3")
    if arch in ("gemma2", "gemma3"):
        names.update(
            post_attention_norm="post_attention_layernorm",
            ffn_norm="pre_feedforward_layernorm",
            post_ffw_norm="post_feedforward_layernorm",
        )
    if arch == "phi3":  # llama.cpp keeps both fused tensors as they are
        names.update(attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj")
    if arch == "olmo2":  # no pre-norms: llama.cpp's post-attention and post-FFN norms
        names.update(
            post_attention_norm="post_attention_layernorm",
            post_ffw_norm="post_feedforward_layernorm",
        )
    if arch == "qwen2_moe":  # the shared expert and its gate: llama.cpp's "_shexp" tensors
        names.update(
            ffn_gate_shexp="mlp.shared_expert.gate_proj",
            ffn_up_shexp="mlp.shared_expert.up_proj",
            ffn_down_shexp="mlp.shared_expert.down_proj",
            ffn_gate_inp_shexp="mlp.shared_expert_gate",
        )
    to_gguf = {hf: g for g, hf in names.items()}
    w = gguf.GGUFWriter(str(path), gguf_arch)
    # phi3: llama.cpp writes the rotary width and LongRoPE factors as tensors, no key_length
    add_decoder_shape_keys(w, c, head_dim=arch != "phi3")
    if arch == "phi3":
        _add_phi3_rope(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma3":
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    else:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "gemma2":  # llama.cpp records no layer pattern for Gemma 2: they alternate
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_vocab_size(c.vocab_size)
    if gguf_arch in ("granite", "granitemoe"):  # llama.cpp's names for the four multipliers
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    add_moe_gguf_keys(w, c, arch)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    for name, t in llama_cpp_moe_tensors(hf_model.state_dict()):
        t = t.float().clone()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        g = name if name.startswith("blk.") else gguf_tensor_name(name, to_gguf)
        permuted = gguf_arch in ("llama", "granite", "granitemoe", "smollm3")  # LlamaModel converters
        if permuted and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads
            rows = t.shape[0]
            t = t.reshape(n, 2, rows // n // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
        if gemma and name.endswith("norm.weight"):
            t = t + 1.0
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp: a [hidden] vector
            t = t.reshape(-1)
        _add_tensor(w, g, t, qtype)
    close_gguf(w)


def _add_phi3_rope(w: Any, c: Any) -> None:
    """What llama.cpp's Phi-3 converter writes about attention and RoPE: the rotary width, the
    sliding window (0 = none), and for LongRoPE the original context, the attention factor
    sqrt(1 + ln(s) / ln(original)) and the long / short factors as float32 tensors."""
    import numpy as np

    params = c.rope_parameters
    partial = params.get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(int(partial * c.hidden_size) // c.num_attention_heads)
    w.add_sliding_window(c.sliding_window or 0)
    if params.get("rope_type") != "longrope":
        return
    orig = c.original_max_position_embeddings
    scale = c.max_position_embeddings / orig
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_scaling_attn_factors(
        1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
    )
    w.add_tensor("rope_factors_long.weight", np.asarray(params["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(params["short_factor"], dtype=np.float32))


def _write_layer_norm_gguf(hf_model: Any, path: Path, arch: str, qtype: Any) -> None:
    """GPT-2 / GPT-NeoX as llama.cpp's converter writes them: LayerNorm epsilon, no KV-head,
    key-length or rope-base keys; GPT-2's Conv1D weights transposed to [out, in] and its
    embedding also written as ``output``; NeoX's per-head interleaved QKV rows regrouped to
    [all q; all k; all v] (``GPTNeoXModel.modify_tensors``), rotary width and parallel residual."""
    import gguf

    from pagedllm.model.loader.gguf_loader import GGUF_LAYER_NAMES
    from pagedllm.model.registry import model_class

    c = hf_model.config
    cls = model_class(hf_model.config.architectures[0])
    neox = arch == "gpt_neox"
    w = gguf.GGUFWriter(str(path), "gptneox" if neox else "gpt2")
    hidden, heads = c.hidden_size, c.num_attention_heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(c.intermediate_size if neox else (c.n_inner or 4 * hidden))
    w.add_head_count(heads)
    w.add_layer_norm_eps(c.layer_norm_eps if neox else c.layer_norm_epsilon)
    if neox:
        partial = c.rope_parameters["partial_rotary_factor"]
        w.add_rope_dimension_count(int(partial * (hidden // heads)))
        w.add_parallel_residual(c.use_parallel_residual)
    to_gguf = {hf: g for g, hf in {**GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj"}.items()}
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.embed_positions.weight": "position_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.norm.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
    }
    for name, t in hf_model.state_dict().items():
        pname = cls.hf_weight_name(name)
        if pname is None or (not neox and pname == "lm_head.weight"):
            continue
        t = t.float().clone()
        if pname in glob:
            g = glob[pname]
        else:
            _, _, layer, rest = pname.split(".", 3)
            stem, kind = rest.rsplit(".", 1)
            g = f"blk.{layer}.{to_gguf[stem]}.{kind}"
            if not neox and pname.endswith("_proj.weight"):
                t = t.t()  # Conv1D [in, out] -> [out, in]
            if neox and ".qkv_proj." in pname:  # [q_h; k_h; v_h] per head -> [Q; K; V]
                t = t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        _add_tensor(w, g, t, qtype)
        if not neox and g == "token_embd.weight":
            _add_tensor(w, "output.weight", t, qtype)
    close_gguf(w)


# The rotary LayerNorm families llama.cpp stores with separate q / k / v: test arch -> GGUF arch.
ROTARY_LAYER_NORM_GGUF = {"phi": "phi2", "stablelm": "stablelm", "starcoder2": "starcoder2"}


def _write_rotary_layer_norm_gguf(hf_model: Any, path: Path, arch: str, qtype: Any) -> None:
    """Phi / StableLM / StarCoder2 as llama.cpp's converters write them from the transformers
    layout: separate q / k / v (not permuted: NeoX-style rotary), LayerNorm epsilon, no
    key-length key; Phi's MLP width as 4 x hidden, its heads as KV heads and its LM head's bias as
    ``output.bias``; StableLM's ``use_parallel_residual``; the rotary width (Phi, StableLM) or the
    rope base (StarCoder2, no sliding window); no ``output`` for a tied head."""
    import gguf

    from pagedllm.model.loader.gguf_loader import GGUF_LAYER_NAMES
    from pagedllm.model.registry import model_class

    c = hf_model.config
    cls = model_class(c.architectures[0])
    hidden, heads = c.hidden_size, c.num_attention_heads
    w = gguf.GGUFWriter(str(path), ROTARY_LAYER_NORM_GGUF[arch])
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(hidden)
    phi = arch == "phi"
    w.add_feed_forward_length(4 * hidden if phi else c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(heads if phi else c.num_key_value_heads)
    w.add_layer_norm_eps(c.norm_epsilon if arch == "starcoder2" else c.layer_norm_eps)
    if arch == "stablelm":
        w.add_parallel_residual(c.use_parallel_residual)
    if arch == "starcoder2":
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    else:
        partial = c.rope_parameters["partial_rotary_factor"]
        w.add_rope_dimension_count(int(partial * hidden) // heads)
    to_gguf = {hf: g for g, hf in GGUF_LAYER_NAMES.items()}
    for name, t in hf_model.state_dict().items():
        pname = cls.hf_weight_name(name)
        assert pname is not None
        if pname == "lm_head.weight" and c.tie_word_embeddings:
            continue
        _add_tensor(w, gguf_tensor_name(pname, to_gguf), t.float().clone(), qtype)
    close_gguf(w)


GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.norm.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    "lm_head.bias": "output.bias",
}


def gguf_tensor_name(name: str, layer_names: dict[str, str]) -> str:
    """llama.cpp's name of the Hugging Face tensor ``name``: a global one, else
    ``blk.N.<layer_names[stem]>.<weight or bias>``."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_names[stem]}.{kind}"


def close_gguf(w: Any) -> None:
    """Write the header, the keys and the tensors of GGUF writer ``w``, then close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tensor(w: Any, name: str, t: torch.Tensor, qtype: Any) -> None:
    """Add float32 ``t``, quantized to ``qtype`` when given and its rows fit whole blocks."""
    import gguf

    data = t.contiguous().numpy()
    if qtype is None or data.ndim < 2:
        w.add_tensor(name, data)
        return
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block:
        w.add_tensor(name, data)
        return
    w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
