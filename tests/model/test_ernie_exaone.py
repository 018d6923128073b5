"""ERNIE 4.5 dense and EXAONE 4.0 beyond the token-exact comparison of ``test_architectures.py``:
ERNIE with ``use_bias`` (every projection biased) equals transformers and keeps the one-op C++
layer stack; EXAONE 4.0's layer types from ``sliding_window_pattern``, its NoPE full-attention
layers (only with a window), a four-layer hybrid model equal to transformers; what is refused.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import (
    WINDOW,
    build_tiny_hf_model,
    compare_to_reference,
    greedy_reference,
)

STEPS = 12


def _greedy_matches(hf: Any, folder: Any) -> Any:
    """Run two prompts (one longer than the window) on pagedllm and compare with ``hf``;
    returns the pagedllm model."""
    from pagedllm.entrypoints.llm import LLM

    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 21)]
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    counted = 0
    for p in prompts:
        c = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, greedy_reference(hf, p, STEPS))
    assert counted >= 0.75 * STEPS * len(prompts)
    return llm.engine.executor.worker.model


def test_ernie_use_bias_equals_transformers(ops, tmp_path: Any) -> None:  # noqa: ANN001
    """``use_bias`` puts biases on q, k, v, o, gate, up and down (the q/k biases reordered with
    their rows); the layers still run in the one C++ op."""
    hf = build_tiny_hf_model("ernie4_5", tmp_path, use_bias=True)
    model = _greedy_matches(hf, tmp_path)
    cfg = model.config
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias and cfg.tie_word_embeddings
    assert model.fused_stack is not None and model.fused_stack.num_layers == 2


def test_ernie_config_defaults_and_refusals() -> None:
    """A config.json without a RoPE base or tie flag gets transformers' (500000, tied); a
    non-SiLU activation is refused naming ``hidden_act``."""
    from pagedllm.model.loader.hf_loader import hf_arch_config

    base = {
        "architectures": ["Ernie4_5ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    cfg = hf_arch_config(base)
    assert cfg.rope_theta == 500000.0 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert hf_arch_config({**base, "rope_theta": 10000.0}).rope_theta == 10000.0
    with pytest.raises(ValueError, match="hidden_act"):
        hf_arch_config({**base, "hidden_act": "gelu"})


def _exaone_base(**kw: Any) -> dict[str, Any]:
    return {
        "architectures": ["Exaone4ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        **kw,
    }


def test_exaone4_layer_types_and_nope_layers() -> None:
    """With a window: layer types from an integer pattern (every p-th layer global) when
    ``layer_types`` is absent, and the global layers are NoPE; without a window: every layer
    full attention with RoPE, whatever ``layer_types`` says; a non-integer pattern without
    ``layer_types`` is refused naming ``sliding_window_pattern``."""
    from pagedllm.model.loader.hf_loader import hf_arch_config

    cfg = hf_arch_config(_exaone_base(sliding_window=16, sliding_window_pattern=4))
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + [
        "sliding_attention"
    ] * 3 + ["full_attention"]
    assert cfg.nope_layers == [3, 7] and cfg.qk_norm and not cfg.qk_norm_full_width
    assert [cfg.layer_window(i) for i in range(4)] == [16, 16, 16, None]
    cfg = hf_arch_config(_exaone_base(sliding_window=None, layer_types=["full_attention"] * 8))
    assert cfg.sliding_window is None and cfg.nope_layers is None and cfg.layer_types is None
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        hf_arch_config(_exaone_base(sliding_window=16, sliding_window_pattern="LLLG"))
    with pytest.raises(ValueError, match="hidden_act"):
        hf_arch_config(_exaone_base(hidden_act="relu"))


def test_exaone4_four_layer_pattern_equals_transformers(tmp_path: Any) -> None:
    """Four layers from transformers' default pattern (3 local with RoPE, 1 global without):
    pagedllm's tokens equal transformers', also from a config.json stripped of ``layer_types``
    (derived from ``sliding_window_pattern``)."""
    from pagedllm.model.loader.hf_loader import hf_arch_config, read_hf_config

    hf = build_tiny_hf_model(
        "exaone4",
        tmp_path,
        num_hidden_layers=4,
        layer_types=None,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
    )
    assert hf.config.layer_types[3] == "full_attention"
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("layer_types")
    path.write_text(json.dumps(raw))
    cfg = hf_arch_config(read_hf_config(tmp_path), tmp_path)
    assert cfg.layer_types == hf.config.layer_types and cfg.nope_layers == [3]
    _greedy_matches(hf, tmp_path)
