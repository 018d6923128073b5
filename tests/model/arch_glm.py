"""Tiny-model settings and the llama.cpp-style GGUF writer of GLM (glm-4-9b-chat-hf) and
GLM-4-0414 (``glm4``): partial (half-head) interleaved RoPE, q/k/v biases, fused ``gate_up_proj``,
and for GLM-4 the post-attention / post-MLP norms.

``arch_gguf_extra`` dispatches here for the names in ``GLM_ARCHS`` / ``GLM_GGUF_WRITERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

GLM_ARCHS = ("glm", "glm4")
# Half of each 16-wide head turns (8 dimensions, 4 interleaved pairs), GLM's default.
GLM_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


def glm_arch_kwargs(arch: str) -> tuple[Any, dict[str, Any]]:
    """(transformers model class, config kwargs) for ``arch`` in ``GLM_ARCHS``, in the form of
    ``arch_utils._arch_kwargs`` (q/k/v biases on, as transformers' default)."""
    import transformers as tf

    if arch == "glm":
        return tf.GlmForCausalLM, {"config": tf.GlmConfig, "rope_parameters": dict(GLM_ROPE)}
    if arch == "glm4":
        return tf.Glm4ForCausalLM, {"config": tf.Glm4Config, "rope_parameters": dict(GLM_ROPE)}
    raise ValueError(arch)


# Hugging Face suffix -> llama.cpp's glm4 per-layer name.
GLM4_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_mlp_layernorm": "post_ffw_norm",
}


def write_glm4_gguf(hf_model: Any, path: Path, qtype: Any = None) -> None:
    """A tiny GLM-4-0414 model as llama.cpp's converter writes it (architecture ``glm4``): the
    common keys, the rotary width as ``rope.dimension_count``, q/k rows as in the checkpoint
    (llama.cpp's glm4 graph rotates interleaved pairs itself), ``gate_up_proj`` kept fused as
    ``ffn_up``, the two post-norms as ``post_attention_norm`` / ``post_ffw_norm``."""
    import gguf

    from tests.model.arch_utils import _add_tensor, close_gguf, gguf_tensor_name
    from tests.model.gguf_files import add_decoder_shape_keys

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM4])
    add_decoder_shape_keys(w, c)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in hf_model.state_dict().items():
        _add_tensor(w, gguf_tensor_name(name, GLM4_GGUF_NAMES), t.float().clone(), qtype)
    close_gguf(w)


GLM_GGUF_WRITERS: dict[str, Callable[[Any, Path, Any], None]] = {"glm4": write_glm4_gguf}
