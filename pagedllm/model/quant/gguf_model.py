"""Which of a model's layers run on a GGUF file's blocks (``quantization="gguf"``), and building
them: the rule that picks a projection (all its tensors of a block type the kernels compute,
their rows adding up to its output features) is decided once, here, both for the loader, which
leaves those tensors unexpanded (:func:`native_tensor_names`), and for the worker, which
replaces the layers by :class:`~pagedllm.model.quant.gguf_native.GGUFLinear` ones
(:func:`quantize_linears`). MoE experts come from llama.cpp's stacked ``ffn_*_exps`` tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedllm.model.quant.gguf_native import (
    KERNEL_BYTES_PER_32,
    SUPPORTED_TYPES,
    GGUFEmbedding,
    GGUFLinear,
    PackedBlocks,
    repack,
)

if TYPE_CHECKING:
    from pagedllm.model.config import ModelArchConfig
    from pagedllm.model.layers.moe import StackedExperts
    from pagedllm.ops import CpuOps

logger = logging.getLogger(__name__)


def _tensor_parts(tensor: Any) -> PackedBlocks:
    """A GGUF ``ReaderTensor`` of a supported block type as :class:`PackedBlocks` ([out, in])."""
    rows = int(np.prod(tensor.shape.tolist()[1:]))
    return repack(tensor.tensor_type.name, np.asarray(tensor.data), rows)


def _unpermuted_rows(name: str, rows: int, config: ModelArchConfig) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's per-head q/k permutation of GGUF projection
    ``name`` (Hugging Face-named: ``q_proj``, ``k_proj``, or a fused ``qkv_proj`` whose q and k
    parts each are permuted), or None for any other projection."""
    from pagedllm.model.loader.gguf_loader import unpermute_qk

    h, kvh = config.num_attention_heads, config.num_key_value_heads
    if ".q_proj." in name:
        return unpermute_qk(torch.arange(rows), h)
    if ".k_proj." in name:
        return unpermute_qk(torch.arange(rows), kvh)
    if ".qkv_proj." in name:
        q, kv = h * config.head_dim, kvh * config.head_dim
        k_rows = q + unpermute_qk(torch.arange(kv), kvh)
        return torch.cat([unpermute_qk(torch.arange(q), h), k_rows, torch.arange(q + kv, rows)])
    return None


@dataclass
class _Target:
    """A projection :func:`quantize_linears` rebuilds: ``parent.<child>`` from the GGUF tensors
    with Hugging Face names ``names`` (their blocks, in order)."""

    parent: nn.Module
    child: str
    module: nn.Module
    names: list[str]


def _tensor_rows(tensor: Any) -> int:
    return int(np.prod(tensor.shape.tolist()[1:]))


def _by_hf_name(reader: Any, cls: Any) -> dict[str, Any]:
    """The reader's tensors by Hugging Face name (rope factors and MoE experts left out)."""
    from pagedllm.model.loader.gguf_loader import gguf_to_hf_name

    by_hf: dict[str, Any] = {}
    for t in reader.tensors:
        try:
            by_hf[gguf_to_hf_name(t.name, cls.gguf_tensor_names)] = t
        except ValueError:
            continue  # rope factors, MoE experts: not projections handled here
    return by_hf


def _layer_targets(model: nn.Module, by_hf: dict[str, Any], cls: Any) -> list[_Target]:
    """Every projection of ``model``'s layers whose GGUF tensors are all of a supported block
    type with rows adding up to its output features (the rule of :func:`quantize_linears`);
    ``model`` may live on the meta device. Projections already a :class:`GGUFLinear` are left
    out."""
    from pagedllm.model.weight_map import checkpoint_names

    def names_for(names: list[str]) -> list[str] | None:
        tensors = [by_hf.get(n) for n in names]
        if any(t is None or t.tensor_type.name not in SUPPORTED_TYPES for t in tensors):
            return None
        return names

    layers = getattr(model, "layers", None)
    if layers is None or cls.splits_hf_weights:
        return []
    targets = []
    for prefix, module in list(layers.named_modules()):
        for child_name, child in list(module.named_children()):
            out_features = getattr(child, "out_features", None)
            if out_features is None and hasattr(child, "inter"):
                out_features = 2 * child.inter  # PackedSwiGLU: gate and up rows
            if out_features is None or isinstance(child, GGUFLinear):
                continue
            full = ".".join(x for x in ("layers", prefix, child_name) if x)
            if cls.folded_projections and full.endswith(cls.folded_projections):
                continue  # its loaded weight is not the file's (Granite's residual multiplier)
            names = names_for(checkpoint_names(f"{full}.weight"))
            if names is None and full.endswith("self_attn.qkv_proj"):
                names = names_for([f"model.{full}.weight"])  # a fused attn_qkv
            if names is None or sum(_tensor_rows(by_hf[n]) for n in names) != out_features:
                continue
            targets.append(_Target(module, child_name, child, names))
    return targets


#: llama.cpp's stacked expert tensors of one MoE layer ([E, out, in] in PyTorch order).
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass
class _ExpertTarget:
    """A MoE layer's experts (``layers.moe.StackedExperts``) and its three stacked GGUF tensors
    (gate, up, down), all of a supported block type."""

    experts: StackedExperts
    tensors: list[Any]


