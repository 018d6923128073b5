"""Hugging Face folders: ``config.json`` + ``*.safetensors`` in, and export of a loaded model out."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedllm.model.config import ModelArchConfig, hf_rope_parameters
from pagedllm.model.quant.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX
from pagedllm.model.registry import model_class

if TYPE_CHECKING:
    from pagedllm.model.decoder import DecoderForCausalLM
    from pagedllm.model.loader.load import LoadedModel

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_hf_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Parsed ``folder/config.json``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``folder``.
        ValueError: it is not valid JSON.
    """
    f = Path(folder) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{f} is not valid JSON: {exc}") from exc


def hf_arch_config(cfg: dict[str, Any], folder: str | os.PathLike[str] = "<hf>") -> ModelArchConfig:
    """Convert a Hugging Face ``config.json`` dict to :class:`ModelArchConfig`.

    The architecture is looked up in ``pagedllm.model.registry`` (``architectures``, then
    ``model_type``); the fields every decoder has are read here, the architecture's own ones by
    its class (``hf_config_fields``). Reads both the transformers 4 keys (``rope_theta``,
    ``rope_scaling``) and the transformers 5 ``rope_parameters`` dict. A sliding window is kept
    unless ``use_sliding_window`` is false (Mistral's reading; Qwen2 and Qwen3, whose
    transformers default is false, read it themselves: ``qwen2.qwen_sliding_window``);
    ``layer_types`` says which layers it applies to.
    ``eos_token_ids`` holds ``config.json``'s ``eos_token_id`` (int or list); the tokenizer /
    generation-config ids are added by ``load_model``.

    Raises:
        ValueError: the architecture is not supported (the message lists what is), or a
            required field is missing.
    """
    from pagedllm.model.registry import entry_for_hf_config

    entry = entry_for_hf_config(cfg, str(folder))
    model_cls = entry.load()
    cfg = model_cls.standardize_hf_config(cfg)
    try:
        hidden = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"{folder}: config.json lacks required field {exc}") from exc
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or hidden // n_head)

    rope_theta, rope_scaling = hf_rope_parameters(cfg, default_theta=model_cls.default_rope_theta)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types") if window else None

    eos = cfg.get("eos_token_id")
    eos_ids = (
        [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(eos)])
    )
    bos = cfg.get("bos_token_id")
    fields: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        architecture=entry.architecture,
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
        sliding_window=int(window) if window else None,
        layer_types=list(layer_types) if layer_types else None,
        partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
    )
    fields.update(model_cls.hf_config_fields(cfg))
    return ModelArchConfig(**fields)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


#: One MXFP4 pair: ((file, name of the ``_blocks`` tensor), (file, name of the ``_scales`` one)).
Mxfp4Pair = tuple[tuple[Path, str], tuple[Path, str]]


def mxfp4_pairs(files: list[Path]) -> dict[str, Mxfp4Pair]:
    """The MXFP4 tensors of a checkpoint (``model.quant.mxfp4``; GPT-OSS's experts): for every
    ``<name>_blocks`` with a ``<name>_scales`` in any of ``files``, ``name`` -> where both are.
    Reads the headers only."""
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                where[name] = f
    pairs: dict[str, Mxfp4Pair] = {}
    for name, f in where.items():
        if name.endswith(BLOCKS_SUFFIX):
            base = name.removesuffix(BLOCKS_SUFFIX)
            scales = base + SCALES_SUFFIX
            if scales in where:
                pairs[base] = ((f, name), (where[scales], scales))
    return pairs


