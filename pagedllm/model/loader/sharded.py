"""Load only one tensor-parallel rank's slices of a model file (paper section 4.6).

GGUF: the quantized data is sliced in the memory map before dequantizing: whole rows for
column-parallel weights and the vocabulary, whole quantization blocks along a row for row-parallel
ones (when the cut is not block-aligned the tensor's rows are dequantized whole, then cut).
Safetensors: ``safe_open(...).get_slice`` reads just the slice (MXFP4 pairs, GPT-OSS's experts,
are dequantized whole, then cut). The result equals
``model.sharding.shard_state_dict`` of the full load, tensor for tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.loader.gguf_expand import (
    check_gguf_tensor_names,
    gguf_tensor_to_hf_parts,
    needs_whole_tensor,
)
from pagedllm.model.loader.gguf_loader import (
    ROPE_TENSORS,
    _dequantize,
    gguf_tensor_to_hf,
    gguf_to_hf_name,
    open_gguf,
)
from pagedllm.model.loader.hf_loader import _safetensors_files, mxfp4_pairs, read_mxfp4_pairs
from pagedllm.model.sharding import TensorParallelShard, shard_state_dict


def load_weight_shard(
    source: str | os.PathLike[str],
    kind: str,
    config: ModelArchConfig,
    shard: TensorParallelShard,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """This rank's Hugging Face-named weight slices, read from ``source``.

    Args:
        source: the ``.gguf`` file (kind "gguf") or the Hugging Face folder (kind "hf").
        config: the model's config (from the driver's load).
        shard: which slices (``TensorParallelShard.for_rank``).
        dtype: result dtype for floating tensors.

    Returns:
        name -> contiguous tensor of this rank's slice (norms whole); no ``lm_head.weight``
        when the embedding is tied.

    Raises:
        ValueError: naming ``kind`` when it is neither "gguf" nor "hf"; loader errors as in
            ``load_gguf_weights`` / ``load_hf_weights``.
    """
    if kind == "gguf":
        state = _gguf_shard(Path(source), config, shard)
    elif kind == "hf":
        state = _hf_shard(Path(source), config, shard)
    else:
        raise ValueError(f"kind must be 'gguf' or 'hf', got {kind!r}")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def _gguf_shard(
    path: Path, config: ModelArchConfig, shard: TensorParallelShard
) -> dict[str, torch.Tensor]:
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from pagedllm.model.registry import model_class

    names = model_class(config.architecture).gguf_tensor_names
    reader = open_gguf(path)
    check_gguf_tensor_names([t.name for t in reader.tensors], config)
    d = config.head_dim
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        if needs_whole_tensor(t.name, config):  # stacked experts, fused QKV: split, then cut
            whole = gguf_tensor_to_hf_parts(t.name, torch.from_numpy(_dequantize(t)), config)
            out.update(shard_state_dict(whole, shard, d))
            continue
        name = gguf_to_hf_name(t.name, names)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # PyTorch order
        raw = np.asarray(t.data)
        if raw.dtype != np.uint8:  # F32 / F16 come typed: the byte offsets below need bytes
            raw = raw.view(np.uint8)
        cut = shard.weight_slice(name, d)
        block, type_bytes = GGML_QUANT_SIZES[t.tensor_type]
        cols = shape[-1]
        if raw.ndim == 1 and len(shape) == 2:
            raw = raw.reshape(shape[0], -1)
        if cut is None:
            arr = dequantize(raw, t.tensor_type).reshape(shape)
        elif len(shape) == 1:  # a bias of a column-parallel projection
            arr = dequantize(raw, t.tensor_type)[cut[1] : cut[2]]
        elif cut[0] == 0:
            arr = dequantize(raw[cut[1] : cut[2]], t.tensor_type).reshape(cut[2] - cut[1], cols)
        elif cut[1] % block == 0 and cut[2] % block == 0:
            lo, hi = cut[1] // block * type_bytes, cut[2] // block * type_bytes
            arr = dequantize(raw[:, lo:hi], t.tensor_type).reshape(shape[0], cut[2] - cut[1])
        else:
            arr = dequantize(raw, t.tensor_type).reshape(shape)[:, cut[1] : cut[2]]
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
        name, w = gguf_tensor_to_hf(t.name, w, config, shard.num_heads, shard.num_kv_heads)
        out[name] = w
    return out


def _hf_shard(
    folder: Path, config: ModelArchConfig, shard: TensorParallelShard
) -> dict[str, torch.Tensor]:
    from pagedllm.model.registry import model_class

    cls = model_class(config.architecture)
    out: dict[str, torch.Tensor] = {}
    files = _safetensors_files(folder)
    pairs = mxfp4_pairs(files)
    paired = {n for pair in pairs.values() for _, n in pair}
    # MXFP4 tensors (GPT-OSS's experts) are dequantized whole, then split and cut.
    for file_name, whole_tensor in read_mxfp4_pairs(pairs, cls, torch.float32):
        name = cls.hf_weight_name(file_name)
        if name is None:
            continue
        parts = (
            cls.split_hf_weight(name, whole_tensor, config)
            if cls.splits_hf_weights
            else {name: whole_tensor}
        )
        out.update(shard_state_dict(parts, shard, config.head_dim))
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for file_name in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                name = cls.hf_weight_name(file_name)
                if name is None or file_name in paired:
                    continue
                if cls.splits_hf_weights:  # fused / transposed tensors: read whole, then cut
                    whole = cls.split_hf_weight(name, sf.get_tensor(file_name), config)
                    out.update(shard_state_dict(whole, shard, config.head_dim))
                    continue
                cut = shard.weight_slice(name, config.head_dim)
                if cut is None:
                    out[name] = sf.get_tensor(file_name)
                elif cut[0] == 0:
                    out[name] = sf.get_slice(file_name)[cut[1] : cut[2]]
                else:
                    out[name] = sf.get_slice(file_name)[:, cut[1] : cut[2]]
    # Tensors stacked from whole parts (per-head norms) are cut once stacked.
    stacked = cls.stack_hf_weights(out)
    return {
        n: t if n in out else _cut(t, shard.weight_slice(n, config.head_dim))
        for n, t in stacked.items()
    }


def _cut(t: torch.Tensor, cut: tuple[int, int, int] | None) -> torch.Tensor:
    """``t`` sliced as ``TensorParallelShard.weight_slice`` says (whole when None)."""
    if cut is None:
        return t
    return t[cut[1] : cut[2]] if cut[0] == 0 else t[:, cut[1] : cut[2]]
