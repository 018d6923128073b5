"""SmolLM3 (Hugging Face 2025, "SmolLM3: smol, multilingual, long-context reasoner";
``SmolLM3ForCausalLM``, ``model_type`` smollm3, GGUF ``smollm3``): the 3B decoder.

A Llama (grouped-query attention, SwiGLU, RMSNorm, tied embeddings in the release) whose layers
do not all use RoPE: following the NoPE recipe the blog post describes, some layers attend with
no positional encoding at all. ``config.json``'s ``no_rope_layers`` holds one flag per layer,
1 = the layer rotates its queries and keys, 0 = a NoPE layer; transformers derives it, when
absent, from ``no_rope_layer_interval`` (default 4): layer i is NoPE when (i + 1) is a multiple
of the interval, so every fourth layer of the 36 skips RoPE. pagedllm keeps the indices of the
NoPE layers (``ModelArchConfig.nope_layers``); their attention passes q and k through unrotated,
and the fused C++ layer stack takes a rotary width per layer (0 on those layers), so the model
keeps the CPU fast path.

A sliding window applies, as in transformers, only with ``use_sliding_window`` and a
``sliding_window``, on the layers ``layer_types`` marks "sliding_attention" (transformers'
default marks the NoPE layers).

llama.cpp's converter writes SmolLM3 as Llama (q/k rows permuted) and stores no NoPE key: its
loader fixes the interval at 4, and so does this file for a GGUF file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM

# The NoPE interval llama.cpp assumes for every smollm3 GGUF file (it writes no key for it).
GGUF_NO_ROPE_LAYER_INTERVAL = 4


def nope_layers_by_interval(num_layers: int, interval: int) -> list[int]:
    """The NoPE layers of ``num_layers`` when every ``interval``-th one skips RoPE: the layers
    i with (i + 1) % interval == 0 (transformers' and llama.cpp's rule)."""
    return [i for i in range(num_layers) if (i + 1) % interval == 0]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama layers, some of them without RoPE (``nope_layers``)."""

    default_rope_theta: ClassVar[float] = 2e6

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads the NoPE layers (``no_rope_layers``, else ``no_rope_layer_interval``),
        ``attention_bias``, ``rms_norm_eps`` (default 1e-6) and, for a ``config.json`` with
        ``use_sliding_window`` and a ``sliding_window`` but no ``layer_types``, transformers'
        default layer types (the NoPE layers windowed).

        Raises:
            ValueError: naming ``no_rope_layers`` when it has fewer entries than layers or a
                value other than 0 / 1, ``no_rope_layer_interval`` when it is not positive,
                ``mlp_bias`` when true (the released model has none; the fused gate/up kernels
                take none).
        """
        if cfg.get("mlp_bias"):
            raise ValueError("SmolLM3 with mlp_bias is not supported")
        layers = int(cfg["num_hidden_layers"])
        flags = cfg.get("no_rope_layers")
        if flags is None:
            interval = int(cfg.get("no_rope_layer_interval", 4))
            if interval <= 0:
                raise ValueError(f"no_rope_layer_interval must be positive, got {interval}")
            nope = nope_layers_by_interval(layers, interval)
        else:
            if len(flags) < layers or any(int(f) not in (0, 1) for f in flags[:layers]):
                raise ValueError(
                    f"no_rope_layers must hold a 0 or 1 for each of the {layers} layers, "
                    f"got {flags!r}"
                )
            nope = [i for i in range(layers) if int(flags[i]) == 0]
        bias = bool(cfg.get("attention_bias", False))
        fields: dict[str, Any] = {
            "attention_bias": bias,
            "o_proj_bias": bias,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "nope_layers": nope or None,
        }
        windowed = cfg.get("use_sliding_window", False) and cfg.get("sliding_window")
        if windowed and cfg.get("layer_types") is None:
            fields["layer_types"] = [
                "sliding_attention" if i in nope else "full_attention" for i in range(layers)
            ]
        return fields

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """The NoPE layers by llama.cpp's fixed interval (4); the rest are the common keys."""
        layers = int(meta("block_count"))
        nope = nope_layers_by_interval(layers, GGUF_NO_ROPE_LAYER_INTERVAL)
        return {"nope_layers": nope or None}
