"""SmolLM3's NoPE layers beyond the token-exact comparison of ``test_architectures.py``
(``smollm3``: 4 layers, layer 3 without RoPE): the fused C++ layer stack gets rotary width 0 on
the NoPE layers only, an explicit ``no_rope_layers`` (NoPE on the first layer) with a sliding
window on those layers equals transformers too, and what is refused.
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


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(13)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 19)]


def _llm(folder: Any) -> Any:
    from pagedllm.entrypoints.llm import LLM

    return LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)


def test_fused_stack_rotates_all_but_the_nope_layers(ops, tmp_path: Any) -> None:  # noqa: ANN001
    """Every layer runs in the one C++ op; its per-layer rotary widths are the head size except
    0 on the NoPE layer (transformers' interval 4 on 4 layers: layer 3)."""
    build_tiny_hf_model("smollm3", tmp_path)
    model = _llm(tmp_path).engine.executor.worker.model
    assert model.config.nope_layers == [3]
    assert model.fused_stack is not None and model.fused_stack.num_layers == 4
    rotary_dims = model.fused_stack.layer_args[11]
    assert rotary_dims == [16, 16, 16, 0]


def test_explicit_no_rope_layers_with_window_equal_transformers(tmp_path: Any) -> None:
    """``no_rope_layers`` [0, 1, 1, 0] (NoPE on the first and last layers) and
    ``use_sliding_window``: transformers windows the NoPE layers; pagedllm's greedy tokens and
    logprobs equal its, and a ``config.json`` without ``layer_types`` derives the same layers."""
    from pagedllm.model.loader.hf_loader import hf_arch_config, read_hf_config

    hf = build_tiny_hf_model(
        "smollm3",
        tmp_path,
        no_rope_layers=[0, 1, 1, 0],
        use_sliding_window=True,
        sliding_window=WINDOW,
    )
    assert hf.config.layer_types[0] == "sliding_attention"
    cfg = read_hf_config(tmp_path)
    arch = hf_arch_config(cfg, tmp_path)
    assert arch.nope_layers == [0, 3]
    windows = [arch.layer_window(i) for i in range(4)]
    assert windows == [WINDOW, None, None, WINDOW]
    derived = hf_arch_config({k: v for k, v in cfg.items() if k != "layer_types"})
    assert [derived.layer_window(i) for i in range(4)] == windows
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    outs = _llm(tmp_path).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        ref = greedy_reference(hf, prompt, STEPS)
        assert compare_to_reference(c.token_ids, lps, ref) >= 0.75 * STEPS


def test_gguf_nope_layers_use_llama_cpp_interval(tmp_path: Any) -> None:
    """A smollm3 GGUF has no NoPE key: every fourth layer is NoPE, as llama.cpp assumes."""
    from pagedllm.model.smollm3 import SmolLM3ForCausalLM

    fields = SmolLM3ForCausalLM.gguf_config_fields(lambda key: {"block_count": 8}.get(key))
    assert fields["nope_layers"] == [3, 7]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"mlp_bias": True}, "mlp_bias"),
        ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
        ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
        ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ],
)
def test_refused_config_names_the_field(
    tmp_path: Any, override: dict[str, Any], field: str
) -> None:
    from pagedllm.model.loader.hf_loader import hf_arch_config

    build_tiny_hf_model("smollm3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("no_rope_layers")
    cfg.update(override)
    with pytest.raises(ValueError, match=field):
        hf_arch_config(cfg, tmp_path)
