"""GPT-OSS (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", section 2;
``GptOssForCausalLM``, ``model_type`` gpt_oss): the 20B (24 layers, 32 experts) and 120B (36
layers, 128 experts) models.

Llama's pre-norm layers (RMSNorm, grouped-query attention with rotate-half RoPE) with:

* **attention sinks**: every attention layer has a learned logit per query head,
  ``self_attn.sinks`` [heads], that joins the softmax as one more key of value zero: it only
  adds ``e^sink`` to the denominator (every attention backend implements it:
  ``attention`` package docstring; the C++ kernels fold it into each query's merged softmax
  state last, the same way in decode and prefill). Under tensor parallelism the sinks are cut
  with the query heads;
* biases on q, k, v and o (``attention_bias``), ``head_dim`` given separately (64, with 2880
  hidden and 64 heads);
* alternating sliding-window / full attention by ``layer_types`` (transformers' default: even
  layers windowed, odd layers full), a window of 128 tokens in the released models;
* YaRN RoPE (``rope_scaling``: factor 32 over 4096 trained tokens, ``truncate`` false: the
  ramp's ends are not rounded to whole dimensions; ``layers.rope_scaling``);
* a sparse MoE block in every layer (``layers.moe``): the router (``mlp.router``, with a bias)
  keeps each token's k largest logits and takes the softmax over those k; each expert is
  ``down(glu(gate_up(x) + b) ) + b_down`` with biases and the clamped SwiGLU
  ``(clamp(up, -L, L) + 1) * g * sigmoid(1.702 g)``, ``g = clamp(gate, max=L)``, L =
  ``swiglu_limit`` = 7 (``layers.activation.clamped_swiglu``).

Checkpoints store a layer's experts fused: ``mlp.experts.gate_up_proj`` [E, hidden, 2I] with the
gate and up columns **interleaved** (gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...),
``gate_up_proj_bias`` [E, 2I] (interleaved alike), ``down_proj`` [E, I, hidden] and
``down_proj_bias`` [E, hidden] (transformers' ``GptOssExperts``: ``x @ W + b``, W [in, out]).
They are split at load time into per-expert ``mlp.experts.e.{gate,up,down}_proj.{weight,bias}``
in PyTorch's [out, in] order (:meth:`GptOssForCausalLM.split_hf_weight`), so stacking, CPU
packing and tensor-parallel slicing are those of the other MoE models: each expert's
intermediate width is cut over the ranks with its gate / up biases, the down bias is added on
rank 0 only (once in the sum of the ranks). The released checkpoints store ``gate_up_proj`` and
``down_proj`` in MXFP4 (``_blocks`` / ``_scales`` pairs, ``model.quant.mxfp4``), dequantized
to the engine's dtype as they are read. llama.cpp's ``gpt-oss`` GGUF files are refused
(``registry.GGUF_REFUSED``).

CPU fast path: packed linears (the experts' with their biases on the packed GEMM; no SwiGLU
epilogue, the clamped activation runs on ATen), C++ norms and rotary, the C++ attention kernels
with sinks; not the whole-layer C++ op (MoE layers).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layers.moe import QWEN_MOE_NAMES, MoeCheckpointNames
from pagedllm.model.mixtral import MixtralForCausalLM
from pagedllm.model.quant.mxfp4 import dequantize_mxfp4_experts

# transformers' GptOssConfig default RoPE scaling, for a config.json that names none.
DEFAULT_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# A layer's fused expert tensors (after ``hf_weight_name``), which ``split_hf_weight`` cuts.
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")
# The tensors stored in MXFP4 in the released checkpoints.
_MXFP4_TENSORS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def gpt_oss_layer_types(num_layers: int) -> list[str]:
    """transformers' default GPT-OSS layer types: layer i is "sliding_attention" when i is
    even, "full_attention" when odd."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


