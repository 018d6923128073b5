"""Weight loading by name mapping: checkpoint tensors (Hugging Face names) -> model parameters.

pagedllm's model modules are named like Hugging Face's, without the ``model.`` prefix, except
that some parameters stack several checkpoint tensors along dim 0 (vLLM's "stacked params"):
``qkv_proj`` = ``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` = ``gate_proj``, ``up_proj``
(weights and biases alike); the untied LM head is the parameter ``lm_head_weight`` (its bias, when
it has one, ``lm_head_bias``). Under tensor
parallelism the state dict already holds this rank's slices (``model.sharding``), so a stacked
parameter is the concatenation of the rank's slices. GGUF files are first renamed to Hugging Face
names (``gguf_loader``), so this one mapping serves both formats.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.model.config import ModelArchConfig

# Stacked parameter name -> its checkpoint parts, in row order.
STACKED_PARAMS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Checkpoints that store a stacked parameter fused (Phi-3's ``qkv_proj`` and ``gate_up_proj``)
# are split into the parts above at load time (the model's ``split_hf_weight`` hook calls
# ``split_fused_tensor``), so that tensor-parallel slicing and loading all see one naming.
# Parameters whose rows are the vocabulary (a short last tensor-parallel shard is zero-padded).
VOCAB_PARAMS = ("embed_tokens.weight", "lm_head_weight", "lm_head_bias")


def checkpoint_names(param_name: str, prefix: str = "model.") -> list[str]:
    """The Hugging Face tensors that make up parameter ``param_name``, in stacking order.

    ``layers.0.self_attn.qkv_proj.bias`` -> ``[model.layers.0.self_attn.q_proj.bias, ...k_proj...,
    ...v_proj...]``; ``lm_head_weight`` -> ``[lm_head.weight]``, ``lm_head_bias`` ->
    ``[lm_head.bias]``; anything else gets ``prefix``.
    """
    if param_name in ("lm_head_weight", "lm_head_bias"):
        return [f"lm_head.{param_name.removeprefix('lm_head_')}"]
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part in STACKED_PARAMS:
            return [
                prefix + ".".join([*parts[:i], sub, *parts[i + 1 :]])
                for sub in STACKED_PARAMS[part]
            ]
    return [prefix + param_name]


def fused_part_sizes(name: str, config: ModelArchConfig) -> list[int] | None:
    """Rows of each part of fused checkpoint tensor ``name`` (``...self_attn.qkv_proj.weight``:
    [H*D, KVH*D, KVH*D]; ``...mlp.gate_up_proj.weight``: [I, I]), or None when it is not fused."""
    stem = name.rpartition(".")[0]
    part = stem.rpartition(".")[2]
    if part == "qkv_proj":
        d = config.head_dim
        kv = config.num_key_value_heads * d
        return [config.num_attention_heads * d, kv, kv]
    if part == "gate_up_proj":
        return [config.intermediate_size] * 2
    return None


def split_fused_tensor(
    name: str, tensor: torch.Tensor, config: ModelArchConfig
) -> dict[str, torch.Tensor]:
    """``{name: tensor}``, or the parts of a fused checkpoint tensor under their own names
    (``model.layers.0.self_attn.qkv_proj.weight`` -> ``...q_proj.weight``, ``...k_proj.weight``,
    ``...v_proj.weight``; views along dim 0).

    Raises:
        ValueError: the tensor's rows do not add up to the config's sizes (names both).
    """
    sizes = fused_part_sizes(name, config)
    if sizes is None:
        return {name: tensor}
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"weight {name!r}: expected {sum(sizes)} rows, got {tensor.shape[0]}")
    stem, _, kind = name.rpartition(".")
    module, _, fused = stem.rpartition(".")
    parts = tensor.split(sizes, dim=0)
    return {
        f"{module}.{sub}.{kind}": t for sub, t in zip(STACKED_PARAMS[fused], parts, strict=True)
    }


def load_named_weights(
    model: nn.Module, state_dict: dict[str, torch.Tensor], pad_vocab: bool = False
) -> list[str]:
    """Copy ``state_dict`` (Hugging Face names) into every parameter of ``model``, after
    :func:`checkpoint_plan` has matched them (nothing is copied when it fails). A parameter
    whose tensors are on the meta device (projections a GGUF file keeps in blocks,
    ``load_gguf_weights(keep_blocks=True)``) is left as it is and its name returned.

    Args:
        model: the pagedllm model (parameters named as described in the module docstring).
        state_dict: name -> tensor (any float dtype; cast to the parameter's).
        pad_vocab: zero-pad a vocabulary parameter whose tensor has fewer rows (the short last
            tensor-parallel shard).

    Returns:
        the names of the parameters left unloaded (meta tensors), in plan order.

    Raises:
        ValueError: as :func:`checkpoint_plan` (a missing tensor, or tensors no parameter
            reads), or naming the parameter and both shapes when a tensor does not fit.
    """
    unloaded: list[str] = []
    with torch.no_grad():
        for pname, param, owner, names in checkpoint_plan(model, state_dict):
            parts = [state_dict[n] for n in names]
            if any(p.is_meta for p in parts):
                unloaded.append(pname)
                continue
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            loader = getattr(owner, "load_weight", None)
            if callable(loader):
                value = loader(value)
            target: torch.Tensor = param
            if (
                pad_vocab
                and pname in VOCAB_PARAMS
                and value.shape[0] < param.shape[0]
                and value.shape[1:] == param.shape[1:]
            ):
                param.zero_()
                target = param[: value.shape[0]]
            if target.shape != value.shape:
                shown = names[0] if len(names) == 1 else pname
                raise ValueError(
                    f"weight {shown!r}: expected {tuple(target.shape)}, got {tuple(value.shape)}"
                )
            target.copy_(value.to(param.dtype))
    return unloaded


#: (parameter name, parameter, its owning module, the checkpoint tensors it reads in order).
PlanEntry = tuple[str, nn.Parameter, nn.Module | None, list[str]]


def checkpoint_plan(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[PlanEntry]:
    """Which tensors of ``state_dict`` each parameter of ``model`` reads; reads no tensor data
    (except to compare a tied head stored twice), so ``model`` may live on the meta device.

    A module with a ``checkpoint_names(param_name) -> list[str]`` method names its parameters'
    checkpoint tensors itself (``layers.moe``: per-expert tensors concatenated into stacked
    expert weights); a module with ``load_weight(value) -> value`` (``layers.norm.RMSNorm``:
    Gemma's ``1 + w``) transforms its tensor when loaded. Tied parameters come once: a head tied
    to the embedding reads ``model.embed_tokens.weight``, as does an untied head when the state
    dict has no ``lm_head.weight``.

    Every tensor of ``state_dict`` must feed a parameter (:func:`unused_tensors` lists the
    exceptions), so that a checkpoint variant the model does not implement (MLP biases on a model
    without them) fails instead of running without those weights.

    Raises:
        ValueError: naming the first missing checkpoint tensor; or (``unused_tensors_error``)
            up to five of the tensors no parameter reads, their count and the architecture.
    """
    modules = dict(model.named_modules())
    embedding = getattr(modules.get("embed_tokens"), "weight", None)
    plan: list[PlanEntry] = []
    for pname, param in model.named_parameters():  # tied parameters come once
        owner = modules.get(pname.rpartition(".")[0])
        names_hook = getattr(owner, "checkpoint_names", None)
        names = names_hook(pname) if callable(names_hook) else checkpoint_names(pname)
        if names == ["lm_head.weight"] and (names[0] not in state_dict or param is embedding):
            names = ["model.embed_tokens.weight"]  # tied: the head is the embedding
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise ValueError(f"weight {missing[0]!r} is missing from the checkpoint")
        plan.append((pname, param, owner, names))
    unused = unused_tensors(model, state_dict, {n for *_, names in plan for n in names})
    if unused:
        raise unused_tensors_error(unused, _architecture(model))
    return plan


# ``model.layers.N.``: a decoder layer's tensor (another pipeline stage's when N is not ours).
_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def unused_tensors(
    model: nn.Module, state_dict: dict[str, torch.Tensor], used: set[str]
) -> list[str]:
    """The names of ``state_dict`` that no parameter of ``model`` reads (``used`` holds those
    that do), sorted. Not counted as unused:

    * a decoder layer's tensor when ``model.stage_layers`` (pipeline parallelism) excludes that
      layer: another stage loads it;
    * ``lm_head.weight`` when the head is tied and the tensor equals the embedding (a checkpoint
      that stores the tied head twice);
    * names matching one of ``model.unused_checkpoint_tensors`` (regular expressions, searched):
      the model class's explicit allow-list of tensors it legitimately ignores.

    Tensor-parallel slices need no exception: every rank has every parameter, each reading its
    slice of every tensor (``model.sharding``).
    """
    stage = getattr(model, "stage_layers", None)
    allowed = [re.compile(p) for p in getattr(model, "unused_checkpoint_tensors", ())]
    out = []
    for name in state_dict.keys() - used:
        m = _LAYER_PREFIX.match(name)
        if m is not None and stage is not None and int(m.group(1)) not in stage:
            continue
        if name == "lm_head.weight" and _is_tied_copy(
            state_dict, "model.embed_tokens.weight" in used
        ):
            continue
        if any(p.search(name) for p in allowed):
            continue
        out.append(name)
    return sorted(out)


def _is_tied_copy(state_dict: dict[str, torch.Tensor], embedding_used: bool) -> bool:
    """``lm_head.weight`` repeats the embedding (the model ties its head to it)."""
    head, embed = state_dict["lm_head.weight"], state_dict.get("model.embed_tokens.weight")
    return (
        embedding_used
        and embed is not None
        and head.shape == embed.shape
        and bool(torch.equal(head, embed))
    )


def unused_tensors_error(names: list[str], architecture: str) -> ValueError:
    """The error for checkpoint tensors ``names`` (non-empty) that ``architecture`` would
    ignore: the first five names, the count and the architecture."""
    shown = ", ".join(repr(n) for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ValueError(
        f"{len(names)} checkpoint tensor(s) ({shown}{more}) were not used by {architecture}; "
        "the checkpoint may be a variant pagedllm does not support"
    )


def _architecture(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "architecture", None) or type(model).__name__)
