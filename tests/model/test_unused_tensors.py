"""Checkpoint tensors that no parameter reads are refused (``weight_map.load_named_weights``,
``gguf_expand.check_gguf_tensor_names``), except the explicit allow-list, another pipeline
stage's layers and a tied head stored twice; tensor-parallel ranks load as before."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model.weight_map import load_named_weights, unused_tensors_error
from tests.model.arch_utils import build_tiny_hf_model, write_gguf_like_llama_cpp

KW = dict(dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(folder, transformers model) of the tiny Llama."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, build_tiny_hf_model("llama", folder)


def _copy_with(folder: Path, dest: Path, extra: dict[str, torch.Tensor]) -> Path:
    """``folder`` copied to ``dest`` with ``extra`` tensors added to its safetensors file."""
    dest.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, **extra}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _model(config):
    """The pagedllm model of ``config`` on the portable backend (weights not loaded)."""
    from pagedllm.attention import get_attention_backend
    from pagedllm.model.registry import model_class

    backend = get_attention_backend("torch_native", "cpu")
    return model_class(config.architecture)(config, torch.float32, backend, max_positions=64)


def test_extra_tensor_in_folder_is_refused(tiny_llama, tmp_path):
    """An MLP tensor the model has no parameter for fails ``load_model`` (before any worker
    starts) and a worker's own load, naming the tensor, the count and the architecture."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import load_hf_weights, load_model

    folder, _ = tiny_llama
    extra = {"model.layers.0.mlp.extra.weight": torch.zeros(4, 4)}
    bad = _copy_with(folder, tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=r"^1 checkpoint tensor\(s\) \('model\.layers\.0\.mlp\.ex"):
        load_model(str(bad))
    with pytest.raises(ValueError, match="not used by LlamaForCausalLM; the checkpoint may be"):
        LLM(str(bad), **KW)
    config, state = load_hf_weights(bad)  # the loader itself keeps every tensor
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        _model(config).load_weights(state)


def test_message_names_five_and_counts():
    names = [f"model.layers.{i}.mlp.extra.weight" for i in range(7)]
    msg = str(unused_tensors_error(names, "LlamaForCausalLM"))
    assert msg.startswith("7 checkpoint tensor(s)")
    assert names[4] in msg and names[5] not in msg and "and 2 more" in msg
    assert "pagedllm does not support" in msg


def test_allow_listed_and_tied_tensors_load(tiny_llama, tmp_path):
    """Old transformers' stored RoPE buffers are ignored; a tied head stored twice loads when it
    equals the embedding and is refused when it differs."""
    from pagedllm.model.loader import load_hf_weights

    folder, _ = tiny_llama
    inv = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}
    config, state = load_hf_weights(_copy_with(folder, tmp_path / "old", inv))
    assert inv.keys() <= state.keys()
    load_named_weights(_model(config), state)

    config = dataclasses.replace(config, tie_word_embeddings=True)
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    model = _model(config)
    embed = state["model.embed_tokens.weight"]
    load_named_weights(model, {**state, "lm_head.weight": embed.clone()})
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        load_named_weights(model, {**state, "lm_head.weight": embed + 1})


def test_other_stage_layers_are_not_unused(tiny_llama):
    """A pipeline stage loads its layers from the full state dict; another stage's extra
    tensor is that stage's to refuse."""
    from pagedllm.model.loader import load_hf_weights

    folder, _ = tiny_llama
    config, state = load_hf_weights(folder)
    state = {**state, "model.layers.1.mlp.extra.weight": torch.zeros(2)}
    first = _model(config)
    first.keep_stage_layers(range(0, 1))
    load_named_weights(first, state)
    second = _model(config)
    second.keep_stage_layers(range(1, 2))
    with pytest.raises(ValueError, match="model.layers.1.mlp.extra.weight"):
        load_named_weights(second, state)


def test_tensor_parallel_rank_slices_load_and_extra_is_refused(tiny_llama, tmp_path):
    """Each of two ranks reads its slices of every tensor (nothing left unused); the folder
    with an extra tensor fails under tensor parallelism too."""
    from pagedllm.entrypoints.llm import LLM
    from tests.distributed.tp_utils import greedy_tokens

    folder, _ = tiny_llama
    llm = LLM(str(folder), tensor_parallel_size=2, **KW)
    try:
        assert greedy_tokens(llm, [[5, 6, 7]], 4)
    finally:
        llm.engine.shutdown()
    bad = _copy_with(folder, tmp_path / "bad", {"model.layers.1.mlp.extra.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.layers.1.mlp.extra.weight"):
        LLM(str(bad), tensor_parallel_size=2, **KW)


def _gguf_with(hf, path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The tiny model written as llama.cpp would, plus ``extra`` (GGUF names verbatim when they
    start with ``blk.``, else Hugging Face names mapped as the writer maps them)."""
    fake = SimpleNamespace(config=hf.config, state_dict=lambda: {**hf.state_dict(), **extra})
    write_gguf_like_llama_cpp(fake, path, "llama")
    return path


def test_gguf_unknown_tensor_is_refused(tiny_llama, tmp_path):
    """A tensor with no Hugging Face name fails before anything is dequantized, whole or as a
    tensor-parallel rank's slices."""
    from pagedllm.model.loader import load_gguf_weights, load_hf_weights
    from pagedllm.model.loader.sharded import load_weight_shard
    from pagedllm.model.sharding import TensorParallelShard

    folder, hf = tiny_llama
    extra = {"blk.0.ffn_extra.weight": torch.zeros(4, 64), "blk.1.ffn_extra.weight": torch.ones(4)}
    path = _gguf_with(hf, tmp_path / "bad.gguf", extra)
    with pytest.raises(ValueError, match=r"^2 checkpoint tensor\(s\) \('blk\.0\.ffn_extra"):
        load_gguf_weights(path)
    config, _ = load_hf_weights(folder)
    with pytest.raises(ValueError, match="not used by LlamaForCausalLM"):
        load_weight_shard(path, "gguf", config, TensorParallelShard.for_rank(config, 0, 2))


def test_gguf_mapped_but_unread_tensor_is_refused(tiny_llama, tmp_path):
    """A known llama.cpp name the model has no parameter for (a gate bias without the up
    bias that turns ``mlp_bias`` on) fails the engine's load."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import load_gguf_weights, load_model

    folder, hf = tiny_llama
    bias = {"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)}
    path = _gguf_with(hf, tmp_path / "bias.gguf", bias)
    config, state = load_gguf_weights(path)
    assert not config.mlp_bias and "model.layers.0.mlp.gate_proj.bias" in state
    loaded = load_model(str(folder))
    config.eos_token_ids, config.bos_token_id = loaded.config.eos_token_ids, 1
    bad = dataclasses.replace(loaded, config=config, state_dict=state, source=path)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.gate_proj.bias'"):
        LLM(str(folder), loaded=bad, **KW)
