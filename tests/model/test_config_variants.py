"""Config variants of the Llama family that change which weights or windows a model has:
Llama's ``mlp_bias`` and Qwen2 / Qwen3's ``use_sliding_window`` / ``max_window_layers``, each
against transformers on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import (
    WINDOW,
    build_tiny_hf_model,
    compare_to_reference,
    greedy_reference,
)

KW = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
STEPS = 12


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 20)]


def _counted(llm, prompts, refs) -> int:
    """Steps of ``llm``'s greedy tokens that matched ``refs`` with a clear top-2 gap."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    counted = 0
    for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), refs, strict=True):
        c = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, ref)
    return counted


@pytest.fixture(scope="module")
def mlp_bias_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-mlp-bias")
    hf = build_tiny_hf_model("llama", folder, mlp_bias=True)
    assert hf.model.layers[0].mlp.down_proj.bias is not None
    prompts = _prompts(hf.config.vocab_size)
    return folder, hf, prompts, [greedy_reference(hf, p, STEPS) for p in prompts]


def test_llama_mlp_bias_equals_transformers(mlp_bias_llama):
    """Biases on gate, up and down: transformers' tokens on the fused C++ layer op (when the
    kernels built) and on the per-layer path of the portable backend."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.ops import load_cpu_ops

    folder, _, prompts, refs = mlp_bias_llama
    llm = LLM(str(folder), **KW)
    model = llm.engine.executor.worker.model
    assert llm.engine.model_config.mlp_bias
    assert model.layers[0].mlp.gate_up_proj.bias is not None
    if load_cpu_ops() is not None:
        assert model.fused_stack is not None  # the op adds the gate/up and down biases
    assert _counted(llm, prompts, refs) >= 18
    portable = LLM(str(folder), attention_backend="torch_native", **KW)
    assert portable.engine.executor.worker.model.fused_stack is None
    assert _counted(portable, prompts, refs) >= 18


def test_llama_mlp_bias_gguf_and_tensor_parallel(mlp_bias_llama, tmp_path):
    """llama.cpp's ``ffn_*`` biases turn ``mlp_bias`` on and load as the folder's; two
    tensor-parallel ranks (gate/up biases cut, the down bias whole) give the tp = 1 tokens."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import load_gguf_weights, load_hf_weights
    from tests.distributed.tp_utils import greedy_tokens
    from tests.model.arch_utils import write_gguf_like_llama_cpp

    folder, hf, prompts, _ = mlp_bias_llama
    path = tmp_path / "bias.gguf"
    write_gguf_like_llama_cpp(hf, path, "llama")
    cfg_g, sd_g = load_gguf_weights(path)
    _, sd_h = load_hf_weights(folder)
    assert cfg_g.mlp_bias and sd_g.keys() == sd_h.keys()
    for name, t in sd_h.items():
        torch.testing.assert_close(sd_g[name], t, atol=1e-6, rtol=0, msg=name)
    ref = greedy_tokens(LLM(str(folder), **KW), prompts)
    llm = LLM(str(folder), tensor_parallel_size=2, **KW)
    try:
        assert greedy_tokens(llm, prompts) == ref
    finally:
        llm.engine.shutdown()


def _strip(folder, *keys: str) -> None:
    """Remove ``keys`` from ``folder``'s config.json (older checkpoints lack them)."""
    f = folder / "config.json"
    cfg = json.loads(f.read_text())
    for k in keys:
        cfg.pop(k, None)
    f.write_text(json.dumps(cfg))


def test_qwen2_sliding_window_follows_transformers(tmp_path):
    """``use_sliding_window`` true windows the layers from ``max_window_layers`` (1 of 2) on;
    false, or absent (transformers' default), windows none, whatever ``sliding_window`` says.
    config.json's ``layer_types`` is removed so that pagedllm derives them; tokens equal
    transformers' on prompts longer than the 8-token window."""
    from pagedllm.entrypoints.llm import LLM

    refs = {}
    for use in (True, False):
        folder = tmp_path / f"qwen2-{use}"
        hf = build_tiny_hf_model(
            "qwen2", folder, use_sliding_window=use, sliding_window=WINDOW, max_window_layers=1
        )
        windowed = ["full_attention", "sliding_attention"] if use else ["full_attention"] * 2
        assert hf.config.layer_types == windowed
        _strip(folder, "layer_types", *(() if use else ("use_sliding_window",)))
        prompts = _prompts(hf.config.vocab_size)
        refs[use] = [greedy_reference(hf, p, STEPS) for p in prompts]
        llm = LLM(str(folder), **KW)
        config = llm.engine.model_config
        assert [config.layer_window(i) for i in range(2)] == ([None, WINDOW] if use else [None] * 2)
        assert _counted(llm, prompts, refs[use]) >= 18
    assert refs[True][1].tokens != refs[False][1].tokens  # the window changes the long prompt


def test_qwen_window_fields():
    """Qwen3 reads the window as Qwen2; listed ``layer_types`` win over ``max_window_layers``."""
    from pagedllm.model.qwen3 import Qwen3ForCausalLM

    base = {"num_hidden_layers": 3, "sliding_window": 8, "max_window_layers": 1}
    f = Qwen3ForCausalLM.hf_config_fields({**base, "use_sliding_window": True})
    assert f["sliding_window"] == 8
    assert f["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    f = Qwen3ForCausalLM.hf_config_fields(base)
    assert f["sliding_window"] is None and f["layer_types"] is None
    listed = ["sliding_attention", "full_attention", "full_attention"]
    f = Qwen3ForCausalLM.hf_config_fields(
        {**base, "use_sliding_window": True, "layer_types": listed}
    )
    assert f["layer_types"] == listed
    # transformers' defaults for absent keys: a 4096-token window from layer 28 on.
    f = Qwen3ForCausalLM.hf_config_fields({"num_hidden_layers": 30, "use_sliding_window": True})
    assert f["sliding_window"] == 4096
    assert f["layer_types"] == ["full_attention"] * 28 + ["sliding_attention"] * 2
    f = Qwen3ForCausalLM.hf_config_fields(
        {**base, "use_sliding_window": True, "sliding_window": None}
    )
    assert f["sliding_window"] is None
