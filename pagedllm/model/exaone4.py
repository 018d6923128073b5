"""EXAONE 4.0 (LG AI Research 2025, "EXAONE 4.0: Unified Large Language Models Integrating
Non-reasoning and Reasoning Modes", arXiv:2507.11407, section 2.1; ``Exaone4ForCausalLM``,
``model_type`` exaone4, GGUF ``exaone4``): the 1.2B and 32B decoders.

What differs from Llama:

* post-norm layers, as OLMo 2 (``olmo2.Olmo2DecoderLayer``): no norm before attention or the
  MLP, each sublayer's output normalised inside its residual branch,
  ``h = x + post_attention_layernorm(attn(x))``, then ``h + post_feedforward_layernorm(mlp(h))``;
* an RMSNorm over each query and key head (width head_dim) before RoPE, as Qwen3;
* hybrid attention (the 32B model): ``layer_types`` marks each layer "sliding_attention" (a
  ``sliding_window`` of 4096 tokens) or "full_attention", three local layers to one global. When
  the config has a ``sliding_window``, only the sliding layers rotate q and k; the full-attention
  layers use no positional encoding at all (transformers' rule: RoPE when ``sliding_window`` is
  None or the layer is a sliding one), kept as ``ModelArchConfig.nope_layers``. Without a window
  (the 1.2B model) every layer is full attention with RoPE.

A config.json without ``layer_types`` gets transformers' default from an integer
``sliding_window_pattern`` p (layer i is full attention when (i + 1) % p == 0); any other
pattern without ``layer_types`` is refused with an error naming ``sliding_window_pattern``.
CPU fast path: packed linears, C++ norms and rotary; the whole-layer C++ op only runs Llama's
pre-norm layer, so these layers run their Python forward. llama.cpp's ``exaone4`` converter
keeps the q/k rows (no permutation), writes the window and one sliding flag per layer
(``attention.sliding_window_pattern``) and Llama 3 RoPE scaling as a ``rope_freqs`` tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from gguf.constants import MODEL_TENSOR

from pagedllm.model.decoder import DecoderForCausalLM
from pagedllm.model.loader.gguf_loader import gguf_layer_tensor
from pagedllm.model.olmo2 import Olmo2DecoderLayer

# transformers' Exaone4Config default: every fourth layer is full attention.
DEFAULT_SLIDING_WINDOW_PATTERN = 4


def exaone4_layer_types(num_layers: int, pattern: int) -> list[str]:
    """transformers' default EXAONE 4.0 layer types for an integer ``sliding_window_pattern``:
    layer i is "full_attention" when (i + 1) % pattern == 0, else "sliding_attention"."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _hybrid_fields(window: int | None, layer_types: list[str] | None) -> dict[str, Any]:
    """The window, layer types and NoPE layers (the full-attention ones, only with a window)."""
    if not window or layer_types is None:
        return {"sliding_window": int(window) if window else None, "layer_types": None}
    nope = [i for i, t in enumerate(layer_types) if t != "sliding_attention"]
    return {
        "sliding_window": int(window),
        "layer_types": list(layer_types),
        "nope_layers": nope or None,
    }


class Exaone4ForCausalLM(DecoderForCausalLM):
    """EXAONE 4.0: post-norm layers with per-head q/k norms; with a sliding window, local layers
    with RoPE and global layers without."""

    gguf_tensor_names: ClassVar[dict[str, str]] = {
        gguf_layer_tensor(MODEL_TENSOR.ATTN_POST_NORM): "post_attention_layernorm",
        gguf_layer_tensor(MODEL_TENSOR.FFN_POST_NORM): "post_feedforward_layernorm",
    }

    layer_class = Olmo2DecoderLayer  # post-norm layer; PagedSelfAttention reads qk_norm

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Per-head q/k norms; the window, ``layer_types`` (or transformers' default from
        ``sliding_window_pattern``) and the NoPE full-attention layers.

        Raises:
            ValueError: naming ``sliding_window_pattern`` when the config has a window, no
                ``layer_types`` and a pattern that is not a positive integer; naming
                ``hidden_act`` when it is not SiLU.
        """
        act = str(cfg.get("hidden_act") or "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"EXAONE 4.0 with hidden_act={act!r} is not supported (silu only)")
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if window and types is None:
            pattern = cfg.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
                raise ValueError(
                    f"EXAONE 4.0 with sliding_window_pattern={pattern!r} and no layer_types is "
                    "not supported (a positive integer, or layer_types)"
                )
            types = exaone4_layer_types(int(cfg["num_hidden_layers"]), pattern)
        return {"qk_norm": True, **_hybrid_fields(window, types)}

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's ``exaone4`` keys: ``attention.sliding_window`` and
        ``attention.sliding_window_pattern`` (one flag per layer, True = sliding; an integer
        period is read as transformers' default)."""
        window = meta("attention.sliding_window")
        pattern = meta("attention.sliding_window_pattern")
        types: list[str] | None = None
        if window:
            if isinstance(pattern, list):
                types = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                period = int(pattern or DEFAULT_SLIDING_WINDOW_PATTERN)
                types = exaone4_layer_types(int(meta("block_count")), period)
        return {"qk_norm": True, **_hybrid_fields(window, types)}
