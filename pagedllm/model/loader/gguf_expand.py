"""GGUF tensors that become several Hugging Face tensors (or need the model class's own
renaming): llama.cpp's stacked MoE experts and fused projections.

* llama.cpp stores a MoE layer's experts stacked, ``blk.N.ffn_{gate,up,down}_exps.weight`` of
  PyTorch shape ``[E, out, in]``, and the router as ``blk.N.ffn_gate_inp.weight`` ``[E, hidden]``
  (``gguf.constants.MODEL_TENSOR.FFN_*_EXP``); pagedllm's checkpoint names are per expert, as the
  model class's ``moe_names`` say (Mixtral ``block_sparse_moe.experts.e.w1``, Qwen3-MoE
  ``mlp.experts.e.gate_proj``), so each stacked tensor is cut into E views.
* a fused ``attn_qkv`` is [all q; all k; all v] in every architecture, as llama.cpp's
  ``build_qkv`` views it (its converters de-interleave GPT-NeoX's per-head rows and transpose
  GPT-2's Conv1D weights; Phi-2 files converted from the original ``Wqkv`` hold one too): it is
  cut by the config's sizes, each part then converted as the separate tensor would be (Llama's
  q/k rows un-permuted). A tensor-parallel rank reads it whole and cuts its slices from the parts.
* a model class with ``splits_hf_weights`` (fused gate/up) splits any other renamed tensor with
  its ``split_gguf_weight`` hook (llama.cpp's layout of a fused tensor can differ from the
  Hugging Face checkpoint's).
"""

from __future__ import annotations

import torch

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.loader.gguf_loader import (
    _LAYER_RE,
    ROPE_TENSORS,
    gguf_tensor_to_hf,
    gguf_to_hf_name,
)
from pagedllm.model.weight_map import split_fused_tensor, unused_tensors_error

# llama.cpp stacked-expert tensor -> which projection of ``MoeCheckpointNames`` it holds.
_EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_ROUTER = "ffn_gate_inp"
_FUSED_QKV = "attn_qkv"


def gguf_tensor_to_hf_parts(
    gguf_name: str,
    weight: torch.Tensor,
    config: ModelArchConfig,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> dict[str, torch.Tensor]:
    """One dequantized GGUF tensor as Hugging Face-named tensors (one or more).

    Args:
        gguf_name: the llama.cpp tensor name.
        weight: float32 tensor in PyTorch axis order; stacked experts ``[E, out, in]``.
        config: the model's config (``num_experts`` checks the stacked tensors).
        num_heads / num_kv_heads: as :func:`gguf_tensor_to_hf`.

    Returns:
        name -> tensor (views of ``weight`` for split tensors).

    Raises:
        ValueError: an expert tensor in a model without experts or with a different expert
            count, or any error of :func:`gguf_tensor_to_hf` / the class's split hook.
    """
    from pagedllm.model.registry import model_class

    cls = model_class(config.architecture)
    m = _LAYER_RE.match(gguf_name)
    if m is not None and (m.group(2) in _EXPERT_PARTS or m.group(2) == _ROUTER):
        names = getattr(cls, "moe_names", None)
        if names is None or not config.num_experts:
            raise ValueError(
                f"GGUF tensor {gguf_name!r} holds MoE experts but {config.architecture} has none"
            )
        prefix = f"model.layers.{m.group(1)}.{names.block}"
        if m.group(2) == _ROUTER:
            return {f"{prefix}.gate.{m.group(3)}": weight}
        if weight.dim() != 3 or weight.shape[0] != config.num_experts:
            raise ValueError(
                f"GGUF tensor {gguf_name!r} has shape {tuple(weight.shape)}; expected "
                f"[{config.num_experts}, out, in] (expert_count experts)"
            )
        proj = getattr(names, _EXPERT_PARTS[m.group(2)])
        return {
            f"{prefix}.experts.{e}.{proj}.{m.group(3)}": weight[e]
            for e in range(config.num_experts)
        }
    if _is_fused_qkv(gguf_name):
        # Split before any per-part conversion: Llama's q/k permutation is per projection.
        fused = gguf_to_hf_name(gguf_name, cls.gguf_tensor_names)
        parts = split_fused_tensor(fused, weight, config)
        return dict(
            gguf_tensor_to_hf(gguf_name, part, config, num_heads, num_kv_heads, name)
            for name, part in parts.items()
        )
    hf_name, weight = gguf_tensor_to_hf(gguf_name, weight, config, num_heads, num_kv_heads)
    if cls.splits_hf_weights:
        return cls.split_gguf_weight(hf_name, weight, config)
    return {hf_name: weight}


def _is_fused_qkv(gguf_name: str) -> bool:
    """Whether ``gguf_name`` is a fused ``attn_qkv`` (weight or bias), which the loader splits
    itself in every architecture."""
    m = _LAYER_RE.match(gguf_name)
    return m is not None and m.group(2) == _FUSED_QKV


def needs_whole_tensor(gguf_name: str, config: ModelArchConfig) -> bool:
    """Whether a tensor-parallel rank must read ``gguf_name`` whole and split it
    (:func:`gguf_tensor_to_hf_parts`) before taking its slice: stacked experts, the router, a
    fused ``attn_qkv``, and every tensor of a model whose class splits fused tensors
    (``split_gguf_weight``)."""
    from pagedllm.model.registry import model_class

    m = _LAYER_RE.match(gguf_name)
    if m is not None and (m.group(2) in _EXPERT_PARTS or m.group(2) == _ROUTER):
        return True
    return model_class(config.architecture).splits_hf_weights or _is_fused_qkv(gguf_name)


def check_gguf_tensor_names(names: list[str], config: ModelArchConfig) -> None:
    """Refuse a GGUF file holding tensors that have no Hugging Face name in this architecture
    (before anything is dequantized). The rope tensors llama.cpp stores (``ROPE_TENSORS``, folded
    into ``config.rope_scaling``), stacked experts and routers are known; a tensor that maps to a
    name the model then does not read is caught by ``weight_map.load_named_weights``.

    A layer with both a fused ``attn_qkv`` and a separate ``attn_q`` / ``attn_k`` / ``attn_v``
    (weight or bias) is refused too: both would become the same q/k/v tensors, and one would
    silently win.

    Raises:
        ValueError: naming up to five such tensors, their count and ``config.architecture``; or
            naming the fused tensor and a separate one of the same layer.
    """
    from pagedllm.model.registry import model_class

    present = set(names)
    for name in names:
        m = _LAYER_RE.match(name)
        if m is None or m.group(2) != _FUSED_QKV:
            continue
        for part in ("attn_q", "attn_k", "attn_v"):
            separate = f"blk.{m.group(1)}.{part}.{m.group(3)}"
            if separate in present:
                raise ValueError(
                    f"GGUF tensors {name!r} and {separate!r} both hold layer {m.group(1)}'s "
                    "attention projection (fused and separate); a file holds one or the other"
                )
    extra = model_class(config.architecture).gguf_tensor_names
    unknown = []
    for name in names:
        m = _LAYER_RE.match(name)
        if name in ROPE_TENSORS or (m is not None and m.group(2) in (*_EXPERT_PARTS, _ROUTER)):
            continue
        try:
            gguf_to_hf_name(name, extra)
        except ValueError:
            unknown.append(name)
    if unknown:
        raise unused_tensors_error(sorted(unknown), config.architecture)