def read_mxfp4_pairs(
    pairs: dict[str, Mxfp4Pair], cls: type[DecoderForCausalLM], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor of ``dtype``) for each pair, one at a time, dequantized by the model class
    (``DecoderForCausalLM.dequantize_mxfp4``, which refuses unless the architecture reads
    MXFP4 checkpoints)."""
    for base, ((fb, nb), (fs, ns)) in pairs.items():
        with safe_open(str(fb), framework="pt") as sf:
            blocks = sf.get_tensor(nb)
        with safe_open(str(fs), framework="pt") as sf:
            scales = sf.get_tensor(ns)
        yield base, cls.dequantize_mxfp4(base, blocks, scales, dtype)


def load_hf_weights(
    folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Load ``config.json`` and every ``*.safetensors`` shard of a Hugging Face folder.

    Floating tensors are cast to ``dtype``; names are kept as in the files (``model.layers.N...``,
    shape ``[out, in]`` for linears), except what the model class renames, splits
    (``hf_weight_name``, ``split_hf_weight``) or stacks (``stack_hf_weights``), and an MXFP4
    pair ``<name>_blocks`` / ``<name>_scales`` (GPT-OSS's experts), read as the dequantized
    ``<name>``. When the embedding is tied (``tie_word_embeddings`` or no
    ``lm_head.weight`` in the files) ``lm_head.weight`` is not returned and
    ``config.tie_word_embeddings`` is True.

    Args:
        folder: folder with ``config.json`` and ``model.safetensors`` or sharded
            ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``.
        dtype: torch.float32, torch.bfloat16 or torch.float16.

    Raises:
        FileNotFoundError: config.json or the weights are missing.
        ValueError: unsupported architecture or dtype, unreadable safetensors, or no
            ``model.embed_tokens.weight``.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    root = Path(folder)
    config = hf_arch_config(read_hf_config(root), root)
    cls = model_class(config.architecture)
    state: dict[str, torch.Tensor] = {}

    def add(name: str, t: torch.Tensor) -> None:
        renamed = cls.hf_weight_name(name)
        if renamed is None:
            return
        if t.is_floating_point():
            t = t.to(dtype)
        parts = cls.split_hf_weight(renamed, t, config) if cls.splits_hf_weights else {renamed: t}
        for part, value in parts.items():
            state[part] = value.contiguous()

    files = _safetensors_files(root)
    pairs = mxfp4_pairs(files)
    paired = {n for pair in pairs.values() for _, n in pair}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if name not in paired and cls.hf_weight_name(name) is not None:
                        add(name, sf.get_tensor(name))
        except OSError:
            raise
        except Exception as exc:
            raise ValueError(f"{f} is not a valid safetensors file: {exc}") from exc
    for name, t in read_mxfp4_pairs(pairs, cls, dtype):
        add(name, t)
    state = cls.stack_hf_weights(state)
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{root}: no model.embed_tokens.weight in the safetensors files")
    if "lm_head.weight" not in state:
        config.tie_word_embeddings = True
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


def hf_config_dict(config: ModelArchConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``config.json`` dict (``LlamaForCausalLM``) describing ``config``.

    Raises:
        ValueError: ``config`` is not a Llama (only Llama models are exported).
    """
    if config.architecture != "LlamaForCausalLM":
        raise ValueError(f"export supports LlamaForCausalLM only, not {config.architecture}")
    eos: Any = list(config.eos_token_ids)
    if len(eos) == 1:
        eos = eos[0]
    elif not eos:
        eos = None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }


def export_hf_folder(loaded: LoadedModel, out_dir: str | os.PathLike[str]) -> None:
    """Write ``loaded`` as a Hugging Face folder that transformers and vLLM can load.

    Writes ``config.json`` (``LlamaForCausalLM``, ``torch_dtype`` = the state dict's dtype),
    ``model.safetensors`` (the state dict as is; no ``lm_head.weight`` when tied),
    ``generation_config.json`` (bos and all eos ids) and the tokenizer files
    (``tokenizer.save_pretrained``). ``out_dir`` is created if needed; existing files with these
    names are overwritten.

    Raises:
        OSError: the folder cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = loaded.config
    dtypes = {t.dtype for t in loaded.state_dict.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    config_dict = hf_config_dict(cfg, dtype)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n", encoding="utf-8")

    tensors = {k: v.contiguous() for k, v in loaded.state_dict.items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    gen: dict[str, Any] = {"_from_model_config": False}
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        gen["eos_token_id"] = config_dict["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    loaded.tokenizer.save_pretrained(str(out))
    _make_tokenizer_config_portable(out, loaded)


def _make_tokenizer_config_portable(out: Path, loaded: LoadedModel) -> None:
    """Make transformers 5's ``tokenizer_config.json`` loadable by transformers 4 (as vLLM uses).

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` (unknown to 4.x) and the chat
    template only as ``chat_template.jinja`` (read by 4.x from 4.51 on); this names the class
    ``PreTrainedTokenizerFast`` (an alias in 5.x), inlines the template and sets
    ``model_max_length`` to the trained context length.
    """
    f = out / "tokenizer_config.json"
    if not f.is_file():
        return
    try:
        tok_cfg = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return
    if tok_cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = getattr(loaded.tokenizer, "chat_template", None)
    if isinstance(template, str) and "chat_template" not in tok_cfg:
        tok_cfg["chat_template"] = template
    tok_cfg["model_max_length"] = loaded.config.max_position_embeddings
    f.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
