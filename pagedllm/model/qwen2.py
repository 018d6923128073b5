"""Qwen2 / Qwen2.5 (Qwen team 2024): a Llama whose q, k and v projections have a bias (o_proj has
none). llama.cpp does not permute Qwen's q/k rows.

Sliding window (``qwen_sliding_window``, shared with Qwen3): off unless ``use_sliding_window``
is true (transformers' default is false, and released checkpoints set ``sliding_window`` either
way); when on and ``config.json`` lists no ``layer_types``, the layers from
``max_window_layers`` on are windowed, the ones before it attend to everything, as transformers
derives ``layer_types``.

GGUF (``gguf_sliding_window``, shared with Qwen3 and Qwen2-MoE): GGUF has no
``use_sliding_window`` / ``max_window_layers`` key, so a window is on only when the file has
``attention.sliding_window`` with one flag per layer in ``attention.sliding_window_pattern`` (as
``layer_types``); files converted from the released models carry no window.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM

# transformers' Qwen2Config / Qwen3Config defaults for keys a config.json may lack.
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


def qwen_sliding_window(cfg: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a Qwen2 / Qwen3 ``config.json`` dict, as
    transformers reads them: no window unless ``use_sliding_window`` (default false); then
    ``sliding_window`` (default 4096; null: none) on the listed ``layer_types``, or on layers
    ``i >= max_window_layers`` (default 28), the ones below attending to everything."""
    use = cfg.get("use_sliding_window", False)
    window = cfg.get("sliding_window", _DEFAULT_SLIDING_WINDOW) if use else None
    if not window:
        return {"sliding_window": None, "layer_types": None}
    layer_types = cfg.get("layer_types")
    if not layer_types:
        first = int(cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        n = int(cfg["num_hidden_layers"])
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"sliding_window": int(window), "layer_types": list(layer_types)}


def gguf_sliding_window(meta: Any, model: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a Qwen2 / Qwen3 / Qwen2-MoE GGUF file (``model``
    names it in the error), read as :func:`qwen_sliding_window` reads a ``config.json``.

    The released models use no window (their files carry none), and GGUF has no
    ``use_sliding_window`` / ``max_window_layers`` keys. A nonzero
    ``attention.sliding_window`` is read as transformers' ``use_sliding_window`` on, and
    ``attention.sliding_window_pattern`` (one flag per layer, true = sliding, as llama.cpp's
    converters write ``layer_types``) says which layers, as ``layer_types`` does in config.json.
    Absent or 0: no window.

    Raises:
        ValueError: naming ``sliding_window_pattern`` when a window comes without one flag per
            layer (which layers are windowed would depend on ``max_window_layers``, which the
            file cannot say).
    """
    window = meta("attention.sliding_window")
    if not window:
        return {"sliding_window": None, "layer_types": None}
    pattern = meta("attention.sliding_window_pattern")
    layers = int(meta("block_count"))
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(
            f"{model} GGUF with attention.sliding_window={window} needs "
            f"attention.sliding_window_pattern (one flag per layer, {layers}); got {pattern!r}"
        )
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    return {"sliding_window": int(window), "layer_types": types}


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama layers with ``attention_bias`` on q/k/v (stacked into the fused QKV bias)."""

    gguf_permute_qk: ClassVar[bool] = False

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """QKV bias always, no o_proj bias; the sliding window per ``qwen_sliding_window``."""
        return {"attention_bias": True, "o_proj_bias": False, **qwen_sliding_window(cfg)}

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """QKV bias always, no o_proj bias; the sliding window per :func:`gguf_sliding_window`.

        Raises:
            ValueError: as :func:`gguf_sliding_window`.
        """
        return {"attention_bias": True, "o_proj_bias": False, **gguf_sliding_window(meta, "Qwen2")}
