"""GGUF files beyond what llama.cpp's current converters write for the tiny models of
``test_architectures.py``: q, k and v fused into one ``attn_qkv`` (older Phi-2 files, converted
from the original ``Wqkv``; llama.cpp's ``build_qkv`` reads one in any architecture), and a
sliding window recorded for StarCoder2 / Qwen2 / Qwen3 / Qwen2-MoE, whose converters write none.
Each loads the folder's weights and gives transformers' greedy tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import (
    WINDOW,
    build_tiny_hf_model,
    compare_to_reference,
    greedy_reference,
    write_gguf_like_llama_cpp,
)
from tests.model.gguf_files import assert_rank_slices_equal, rewrite_gguf

STEPS = 12
KW: dict[str, Any] = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)


def _loaded_from_gguf(folder: Path, path: Path) -> Any:
    """The folder's ``LoadedModel`` (its tokenizer) with the GGUF file's config and weights."""
    from pagedllm.model.loader import load_gguf_weights, load_model

    hf_loaded = load_model(str(folder))
    cfg, state = load_gguf_weights(path)
    cfg.eos_token_ids = hf_loaded.config.eos_token_ids
    cfg.bos_token_id = hf_loaded.config.bos_token_id
    return dataclasses.replace(hf_loaded, config=cfg, state_dict=state, source=path)


def _prompts(hf: Any) -> list[list[int]]:
    """Two prompts, the longer one past the tiny models' 8-token window."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23)]


def _assert_greedy_matches(hf: Any, folder: Path, loaded: Any) -> None:
    from pagedllm.entrypoints.llm import LLM

    prompts = _prompts(hf)
    llm = LLM(str(folder), loaded=loaded, block_size=16, **KW)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    counted = 0
    for p, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, greedy_reference(hf, p, STEPS))
    assert counted >= 0.75 * STEPS * len(prompts), f"only {counted} steps had a clear top-2 gap"


def _tensor_names(path: Path) -> list[str]:
    return [t.name for t in gguf.GGUFReader(path).tensors]


