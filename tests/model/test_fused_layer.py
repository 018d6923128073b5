"""The decoder layers as one C++ op (``model.layers.fused_layer``, ``csrc/cpu/fused_layer.cpp``):
the same kernels as the layers' Python forward, so every logprob of a mixed prefill + decode
batch is bit-identical with and without it, on each weight kind the op runs (fp32 panels with
the SwiGLU epilogue, oneDNN's packed fp32 weights, GGUF 4- and 8-bit blocks in several parts with
biases, int8 W8A8 records with and without biases), with partial RoPE, a sliding window and a
quantized KV cache; and the layers it cannot run stay unfused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.layers.fused_layer import KIND_ONEDNN
from pagedllm.model.loader import LoadedModel
from pagedllm.model.packed_linear import cpu_gemm_ops, onednn_linear_available
from pagedllm.model.quant.gguf_native import GGUFLinear, repack
from pagedllm.sampling_params import SamplingParams

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 33, 120, 19, 2, 77, 31, 45, 200],
    [9, 8, 7, 6],
    [150, 151, 152, 153, 154, 155, 156, 157, 158, 159, 160],
]


def with_biases(loaded: LoadedModel, seed: int = 3) -> LoadedModel:
    """``loaded`` with q/k/v and o biases (Qwen2-style attention bias)."""
    g = torch.Generator().manual_seed(seed)
    cfg = dataclasses.replace(loaded.config, attention_bias=True, o_proj_bias=True)
    sd = dict(loaded.state_dict)
    for i in range(cfg.num_hidden_layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rows = sd[f"model.layers.{i}.self_attn.{name}.weight"].shape[0]
            sd[f"model.layers.{i}.self_attn.{name}.bias"] = 0.1 * torch.randn(rows, generator=g)
    return dataclasses.replace(loaded, config=cfg, state_dict=sd)


def gguf_linear(ops, weights: list[tuple[str, torch.Tensor]], bias=None) -> GGUFLinear:  # noqa: ANN001
    """A GGUFLinear whose row blocks are ``weights`` quantized to their GGUF types."""
    parts = []
    for qtype, w in weights:
        data = np.asarray(quantize(w.numpy(), GGMLQuantizationType[qtype]))
        parts.append(repack(qtype, data, w.shape[0]))
    return GGUFLinear(parts, ops, bias)


def to_gguf(engine: LLMEngine, loaded: LoadedModel, ops) -> None:  # noqa: ANN001
    """Every projection of the engine's model on GGUF blocks: q / k / v as Q4_0 / Q4_1 / Q8_0
    (two kernel parts), o as Q5_0, gate/up as Q4_1, down as Q8_0."""
    sd = loaded.state_dict
    model = engine.executor.worker.model
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_bias = getattr(attn.qkv_proj, "bias", None)
        attn.qkv_proj = gguf_linear(
            ops,
            [
                ("Q4_0", sd[p + "self_attn.q_proj.weight"]),
                ("Q4_1", sd[p + "self_attn.k_proj.weight"]),
                ("Q8_0", sd[p + "self_attn.v_proj.weight"]),
            ],
            qkv_bias,
        )
        attn.o_proj = gguf_linear(
            ops, [("Q5_0", sd[p + "self_attn.o_proj.weight"])], getattr(attn.o_proj, "bias", None)
        )
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        mlp.gate_up_proj = gguf_linear(ops, [("Q4_1", gate_up)])
        mlp.down_proj = gguf_linear(ops, [("Q8_0", sd[p + "mlp.down_proj.weight"])])


def generate(engine: LLMEngine, tag: str) -> dict[str, tuple[list[int], list[list[float]]]]:
    """Greedy tokens and top-2 logprobs of PROMPTS, the later two arriving after the first's
    prefill (so steps mix decode and prefill rows)."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    engine.add_request(f"{tag}0", PROMPTS[0], params)
    engine.step()
    for i, ids in enumerate(PROMPTS[1:], 1):
        engine.add_request(f"{tag}{i}", ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [sorted(lp.logprob for lp in d.values()) for d in c.logprobs]
                done[out.request_id[len(tag) :]] = (list(c.token_ids), lps)
    return done


VARIANTS = {
    "fp32": {},
    "fp32_onednn": {"env": {"PAGEDLLM_DISABLE_CPU_GEMM": "1"}},
    "fp32_bias_partial_rope_window": {
        "bias": True,
        "partial_rotary_factor": 0.5,
        "sliding_window": 8,
    },
    "gguf_bias": {"bias": True, "gguf": True},
    "gguf_int8_kv": {"gguf": True, "kv_cache_dtype": "int8"},
    "int8_w8a8": {"quantization": "int8"},
    "int8_w8a8_bias": {"bias": True, "quantization": "int8"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_equals_unfused(ops, tiny_loaded, variant: str, monkeypatch) -> None:  # noqa: ANN001
    spec = VARIANTS[variant]
    for name, value in spec.get("env", {}).items():
        monkeypatch.setenv(name, value)
    if not onednn_linear_available(torch.float32) and cpu_gemm_ops(ops, torch.float32) is None:
        pytest.skip("fp32 linears are packed by neither the own GEMM nor oneDNN here")
    loaded = with_biases(tiny_loaded) if spec.get("bias") else tiny_loaded
    over = {k: spec[k] for k in ("partial_rotary_factor", "sliding_window") if k in spec}
    if over:
        loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, **over))
    cfg = EngineConfig(
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        quantization=spec.get("quantization"),
    )
    engine = LLMEngine(cfg, loaded=loaded)
    model = engine.executor.worker.model
    if spec.get("gguf"):
        to_gguf(engine, loaded, ops)
    layers = loaded.config.num_hidden_layers
    calls = []
    op = ops.decoder_layers_
    monkeypatch.setattr(ops, "decoder_layers_", lambda *a: (calls.append(1), op(*a))[1])
    assert model.use_fused_layers(ops) == layers
    if "env" in spec:  # the own GEMM is off: every projection is a oneDNN packed weight
        assert set(model.fused_stack.layer_args[3]) == {KIND_ONEDNN}
    fused = generate(engine, "f")
    assert len(calls) >= 10  # one call per step, every step of the run
    assert model.use_fused_layers(None) == 0
    assert model.fused_stack is None
    unfused = generate(engine, "u")
    assert fused == unfused
    assert len(fused) == 3 and all(len(toks) == 10 for toks, _ in fused.values())
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_fuses_by_default_and_env_turns_it_off(ops, tiny_loaded, monkeypatch) -> None:  # noqa: ANN001
    cfg = EngineConfig(dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    model = LLMEngine(cfg, loaded=tiny_loaded).executor.worker.model
    assert model.fused_stack is not None  # own GEMM panels or oneDNN packed weights
    assert model.fused_stack.num_layers == tiny_loaded.config.num_hidden_layers
    monkeypatch.setenv("PAGEDLLM_DISABLE_FUSED_LAYER", "1")
    assert model.use_fused_layers(ops) == 0


def test_layers_it_cannot_run_stay_unfused(ops, tiny_loaded) -> None:  # noqa: ANN001
    """q/k norms (Qwen3) are not in the op: those layers keep their Python forward."""
    g = torch.Generator().manual_seed(5)
    cfg = dataclasses.replace(tiny_loaded.config, qk_norm=True)
    sd = dict(tiny_loaded.state_dict)
    for i in range(cfg.num_hidden_layers):
        for name in ("q_norm", "k_norm"):
            sd[f"model.layers.{i}.self_attn.{name}.weight"] = 1 + 0.1 * torch.randn(
                cfg.head_dim, generator=g
            )
    loaded = dataclasses.replace(tiny_loaded, config=cfg, state_dict=sd)
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=64, kv_cache_memory=1 << 20), loaded=loaded
    )
    model = engine.executor.worker.model
    assert model.use_fused_layers(ops) == 0
    toks, _ = generate(engine, "q")["0"]
    assert len(toks) == 10


def test_op_rejects_an_unknown_linear_kind(ops) -> None:  # noqa: ANN001
    d, kvh, h, hd = 32, 1, 2, 16
    w = torch.zeros(1)
    cache = torch.zeros(kvh, 2, 16, hd)
    layer_args = (
        [torch.ones(d), torch.ones(d)],
        1e-5,
        [w, w, w, w],
        [0, 1, 7, 2],
        [(h + 2 * kvh) * hd, d, 2 * d, d],
        [1, 1, 1, 1],
        [torch.empty(0)] * 4,
        [0],
        h,
        kvh,
        hd,
        [hd],
        0.25,
    )
    step_args = (
        torch.ones(8, hd // 2),
        torch.zeros(8, hd // 2),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1, 1, dtype=torch.int64),
        torch.ones(1, dtype=torch.int64),
        torch.tensor([0, 1]),
        1,
        1,
        512,
    )
    with pytest.raises(RuntimeError, match="unknown linear kind 7"):
        ops.decoder_layers_(torch.zeros(1, d), [cache], [cache.clone()], layer_args, step_args)
