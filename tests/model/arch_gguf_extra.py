"""Tiny-model settings and llama.cpp-style GGUF writers of the architectures added after
``tests/model/arch_utils.py`` reached its size limit: SmolLM3 (NoPE layers) and Cohere
Command-R (interleaved RoPE, bias-free LayerNorm, parallel residual, logit scale; with and
without the per-head q/k LayerNorms of ``use_qk_norm``).

StableLM 2 12B's layout (``stablelm_qk_norm``: per-head q/k LayerNorms, parallel residual, no
q/k/v biases) too.

``arch_utils._arch_kwargs`` and ``write_gguf_like_llama_cpp`` dispatch here for the names in
``EXTRA_ARCHS`` / ``EXTRA_GGUF_WRITERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.model.arch_glm import GLM_ARCHS, GLM_GGUF_WRITERS, glm_arch_kwargs

# 4 layers so that transformers' default NoPE interval (4) leaves layer 3 without RoPE, as
# llama.cpp's fixed interval does for the GGUF file; RoPE base 10000 (not SmolLM3's 2e6) so that
# rotating the NoPE layer would change the tiny model's tokens.
SMOLLM3_LAYERS = 4
# Cohere's logit multiplier: far from 1 so that ignoring it changes the logprobs (the greedy
# tokens are argmax-invariant to it).
COHERE_LOGIT_SCALE = 0.25
# EXAONE 4.0: one sliding layer (RoPE) and one full-attention layer (NoPE), window 8 (shorter than
# the test prompts).
EXAONE4_LAYER_TYPES = ["sliding_attention", "full_attention"]
EXTRA_ARCHS = ("smollm3", "cohere", "cohere_qk_norm", "ernie4_5", "exaone4", "stablelm_qk_norm")
EXTRA_ARCHS += GLM_ARCHS


def extra_arch_kwargs(arch: str) -> tuple[Any, dict[str, Any]]:
    """(transformers model class, config kwargs) for ``arch`` in ``EXTRA_ARCHS``, in the form
    of ``arch_utils._arch_kwargs``."""
    import transformers as tf

    from tests.model.arch_utils import TINY, WINDOW

    if arch in GLM_ARCHS:  # tests/model/arch_glm.py
        return glm_arch_kwargs(arch)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "smollm3":  # tied head, as released
        return tf.SmolLM3ForCausalLM, {
            "config": tf.SmolLM3Config,
            "tiny": {**TINY, "num_hidden_layers": SMOLLM3_LAYERS},
            "tie_word_embeddings": True,
            "rope_parameters": rope,
        }
    if arch in ("cohere", "cohere_qk_norm"):  # tied head, as released
        # cohere: no q/k norms (Command-R v01); cohere_qk_norm: per-head q/k LayerNorms
        # (Command R+ 08-2024), their weights perturbed per head by build_tiny_hf_model.
        return tf.CohereForCausalLM, {
            "config": tf.CohereConfig,
            "logit_scale": COHERE_LOGIT_SCALE,
            "tie_word_embeddings": True,
            "use_qk_norm": arch == "cohere_qk_norm",
            "rope_parameters": rope,
        }
    if arch == "ernie4_5":  # tied head and no biases, as released; RoPE base 10000 (not 5e5)
        return tf.Ernie4_5ForCausalLM, {
            "config": tf.Ernie4_5Config,
            "tie_word_embeddings": True,
            "use_bias": False,
            "rope_parameters": rope,
        }
    if arch == "stablelm_qk_norm":  # StableLM 2 12B: per-head q/k LayerNorms, parallel
        return tf.StableLmForCausalLM, {
            "config": tf.StableLmConfig,
            "tiny": {**TINY, "initializer_range": 0.5},
            "use_qkv_bias": False,
            "use_parallel_residual": True,
            "qk_layernorm": True,
        }
    if arch == "exaone4":
        return tf.Exaone4ForCausalLM, {
            "config": tf.Exaone4Config,
            "sliding_window": WINDOW,
            "layer_types": EXAONE4_LAYER_TYPES,
            "rope_parameters": rope,
        }
    raise ValueError(arch)


def write_plain_gguf(
    hf_model: Any,
    path: Path,
    qtype: Any,
    arch: Any,
    names: dict[str, str] | None = None,
    keys: Callable[[Any, Any], None] | None = None,
) -> None:
    """A tiny RMSNorm model as a llama.cpp converter that neither permutes q/k rows nor fuses
    tensors writes it: ``arch`` (a ``gguf.MODEL_ARCH``), the common keys, ``keys(writer,
    config)`` for the architecture's own, ``names`` (llama.cpp name -> Hugging Face suffix) on
    top of ``GGUF_LAYER_NAMES``, no ``output`` tensor when the head is tied."""
    import gguf

    from pagedllm.model.loader.gguf_loader import GGUF_LAYER_NAMES
    from tests.model.arch_utils import _add_tensor, close_gguf, gguf_tensor_name
    from tests.model.gguf_files import add_decoder_shape_keys

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_decoder_shape_keys(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if keys is not None:
        keys(w, c)
    to_gguf = {hf: g for g, hf in {**GGUF_LAYER_NAMES, **(names or {})}.items()}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        _add_tensor(w, gguf_tensor_name(name, to_gguf), t.float().clone(), qtype)
    close_gguf(w)


def write_ernie4_5_gguf(hf_model: Any, path: Path, qtype: Any = None) -> None:
    """ERNIE 4.5 as llama.cpp's ``ernie4_5`` converter writes it: Llama's names, q/k rows as in
    the checkpoint (its graph rotates interleaved pairs)."""
    import gguf

    write_plain_gguf(hf_model, path, qtype, gguf.MODEL_ARCH.ERNIE4_5)


def write_exaone4_gguf(hf_model: Any, path: Path, qtype: Any = None) -> None:
    """EXAONE 4.0 as llama.cpp's ``exaone4`` converter writes it: post-attention / post-FFN norm
    names, the window and one sliding flag per layer, q/k rows as in the checkpoint."""
    import gguf

    def keys(w: Any, c: Any) -> None:
        if c.sliding_window is not None:
            w.add_sliding_window(c.sliding_window)
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])

    names = {
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    write_plain_gguf(hf_model, path, qtype, gguf.MODEL_ARCH.EXAONE4, names, keys)


def write_cohere_gguf(hf_model: Any, path: Path, qtype: Any = None) -> None:
    """A tiny Cohere model as llama.cpp's Command-R converter writes it (architecture
    ``command-r``): the common keys with the LayerNorm epsilon, ``logit_scale``, q/k rows as in
    the checkpoint (not permuted: llama.cpp's command-r graph rotates interleaved pairs, as
    transformers), no ``output`` tensor (tied), no norm biases, no ``ffn_norm``; with
    ``use_qk_norm`` the q/k norms as ``attn_q_norm`` / ``attn_k_norm`` [heads, head_dim]."""
    import gguf

    from pagedllm.model.loader.gguf_loader import GGUF_LAYER_NAMES
    from tests.model.arch_utils import _add_tensor, close_gguf, gguf_tensor_name
    from tests.model.gguf_files import add_decoder_shape_keys

    c = hf_model.config
    arch_name = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.COMMAND_R]
    w = gguf.GGUFWriter(str(path), arch_name)
    add_decoder_shape_keys(w, c)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_logit_scale(c.logit_scale)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    to_gguf = {hf: g for g, hf in GGUF_LAYER_NAMES.items()}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        _add_tensor(w, gguf_tensor_name(name, to_gguf), t.float().clone(), qtype)
    close_gguf(w)


def write_stablelm_qk_norm_gguf(hf_model: Any, path: Path, qtype: Any = None) -> None:
    """StableLM with ``qk_layernorm`` as llama.cpp's converter writes it: the stablelm file of
    ``arch_utils``, with each layer's per-head norms stacked in head order into ``attn_q_norm`` /
    ``attn_k_norm`` [heads, head_dim]."""
    import re
    from types import SimpleNamespace

    import torch

    from tests.model.arch_utils import _write_rotary_layer_norm_gguf

    state, heads = {}, {}
    for name, t in hf_model.state_dict().items():
        m = re.fullmatch(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight", name)
        if m is None:
            state[name] = t
        else:
            heads.setdefault(f"{m[1]}{m[2]}_norm.weight", []).append((int(m[3]), t))
    for name, rows in heads.items():
        state[name] = torch.stack([t for _, t in sorted(rows, key=lambda r: r[0])])
    stacked = SimpleNamespace(config=hf_model.config, state_dict=lambda: state)
    _write_rotary_layer_norm_gguf(stacked, path, "stablelm", qtype)


EXTRA_GGUF_WRITERS: dict[str, Callable[[Any, Path, Any], None]] = {
    "cohere": write_cohere_gguf,
    "cohere_qk_norm": write_cohere_gguf,
    "ernie4_5": write_ernie4_5_gguf,
    "exaone4": write_exaone4_gguf,
    "stablelm_qk_norm": write_stablelm_qk_norm_gguf,
    **GLM_GGUF_WRITERS,
}
