"""Helpers for the tiny GGUF files that ``arch_utils.write_gguf_like_llama_cpp`` writes: the check
that one tensor-parallel rank's slices read from a file equal the sliced full load, and variants
made by rewriting such a file: q, k and v fused into one ``attn_qkv`` per layer ([all q; all k; all v]
rows, weights and biases; llama.cpp's older Phi-2 files, converted from the original ``Wqkv``,
store them so, and its ``build_qkv`` reads one in any architecture), and metadata keys that
llama.cpp's converters do not write for an architecture (a sliding window).

Every other key and tensor is copied as it is, quantized blocks included: a fused tensor's rows
are its parts' rows, and a quantized row is a whole number of blocks, so the rows concatenate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

QKV = ("attn_q", "attn_k", "attn_v")


def add_decoder_shape_keys(w: Any, c: Any, head_dim: bool = True) -> None:
    """The shape keys every tiny decoder's GGUF writer starts with, from transformers config
    ``c``: blocks, context, widths and head counts, and (``head_dim``) the key / value length."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if head_dim:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)


def assert_rank_slices_equal(path: Path, config: Any, state: dict[str, Any]) -> None:
    """Rank 1 of 2's slices read from the GGUF file ``path`` (``load_weight_shard``: fused and
    stacked tensors read whole and split first) equal ``state`` (a full load) sliced."""
    import torch

    from pagedllm.model.loader.sharded import load_weight_shard
    from pagedllm.model.sharding import TensorParallelShard, shard_state_dict

    shard = TensorParallelShard.for_rank(config, 1, 2)
    mine = load_weight_shard(path, "gguf", config, shard)
    ref = shard_state_dict(state, shard, config.head_dim)
    assert mine.keys() == ref.keys()
    for name, t in ref.items():
        torch.testing.assert_close(mine[name], t, atol=1e-6, rtol=0, msg=name)


def rewrite_gguf(
    src: Path,
    dst: Path,
    fuse_qkv: bool = False,
    add_keys: Callable[[Any], None] | None = None,
    keep_separate: bool = False,
) -> None:
    """Write ``dst``: the GGUF file ``src`` with, when ``fuse_qkv``, each layer's ``attn_q`` /
    ``attn_k`` / ``attn_v`` (weight, and bias when present) replaced by one ``attn_qkv`` of their
    rows in that order (``keep_separate``: added beside them, a malformed file), and the keys
    ``add_keys(writer)`` adds (a ``gguf.GGUFWriter`` of the same architecture).

    Raises:
        ValueError: ``fuse_qkv`` and ``src`` has no ``attn_q`` tensor, or a layer's three parts
            differ in type.
    """
    import gguf
    import numpy as np

    from tests.model.arch_utils import close_gguf

    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header, and what the writer adds itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub)
    if add_keys is not None:
        add_keys(w)
    tensors = {t.name: t for t in reader.tensors}
    fused = 0
    for t in reader.tensors:
        stem, _, kind_name = t.name.rpartition(".")
        block, _, part = stem.rpartition(".")
        if not fuse_qkv or part not in QKV or keep_separate:
            _copy(w, t.name, np.asarray(t.data), t.tensor_type)
        if fuse_qkv and part == QKV[0]:  # k and v join q's
            parts = [tensors[f"{block}.{p}.{kind_name}"] for p in QKV]
            if len({p.tensor_type for p in parts}) != 1:
                raise ValueError(f"{block}: q / k / v of different types")
            data = np.concatenate([np.asarray(p.data) for p in parts], axis=0)
            _copy(w, f"{block}.attn_qkv.{kind_name}", data, t.tensor_type)
            fused += 1
    if fuse_qkv and not fused:
        raise ValueError(f"{src} has no attn_q tensor to fuse")
    close_gguf(w)


def _copy(w: Any, name: str, data: Any, qtype: Any) -> None:
    """Add ``data`` as the reader returned it: float32 as it is, quantized blocks as raw rows."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_dtype=qtype)