def test_phi2_fused_qkv_gguf_equals_transformers(tmp_path):
    """A phi2 file with ``attn_qkv`` weights and biases instead of attn_q / attn_k / attn_v loads
    the folder's q/k/v, gives transformers' tokens, and under tensor parallelism 2 (rank 1
    reading its slices from the file: the fused tensor split first, then cut) the tp = 1
    tokens."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import load_gguf_weights, load_hf_weights
    from tests.distributed.tp_utils import greedy_tokens

    hf = build_tiny_hf_model("phi", tmp_path / "hf")
    path = tmp_path / "phi2-fused.gguf"
    write_gguf_like_llama_cpp(hf, path, "phi", fused_qkv=True)
    names = _tensor_names(path)
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_qkv.bias" in names
    assert not any(".attn_q." in n or ".attn_k." in n or ".attn_v." in n for n in names)
    cfg_g, sd_g = load_gguf_weights(path)
    _, sd_h = load_hf_weights(tmp_path / "hf")
    assert sd_g.keys() == sd_h.keys() and cfg_g.attention_bias
    for name, t in sd_h.items():
        torch.testing.assert_close(sd_g[name], t, atol=1e-6, rtol=0, msg=name)
    loaded = _loaded_from_gguf(tmp_path / "hf", path)
    _assert_greedy_matches(hf, tmp_path / "hf", loaded)
    prompts = _prompts(hf)
    ref = greedy_tokens(LLM(str(tmp_path / "hf"), loaded=loaded, **KW), prompts)
    llm = LLM(str(tmp_path / "hf"), loaded=loaded, tensor_parallel_size=2, **KW)
    try:
        assert llm.engine.executor.world_size == 2
        assert greedy_tokens(llm, prompts) == ref
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["phi", "glm4", "llama"])
def test_quantized_fused_qkv_loads_and_shards(arch, tmp_path):
    """A Q8_0 file with fused ``attn_qkv`` (Phi-2; GLM-4, whose llama.cpp graph reads one; Llama,
    whose q/k parts are un-permuted after the split) loads every tensor within one Q8_0 step of
    the folder's, and one tensor-parallel rank's slices read from the file (the fused tensor
    dequantized whole, split, then cut) equal the sliced full load."""
    from pagedllm.model.loader import load_gguf_weights, load_hf_weights

    hf = build_tiny_hf_model(arch, tmp_path / "hf")
    path = tmp_path / f"{arch}-q8_0-fused.gguf"
    write_gguf_like_llama_cpp(hf, path, arch, qtype=gguf.GGMLQuantizationType.Q8_0, fused_qkv=True)
    qkv = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_qkv.weight")
    assert qkv.tensor_type == gguf.GGMLQuantizationType.Q8_0
    cfg, sd_g = load_gguf_weights(path)
    _, sd_h = load_hf_weights(tmp_path / "hf")
    assert sd_g.keys() == sd_h.keys()
    for name, t in sd_h.items():
        torch.testing.assert_close(sd_g[name], t, atol=float(t.abs().max()) / 127, rtol=0)
    assert_rank_slices_equal(path, cfg, sd_g)


@pytest.mark.parametrize("arch", ["phi", "llama"])
def test_quantized_fused_qkv_runs_on_the_files_blocks(arch, tmp_path):
    """``quantization="gguf"`` on a Q8_0 file with a fused ``attn_qkv``: every layer's QKV
    projection is a ``GGUFLinear`` built from the fused tensor's blocks (Llama: q/k rows
    reordered as llama.cpp permuted them) whose packed weight equals the one built from the
    separate-tensor file's q / k / v, and the greedy tokens equal that file's under
    ``quantization="gguf"``."""
    from pagedllm.attention.cpu import load_cpu_ops
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.quant.gguf_native import GGUFLinear
    from tests.distributed.tp_utils import greedy_tokens

    if load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    hf = build_tiny_hf_model(arch, tmp_path / "hf")
    separate, fused = tmp_path / f"{arch}-q8_0.gguf", tmp_path / f"{arch}-q8_0-fused.gguf"
    write_gguf_like_llama_cpp(hf, separate, arch, qtype=gguf.GGMLQuantizationType.Q8_0)
    rewrite_gguf(separate, fused, fuse_qkv=True)
    tokens, packed = [], []
    for path in (separate, fused):
        loaded = _loaded_from_gguf(tmp_path / "hf", path)
        llm = LLM(str(tmp_path / "hf"), loaded=loaded, quantization="gguf", **KW)
        qkv = [layer.self_attn.qkv_proj for layer in llm.engine.executor.worker.model.layers]
        assert all(isinstance(m, GGUFLinear) and len(m.parts) == 1 for m in qkv)
        packed.append([m.parts[0].data for m in qkv])  # q, k, v merged: one kernel weight
        tokens.append(greedy_tokens(llm, _prompts(hf), STEPS))
    assert all(torch.equal(a, b) for a, b in zip(*packed, strict=True))
    assert tokens[0] == tokens[1]


def test_fused_and_separate_qkv_in_one_layer_is_refused(tmp_path):
    """A file with both ``attn_qkv`` and ``attn_q`` / ``attn_k`` / ``attn_v`` for a layer is a
    ValueError naming both tensors, in the full load and in a tensor-parallel rank's, before
    anything is read (one would otherwise overwrite the other's q/k/v)."""
    from pagedllm.model.loader import load_gguf_weights
    from pagedllm.model.loader.sharded import load_weight_shard
    from pagedllm.model.sharding import TensorParallelShard

    hf = build_tiny_hf_model("phi", tmp_path / "hf")
    plain = tmp_path / "phi2.gguf"
    write_gguf_like_llama_cpp(hf, plain, "phi")
    config = load_gguf_weights(plain)[0]
    both = tmp_path / "phi2-both.gguf"
    rewrite_gguf(plain, both, fuse_qkv=True, keep_separate=True)
    names = _tensor_names(both)
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" in names
    match = r"'blk\.0\.attn_qkv\.weight' and 'blk\.0\.attn_q\.weight'"
    with pytest.raises(ValueError, match=match):
        load_gguf_weights(both)
    with pytest.raises(ValueError, match=match):
        load_weight_shard(both, "gguf", config, TensorParallelShard.for_rank(config, 1, 2))


def test_starcoder2_gguf_window_equals_transformers(tmp_path):
    """llama.cpp's starcoder2 converter records no window (such a file runs with full attention);
    a file with ``attention.sliding_window`` windows every layer, as the checkpoint does, and
    gives transformers' tokens past the 8-token window."""
    from pagedllm.model.loader import load_gguf_weights

    hf = build_tiny_hf_model("starcoder2", tmp_path / "hf")
    plain = tmp_path / "starcoder2.gguf"
    write_gguf_like_llama_cpp(hf, plain, "starcoder2")
    assert load_gguf_weights(plain)[0].sliding_window is None
    path = tmp_path / "starcoder2-window.gguf"
    rewrite_gguf(plain, path, add_keys=lambda w: w.add_sliding_window(WINDOW))
    loaded = _loaded_from_gguf(tmp_path / "hf", path)
    config = loaded.config
    assert config.sliding_window == WINDOW and config.layer_types is None
    _assert_greedy_matches(hf, tmp_path / "hf", loaded)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen2_moe"])
def test_qwen_gguf_window_equals_transformers(arch, tmp_path):
    """A qwen2 / qwen3 / qwen2moe file with ``attention.sliding_window`` and one sliding flag per
    layer (transformers' ``layer_types`` of ``use_sliding_window`` with ``max_window_layers`` 1:
    layer 1 windowed for the dense models, layer 0 for Qwen2-MoE) gives transformers' tokens
    past the 8-token window; the window without the flags is refused naming
    ``sliding_window_pattern``; without the window (llama.cpp's converters) none is used."""
    from pagedllm.model.loader import load_gguf_weights

    hf = build_tiny_hf_model(
        arch, tmp_path / "hf", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    types = hf.config.layer_types
    assert sorted(types) == ["full_attention", "sliding_attention"]
    plain = tmp_path / f"{arch}.gguf"
    write_gguf_like_llama_cpp(hf, plain, arch)
    assert load_gguf_weights(plain)[0].sliding_window is None
    flags = [t == "sliding_attention" for t in types]

    def window_and_flags(w: Any) -> None:
        w.add_sliding_window(WINDOW)
        w.add_sliding_window_pattern(flags)

    path = tmp_path / f"{arch}-window.gguf"
    rewrite_gguf(plain, path, add_keys=window_and_flags)
    loaded = _loaded_from_gguf(tmp_path / "hf", path)
    assert [loaded.config.layer_window(i) for i in range(2)] == [
        WINDOW if f else None for f in flags
    ]
    _assert_greedy_matches(hf, tmp_path / "hf", loaded)
    no_flags = tmp_path / f"{arch}-window-only.gguf"
    rewrite_gguf(plain, no_flags, add_keys=lambda w: w.add_sliding_window(WINDOW))
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        load_gguf_weights(no_flags)
