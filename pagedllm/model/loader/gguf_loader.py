"""Read a llama.cpp GGUF file into a :class:`ModelArchConfig` and Hugging Face named weights.

GGUF facts this module relies on:

* tensor dimensions are stored in ggml ``ne`` order (fastest-varying first), i.e. reversed with
  respect to PyTorch; a linear layer stored as ``[in, out]`` is a PyTorch ``[out, in]`` matrix.
* llama.cpp's HF->GGUF converter permutes the rows of ``q_proj`` and ``k_proj`` per head for Llama
  (not for Qwen or Gemma), from the Hugging Face "rotate half" rotary layout (first half / second
  half of the head) to interleaved pairs (GPT-J style). :func:`unpermute_qk` undoes it, so the
  weights are exactly Hugging Face's.
* for Gemma the converter stores RMSNorm weights as ``1 + w``; the loader subtracts the model's
  ``norm_weight_offset`` so the state dict holds Hugging Face's ``w`` in every format.
* tensor names map to Hugging Face names through ``GGUF_LAYER_NAMES`` plus the model class's
  ``gguf_tensor_names`` (``pagedllm.model.registry``).
* llama.cpp stores Qwen2-MoE's shared-expert gate (``ffn_gate_inp_shexp``) as a [hidden] vector;
  Hugging Face's ``shared_expert_gate.weight`` is the [1, hidden] linear it is reshaped to.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.loader.gguf_index import load_index, save_index

logger = logging.getLogger(__name__)

GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    # [all q; all k; all v], as llama.cpp's build_qkv reads any architecture's optional fused
    # tensor (older Phi-2 files, from the original Wqkv); split at load (``gguf_expand``).
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",  # Phi-2's LM head has a bias
    "output_norm.bias": "model.norm.bias",  # LayerNorm models (GPT-2, GPT-NeoX)
    "position_embd.weight": "model.embed_positions.weight",  # learned positions (GPT-2)
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp stores that carry no Hugging Face weight (folded into config.rope_scaling).
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS_LONG = "rope_factors_long.weight"
_ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_TENSORS = (_ROPE_FREQS, _ROPE_FACTORS_LONG, _ROPE_FACTORS_SHORT)


# --------------------------------------------------------------------------------------------
# Names and the Q/K permutation
# --------------------------------------------------------------------------------------------


def gguf_layer_tensor(tensor: Any) -> str:
    """llama.cpp's per-layer name of ``tensor`` (a ``gguf.constants.MODEL_TENSOR``) without the
    ``blk.N.`` prefix: ``MODEL_TENSOR.FFN_GATE_SHEXP`` -> ``ffn_gate_shexp``; for a model class's
    ``gguf_tensor_names``."""
    from gguf.constants import TENSOR_NAMES

    name: str = TENSOR_NAMES[tensor]
    return name.rpartition(".")[2]


def gguf_to_hf_name(name: str, extra: dict[str, str] | None = None) -> str:
    """Map a llama.cpp tensor name to its Hugging Face name.

    ``token_embd.weight`` -> ``model.embed_tokens.weight``, ``blk.N.attn_q.weight`` ->
    ``model.layers.N.self_attn.q_proj.weight``, ``output.weight`` -> ``lm_head.weight``, etc.;
    ``extra`` (the model class's ``gguf_tensor_names``) overrides or adds per-layer names.

    Raises:
        ValueError: the name has no Hugging Face equivalent in this architecture.
    """
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = GGUF_LAYER_NAMES if not extra else {**GGUF_LAYER_NAMES, **extra}
    m = _LAYER_RE.match(name)
    if m is not None and m.group(2) in names:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent")


def gguf_tensor_to_hf(
    gguf_name: str,
    weight: torch.Tensor,
    config: ModelArchConfig,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    hf_name: str | None = None,
) -> tuple[str, torch.Tensor]:
    """One dequantized GGUF tensor as (Hugging Face name, tensor in Hugging Face convention):
    renamed for ``config.architecture``, q/k rows un-permuted where llama.cpp permuted them, the
    norm offset removed (Gemma) and the shared-expert gate vector made a [1, hidden] matrix.

    Args:
        gguf_name: the llama.cpp tensor name.
        weight: the tensor in PyTorch axis order (float32).
        config: the model's config.
        num_heads / num_kv_heads: heads in ``weight`` (this rank's under tensor parallelism);
            default: the config's.
        hf_name: the Hugging Face name when the caller has it already (one part of a fused
            ``attn_qkv``, ``gguf_expand``); default: ``gguf_name`` renamed.

    Raises:
        ValueError: unknown name, or a q/k tensor whose rows do not fit the heads.
    """
    from pagedllm.model.registry import model_class

    cls = model_class(config.architecture)
    if hf_name is None:
        hf_name = gguf_to_hf_name(gguf_name, cls.gguf_tensor_names)
    if cls.gguf_permute_qk:
        if ".self_attn.q_proj." in hf_name:
            heads = num_heads or config.num_attention_heads
            _check_rows(gguf_name, weight, heads * config.head_dim)
            weight = unpermute_qk(weight, heads)
        elif ".self_attn.k_proj." in hf_name:
            heads = num_kv_heads or config.num_key_value_heads
            _check_rows(gguf_name, weight, heads * config.head_dim)
            weight = unpermute_qk(weight, heads)
    if config.norm_weight_offset and hf_name.endswith("norm.weight"):
        weight = weight - config.norm_weight_offset
    if hf_name.endswith(".shared_expert_gate.weight"):
        weight = weight.reshape(1, -1)
    return hf_name, weight


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head rotary row permutation of a q_proj/k_proj weight (or bias).

    The converter maps the Hugging Face rows of each head, ``[x_0..x_{h/2-1}, y_0..y_{h/2-1}]``,
    to interleaved pairs ``[x_0, y_0, x_1, y_1, ...]``
    (``reshape(n_head, 2, h/2, ...) -> swapaxes(1, 2) -> reshape``). This applies the inverse.

    Args:
        weight: ``[n_head * head_dim, in_features]`` (or ``[n_head * head_dim]`` for a bias), any
            dtype, in GGUF (interleaved) row order.
        n_head: heads this projection produces: query heads for q_proj, key/value heads for k_proj.

    Returns:
        A new contiguous tensor of the same shape and dtype in Hugging Face row order.

    Raises:
        ValueError: the row count is not a multiple of ``2 * n_head``.
    """
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head) != 0:
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    rest = tuple(weight.shape[1:])
    return weight.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


# --------------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------------


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open a GGUF file with ``gguf.GGUFReader`` (memory-mapped, nothing is dequantized yet).

    The first open of a file saves an index of its metadata and tensor table in pagedllm's
    cache (``gguf_index``); later opens of the unchanged file return a ``GGUFIndex`` built from
    it, which serves the same ``fields`` / ``tensors`` without the reader's slow metadata parse.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``"<path> is not a valid GGUF file: <reason>"`` for a bad magic number, an
            unsupported version, truncated or corrupt metadata or tensor data.
    """
    import gguf

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    if not p.is_file():
        raise ValueError(f"{p} is not a valid GGUF file: not a regular file")
    indexed = load_index(p)
    if indexed is not None:
        return indexed
    try:
        reader = gguf.GGUFReader(p)
        # The reader slices the memory map lazily; a short slice means the data was truncated.
        for t in reader.tensors:
            if t.data.nbytes != int(t.n_bytes):
                raise ValueError(f"tensor {t.name!r} data is truncated")
    except OSError:
        raise
    except Exception as exc:  # gguf raises ValueError, KeyError, IndexError, UnicodeError...
        raise ValueError(f"{p} is not a valid GGUF file: {type(exc).__name__}: {exc}") from exc
    save_index(p, reader)
    return reader


def gguf_metadata(reader: Any, key: str, default: Any = None) -> Any:
    """Value of one GGUF metadata key (scalars as Python scalars, arrays as lists) or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as exc:
        raise ValueError(f"GGUF metadata key {key!r} could not be read: {exc}") from exc


def _f32(value: Any) -> float:
    """A GGUF FLOAT32 value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _array_len(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else len(field.data)


def _llama3_rope_scaling(
    rope_freqs: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover Hugging Face ``llama3`` rope scaling parameters from llama.cpp's ``rope_freqs``.

    llama.cpp stores the per-frequency divisors the converter computed from ``factor``,
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``; this
    searches the values used by released models for the set that reproduces them.
    """
    target = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor = _f32(target.max())
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if inv_freq.shape != target.shape:
        return None
    for old_ctx in (8192, 4096, 2048, 16384, 32768, 131072):
        for low in (1.0, 2.0, 0.5, 4.0):
            for high in (4.0, 1.0, 2.0, 8.0, 16.0, 32.0):
                if high <= low:
                    continue
                wavelen = 2 * math.pi / inv_freq
                smooth = (old_ctx / wavelen - low) / (high - low)
                mid = 1.0 / ((1 - smooth) / factor + smooth)
                cand = np.where(
                    wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid)
                )
                if np.allclose(cand, target, rtol=1e-4, atol=1e-5):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": old_ctx,
                    }
    return None