def _expert_targets(model: nn.Module, reader: Any) -> list[_ExpertTarget]:
    """The SwiGLU expert stacks of ``model``'s layers whose llama.cpp tensors
    ``blk.N.ffn_{gate,up,down}_exps.weight`` are all of a supported block type and of the stack's
    shape; experts with their own activation or biases (``glu``: GPT-OSS) are left out."""
    from pagedllm.model.layers.moe import StackedExperts

    by_name = {t.name: t for t in reader.tensors}
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, StackedExperts) or module.glu is not None:
            continue
        layer = name.split(".")[1]  # "layers.N.<block>.experts"
        tensors = [by_name.get(f"blk.{layer}.{t}.weight") for t in _EXPERT_TENSORS]
        if any(t is None or t.tensor_type.name not in SUPPORTED_TYPES for t in tensors):
            continue
        e, inter = module.num_experts, module.inter
        rows = [_tensor_rows(t) for t in tensors]
        if rows[0] != e * inter or rows[1] != e * inter or rows[2] % e:
            continue
        targets.append(_ExpertTarget(module, tensors))
    return targets


def _native_experts(target: _ExpertTarget, cpu_ops: CpuOps) -> int:
    """Give ``target.experts`` one :class:`GGUFLinear` per expert for gate/up (gate rows, then
    up rows: the [n, 2I] product ``StackedExperts`` activates) and one for down, cut from the
    stacked tensors' blocks, and drop its float weights. Returns the matrices built."""
    experts = target.experts
    e = experts.num_experts
    gate, up, down = (_tensor_parts(t) for t in target.tensors)

    def expert_rows(p: PackedBlocks, i: int) -> PackedBlocks:
        per = p.rows // e
        return p.take_rows(torch.arange(i * per, (i + 1) * per))

    experts.packed_gate_up = nn.ModuleList(
        GGUFLinear([expert_rows(gate, i), expert_rows(up, i)], cpu_ops) for i in range(e)
    )
    experts.packed_down = nn.ModuleList(
        GGUFLinear([expert_rows(down, i)], cpu_ops) for i in range(e)
    )
    for name in ("gate_up_weight", "down_weight"):
        experts._parameters.pop(name, None)  # the float stacks (pack() may have dropped them)
    return 2 * e


def _embedding_tensor(model: nn.Module, by_hf: dict[str, Any]) -> Any | None:
    """The GGUF ``token_embd.weight`` tensor when ``model``'s token embedding (a plain
    ``nn.Embedding``, one rank; possibly on the meta device) can run on its blocks
    (:class:`GGUFEmbedding`): a supported block type of the embedding's shape; else None."""
    embedding = getattr(model, "embed_tokens", None)
    tensor = by_hf.get("model.embed_tokens.weight")
    if (
        type(embedding) is not nn.Embedding
        or getattr(model, "group", None) is not None
        or tensor is None
        or tensor.tensor_type.name not in SUPPORTED_TYPES
    ):
        return None
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return tensor if shape == tuple(embedding.weight.shape) else None


def unloaded_parameter_ids(model: nn.Module) -> set[int]:
    """The ``id`` of every parameter ``load_weights`` left unloaded (``model.unloaded_params``
    names them, and a tied embedding may be named ``lm_head_weight`` there, so identity is what
    tells which module's weight it is)."""
    params = dict(model.named_parameters())
    return {id(params[n]) for n in getattr(model, "unloaded_params", ()) if n in params}


def _embedding_unloaded(model: nn.Module) -> bool:
    """Whether ``model``'s token embedding is a placeholder ``load_weights`` left unloaded."""
    table = getattr(getattr(model, "embed_tokens", None), "weight", None)
    return table is not None and id(table) in unloaded_parameter_ids(model)


def native_tensor_names(config: ModelArchConfig, reader: Any) -> set[str]:
    """The GGUF tensor names (``blk.N.attn_q.weight``, ...) whose blocks
    :func:`quantize_linears` computes natively for the layers of ``config``'s model, the token
    embedding's (looked up from its blocks) and an untied LM head's: the loader can leave them
    quantized instead of expanding them to float32
    (``gguf_loader.load_gguf_weights(keep_blocks=True)``).
    Decided on the model built on the meta device, by the rule :func:`quantize_linears` applies
    to the loaded one."""
    from pagedllm.attention import get_attention_backend
    from pagedllm.model.registry import model_class

    cls = model_class(config.architecture)
    backend = get_attention_backend("torch_native", "cpu")
    with torch.device("meta"):
        model = cls(config, torch.float32, backend)
    by_hf = _by_hf_name(reader, cls)
    names = {by_hf[n].name for t in _layer_targets(model, by_hf, cls) for n in t.names}
    if not cls.splits_hf_weights:
        names |= {t.name for x in _expert_targets(model, reader) for t in x.tensors}
        head = by_hf.get("lm_head.weight")  # an untied head (a tied one is the embedding too)
        if head is not None and head.tensor_type.name in SUPPORTED_TYPES:
            names.add(head.name)
        embedding = _embedding_tensor(model, by_hf)
        if embedding is not None:
            names.add(embedding.name)
    return names