class GptOssForCausalLM(MixtralForCausalLM):
    """GPT-OSS: Llama's layers with attention sinks and q/k/v/o biases, alternating local /
    global attention and a biased MoE block (top-k then softmax, clamped SwiGLU) in every
    layer."""

    moe_names: ClassVar[MoeCheckpointNames] = QWEN_MOE_NAMES  # mlp.experts.e.*_proj, mlp.gate
    splits_hf_weights: ClassVar[bool] = True
    default_rope_theta: ClassVar[float] = 150000.0

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Sinks, biases (``attention_bias``, default true), the experts
        (``num_local_experts``; ``num_experts_per_tok``, default 4), top-k-then-softmax
        routing, ``swiglu_limit`` / ``swiglu_alpha``, the window with ``layer_types`` (or
        transformers' alternating default), and transformers' YaRN scaling when the config.json
        names none (its RoPE base: ``default_rope_theta``).

        Raises:
            ValueError: naming ``num_local_experts`` when the config has no experts, or
                ``quantization_config`` when its ``quant_method`` is not "mxfp4".
        """
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if experts < 1:
            raise ValueError("GPT-OSS config.json needs num_local_experts >= 1")
        quant = cfg.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "mxfp4":
            raise ValueError(
                f"GPT-OSS with quantization_config quant_method={quant.get('quant_method')!r} "
                "is not supported (mxfp4, or none)"
            )
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types") or gpt_oss_layer_types(int(cfg["num_hidden_layers"]))
        bias = bool(cfg.get("attention_bias", True))
        fields: dict[str, Any] = {
            "attention_bias": bias,
            "o_proj_bias": bias,
            "attention_sinks": True,
            "hidden_act": "silu",  # unused: the experts run the clamped SwiGLU
            "num_experts": experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 4),
            "norm_topk_prob": True,  # the softmax over the k logits sums to 1
            "router_top_k_then_softmax": True,
            "moe_bias": True,
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "sliding_window": int(window) if window else None,
            "layer_types": list(types) if window else None,
        }
        params = cfg.get("rope_parameters") or {}
        if cfg.get("rope_scaling") is None and not params.get("rope_type"):
            fields["rope_scaling"] = dict(DEFAULT_YARN)
        return fields

    @classmethod
    def hf_weight_name(cls, name: str) -> str | None:
        """The router ``mlp.router.{weight,bias}`` -> ``mlp.gate.{weight,bias}`` (the MoE
        layer's name for it); the rest unchanged."""
        for kind in ("weight", "bias"):
            old = f".mlp.router.{kind}"
            if name.endswith(old):
                return name[: -len(old)] + f".mlp.gate.{kind}"
        return name

    @classmethod
    def dequantize_mxfp4(
        cls, name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``mlp.experts.gate_up_proj`` / ``down_proj`` from their MXFP4 pairs, in the
        unquantized layout ([E, in, out]; ``quant.mxfp4.dequantize_mxfp4_experts``).

        Raises:
            ValueError: naming the tensor when it is not one of those two, or as the
                dequantizer (shapes, dtypes).
        """
        if _MXFP4_TENSORS.match(name) is None:
            raise ValueError(
                f"checkpoint tensor {name!r} is stored as MXFP4; GPT-OSS reads MXFP4 only for "
                "mlp.experts.gate_up_proj and mlp.experts.down_proj"
            )
        try:
            return dequantize_mxfp4_experts(blocks, scales, dtype)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """A layer's fused expert tensors as per-expert [out, in] tensors (views):
        ``gate_up_proj`` [E, hidden, 2I] -> ``experts.e.gate_proj.weight`` (columns 0, 2, ...
        transposed) and ``up_proj.weight`` (columns 1, 3, ...), ``gate_up_proj_bias`` [E, 2I]
        -> their biases alike, ``down_proj`` [E, I, hidden] -> ``experts.e.down_proj.weight``
        (transposed), ``down_proj_bias`` [E, hidden] -> its bias; other tensors unchanged.

        Raises:
            ValueError: naming the tensor when its shape is not the one above for the config.
        """
        m = _EXPERTS.match(name)
        if m is None:
            return {name: tensor}
        prefix, proj, bias = m.groups()
        e_count, d = config.num_experts, config.hidden_size
        inter = config.moe_intermediate_size or config.intermediate_size
        if proj == "gate_up_proj":
            want = (e_count, 2 * inter) if bias else (e_count, d, 2 * inter)
        else:
            want = (e_count, d) if bias else (e_count, inter, d)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}; expected {list(want)} "
                "(num_local_experts, hidden_size, intermediate_size)"
            )
        kind = "bias" if bias else "weight"
        out: dict[str, torch.Tensor] = {}
        for e in range(e_count):
            t = tensor[e]
            if proj == "down_proj":
                out[f"{prefix}{e}.down_proj.{kind}"] = t if bias else t.t()
                continue
            gate, up = t[..., 0::2], t[..., 1::2]  # interleaved on the last dim
            out[f"{prefix}{e}.gate_proj.{kind}"] = gate if bias else gate.t()
            out[f"{prefix}{e}.up_proj.{kind}"] = up if bias else up.t()
        return out