def _longrope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], path: str | os.PathLike[str]
) -> dict[str, Any]:
    """Hugging Face ``longrope`` rope scaling (Phi-3) from llama.cpp's ``rope_factors_long`` /
    ``rope_factors_short`` tensors and ``<arch>.rope.scaling.original_context_length``;
    ``attention_factor`` only when ``rope.scaling.attn_factor`` differs from the value
    transformers derives, sqrt(1 + ln(s) / ln(original)) with s = context / original.

    Raises:
        ValueError: the short factors or the original context length are missing.
    """
    if _ROPE_FACTORS_SHORT not in tensors:
        raise ValueError(f"{path}: {_ROPE_FACTORS_LONG!r} without {_ROPE_FACTORS_SHORT!r}")
    orig = gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is None:
        raise ValueError(
            f"{path}: GGUF metadata key {arch}.rope.scaling.original_context_length is missing"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in _dequantize(tensors[_ROPE_FACTORS_LONG]).reshape(-1)],
        "short_factor": [float(x) for x in _dequantize(tensors[_ROPE_FACTORS_SHORT]).reshape(-1)],
        "original_max_position_embeddings": int(orig),
    }
    attn = gguf_metadata(reader, f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        s = int(gguf_metadata(reader, f"{arch}.context_length", orig)) / int(orig)
        derived = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(int(orig)))
        if abs(float(attn) - derived) > 1e-6 * derived:
            scaling["attention_factor"] = _f32(attn)
    return scaling