def native_block_bytes(config: ModelArchConfig, path: str | Path) -> int:
    """Bytes the repacked blocks of :func:`native_tensor_names`' tensors and of the LM head
    (its GGUF layer, also built where the embedding is tied; a tied embedding kept in blocks is
    held twice, once per layout) take (``KERNEL_BYTES_PER_32``; the padding rows of the
    interleaved records left out): the weight memory a ``load_model(keep_gguf_blocks=True)``
    state dict leaves out of ``weight_bytes``. About the file's bytes for Q4_0, Q4_1 and Q8_0;
    Q4_K ~1.33x (float32 scales), Q5_0 and Q6_K ~1.5x (widened to 8 bits)."""
    from pagedllm.model.loader.gguf_loader import open_gguf

    def kernel_bytes(tensor: Any) -> int:
        return int(tensor.n_elements) // 32 * KERNEL_BYTES_PER_32[tensor.tensor_type.name]

    reader = open_gguf(path)
    names = native_tensor_names(config, reader)
    by_name = {t.name: t for t in reader.tensors}
    total = sum(kernel_bytes(by_name[n]) for n in names)
    head = by_name.get("output.weight", by_name.get("token_embd.weight"))
    head = head if head is not None and head.tensor_type.name in SUPPORTED_TYPES else None
    if head is not None and (head.name not in names or head.name == "token_embd.weight"):
        total += kernel_bytes(head)  # the LM head's GGUF layer
    return total


def quantize_linears(model: nn.Module, path: str | Path, cpu_ops: CpuOps) -> int:
    """Replace every projection of ``model`` whose GGUF tensors (``path``) are all of a
    ``SUPPORTED_TYPES`` block type by a :class:`GGUFLinear` built from those blocks, and the LM
    head (unless it already is one) by one built from ``output.weight`` (else the tied
    ``token_embd.weight``). A QKV projection stored as one fused ``attn_qkv`` ([all q; all k; all
    v], as the loader splits it) is built from that tensor's blocks, its q/k rows reordered where
    llama.cpp permuted them, as the separate tensors' are. Projections with float tensors, models
    whose class splits fused tensors itself and the class's ``folded_projections`` stay as they
    are. A token embedding the loader left unloaded (``model.unloaded_params``) becomes a
    :class:`GGUFEmbedding` on ``token_embd.weight``'s blocks (one repack, shared with a tied
    head). A MoE layer's SwiGLU experts get one layer per expert for gate/up and one for down,
    cut from llama.cpp's stacked ``ffn_*_exps`` blocks (not GPT-OSS's, whose experts have their
    own activation and biases). Runs before or after ``pack_linears`` (the same projections
    either way). Returns the number of matrices replaced (the embedding not counted).

    Raises:
        ValueError: the file is not a valid GGUF file, or a tensor's rows do not fit the model.
    """
    from pagedllm.model.loader.gguf_loader import open_gguf
    from pagedllm.model.registry import model_class

    config: ModelArchConfig = getattr(model, "config")  # noqa: B009 (a DecoderForCausalLM)
    cls = model_class(config.architecture)
    reader = open_gguf(path)
    by_hf = _by_hf_name(reader, cls)
    if cls.splits_hf_weights:
        logger.warning("quantization=gguf: %s splits fused tensors; kept float32", cls.__name__)
        return 0

    def parts_for(names: list[str]) -> list[PackedBlocks]:
        out = []
        for name in names:
            blocks = _tensor_parts(by_hf[name])
            order = _unpermuted_rows(name, blocks.rows, config) if cls.gguf_permute_qk else None
            if order is not None:
                blocks = blocks.take_rows(order)
            out.append(blocks)
        return out

    count = 0
    for t in _layer_targets(model, by_hf, cls):
        linear = GGUFLinear(parts_for(t.names), cpu_ops, getattr(t.module, "bias", None))
        setattr(t.parent, t.child, linear)
        count += 1
    for x in _expert_targets(model, reader):
        down = x.experts.packed_down
        if down is None or not any(isinstance(m, GGUFLinear) for m in down):
            count += _native_experts(x, cpu_ops)
    embedding: PackedBlocks | None = None
    if _embedding_unloaded(model) and _embedding_tensor(model, by_hf) is not None:
        embedding = parts_for(["model.embed_tokens.weight"])[0]
        model.embed_tokens = GGUFEmbedding(embedding)
    head = "lm_head.weight" if "lm_head.weight" in by_hf else "model.embed_tokens.weight"
    head_tensor = by_hf.get(head)
    if (
        not isinstance(getattr(model, "lm_head_packed", None), GGUFLinear)
        and head_tensor is not None
        and head_tensor.tensor_type.name in SUPPORTED_TYPES
        and getattr(model, "group", None) is None
    ):
        # A tied head reuses the embedding's repack.
        parts = parts_for([head]) if embedding is None or head == "lm_head.weight" else [embedding]
        model.lm_head_packed = GGUFLinear(parts, cpu_ops)  # type: ignore[assignment]
        count += 1
    return count