def gguf_arch_config(reader: Any, path: str | os.PathLike[str] = "<gguf>") -> ModelArchConfig:
    """Build a :class:`ModelArchConfig` from GGUF ``<arch>.*`` metadata (``general.architecture``
    picks the model class in ``pagedllm.model.registry``; its ``gguf_config_fields`` and
    ``gguf_tensor_fields`` add the architecture's own fields).

    ``head_dim`` comes from ``<arch>.attention.key_length``, else ``<arch>.rope.dimension_count``,
    else ``hidden / heads``; ``vocab_size`` from the length of ``tokenizer.ggml.tokens``, else
    ``<arch>.vocab_size``, else the embedding rows. ``tie_word_embeddings`` is True when the file
    has no ``output.weight``; ``attention_bias`` / ``o_proj_bias`` / ``mlp_bias`` when it has
    ``attn_q`` (or fused ``attn_qkv``) / ``attn_output`` / ``ffn_up`` biases (no metadata key
    records them; an architecture's own fields may override them). ``bos_token_id`` is
    ``tokenizer.ggml.bos_token_id`` and ``eos_token_ids`` holds ``tokenizer.ggml.eos_token_id``
    (the tokenizer/chat-template ids are added by :func:`pagedllm.model.loader.load_model`).

    Raises:
        ValueError: ``general.architecture`` is not supported (the message lists what is), a
            required key is missing, or the rope scaling cannot be represented.
    """
    from pagedllm.model.registry import entry_for_gguf

    arch = gguf_metadata(reader, "general.architecture")
    num_experts = int(gguf_metadata(reader, f"{arch}.expert_count", 0) or 0)
    entry = entry_for_gguf(arch, str(path), num_experts)

    def req(key: str) -> Any:
        value = gguf_metadata(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.{key!s} is missing")
        return value

    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = int(gguf_metadata(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = gguf_metadata(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = gguf_metadata(reader, f"{arch}.rope.dimension_count", hidden // n_head)
    head_dim = int(head_dim)
    rope_theta = _f32(gguf_metadata(reader, f"{arch}.rope.freq_base", 10000.0))

    tensors = {t.name: t for t in reader.tensors}
    vocab = _array_len(reader, "tokenizer.ggml.tokens")
    if vocab is None:
        vocab = gguf_metadata(reader, f"{arch}.vocab_size")
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    if vocab is None:
        raise ValueError(f"{path}: cannot determine the vocabulary size")

    rope_scaling: dict[str, Any] | None = None
    scaling_type = gguf_metadata(reader, f"{arch}.rope.scaling.type")
    factor = gguf_metadata(reader, f"{arch}.rope.scaling.factor")
    if factor is None and gguf_metadata(reader, f"{arch}.rope.scale_linear") is not None:
        scaling_type, factor = "linear", gguf_metadata(reader, f"{arch}.rope.scale_linear")
    if scaling_type not in (None, "none") and factor is not None and float(factor) != 1.0:
        rope_scaling = {"rope_type": str(scaling_type), "factor": _f32(factor)}
        orig = gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
        attn_factor = gguf_metadata(reader, f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            rope_scaling["attention_factor"] = _f32(attn_factor)
    if _ROPE_FREQS in tensors:
        freqs = _dequantize(tensors[_ROPE_FREQS])
        if not np.all(freqs == 1.0):
            rope_scaling = _llama3_rope_scaling(freqs, rope_theta, head_dim)
            if rope_scaling is None:
                raise ValueError(
                    f"{path}: tensor {_ROPE_FREQS!r} holds rope frequency factors that do not "
                    "match Llama 3 rope scaling; unsupported"
                )

    if _ROPE_FACTORS_LONG in tensors:
        rope_scaling = _longrope_scaling(reader, arch, tensors, path)

    bos = gguf_metadata(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_metadata(reader, "tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_hidden_layers=int(req("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=_f32(gguf_metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(gguf_metadata(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        architecture=entry.architecture,
        # llama.cpp keys no attention or MLP bias: a Llama-named file has the tensors or not.
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
    )
    if num_experts:
        # llama.cpp has no per-layer MoE key: the layers with a router are the sparse ones.
        n_layers = fields["num_hidden_layers"]
        moe = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
        fields["moe_layers"] = None if len(moe) == n_layers else moe
    cls = entry.load()
    fields.update(cls.gguf_config_fields(lambda key: gguf_metadata(reader, f"{arch}.{key}")))
    fields.update(cls.gguf_tensor_fields(tensors.keys()))
    return ModelArchConfig(**fields)


def _dequantize(tensor: Any) -> np.ndarray:
    """Dequantize one ``ReaderTensor`` into a writable float32 array in PyTorch axis order.

    Raises:
        ValueError: the tensor type has no dequantizer in ``gguf.quants`` or the data is corrupt.
    """
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    try:
        out = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}: {exc}"
        ) from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    out = np.asarray(out)
    if not np.issubdtype(out.dtype, np.floating):
        raise ValueError(f"GGUF tensor {tensor.name!r} has non-float type {qtype.name}")
    # np.array(copy=True) detaches from the read-only memory map (F32 is returned as a view).
    return np.array(out.reshape(shape), dtype=np.float32, copy=True)


def load_gguf_weights(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, keep_blocks: bool = False
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Load the architecture and all weights of a GGUF file, with Hugging Face names.

    Every tensor is dequantized to float32 (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x, K-quants...:
    whatever ``gguf.quants`` implements), reshaped to PyTorch order (linears ``[out, in]``,
    embedding ``[vocab, hidden]``, norms ``[hidden]``), q/k rows un-permuted (Llama), Gemma's
    norm offset removed (``gguf_tensor_to_hf``), stacked MoE experts and fused projections split
    (``gguf_expand.gguf_tensor_to_hf_parts``), then cast to ``dtype``. No ``lm_head.weight`` is
    returned when the embedding is tied.

    With ``keep_blocks`` (``quantization="gguf"``) the tensors whose blocks the layers will
    compute natively (``quant.gguf_model.native_tensor_names``) are not expanded: their entries
    are tensors on the meta device (right names and shapes, no memory), which
    ``load_named_weights`` leaves unloaded and the worker replaces by ``GGUFLinear`` layers
    read from the file. So the float32 expansion of those projections never exists.

    Args:
        path: the ``.gguf`` file.
        dtype: torch.float32, torch.bfloat16 or torch.float16.
        keep_blocks: leave the natively computed projections unexpanded (meta entries).

    Returns:
        ``(config, state_dict)``; ``config.eos_token_ids`` holds only the GGUF EOS id.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not a valid GGUF file, unsupported architecture, tensors with no Hugging Face
            name in this architecture (the message names up to five, their count and the
            architecture: ``gguf_expand.check_gguf_tensor_names``), an unsupported tensor type
            (the message names the tensor and type), or a shape that does not match the
            metadata.
    """
    from pagedllm.model.loader.gguf_expand import check_gguf_tensor_names, gguf_tensor_to_hf_parts

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    reader = open_gguf(path)
    config = gguf_arch_config(reader, path)
    check_gguf_tensor_names([t.name for t in reader.tensors], config)
    kept: set[str] = set()
    if keep_blocks:
        from pagedllm.model.quant.gguf_model import native_tensor_names

        kept = native_tensor_names(config, reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # folded into config.rope_scaling
        if tensor.name in kept:
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            placeholder = torch.empty(shape, dtype=torch.float32, device="meta")
            for hf_name, weight in gguf_tensor_to_hf_parts(tensor.name, placeholder, config).items():
                state[hf_name] = weight.to(dtype)
            continue
        try:
            array = _dequantize(tensor)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(
                f"{path} is not a valid GGUF file: tensor {tensor.name!r} "
                f"({tensor.tensor_type.name}) could not be decoded: {exc}"
            ) from exc
        parts = gguf_tensor_to_hf_parts(tensor.name, torch.from_numpy(array), config)
        for hf_name, weight in parts.items():
            state[hf_name] = weight.to(dtype).contiguous()
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


def _check_rows(name: str, weight: torch.Tensor, rows: int) -> None:
    if weight.shape[0] != rows:
        raise ValueError(
            f"GGUF tensor {name!r} has {weight.shape[0]} output rows, expected {rows} "
            "from the head count and head_dim metadata"
        )
