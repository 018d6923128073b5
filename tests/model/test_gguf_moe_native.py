"""``quantization="gguf"`` on MoE files: llama.cpp's stacked expert tensors
(``blk.N.ffn_{gate,up,down}_exps.weight``) computed on their blocks, one ``GGUFLinear`` per
expert and projection, never expanded to float32 when the loader keeps the blocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from tests.model.arch_utils import build_tiny_hf_model, write_gguf_like_llama_cpp
from tests.model.test_gguf_native import int8_activation_reference

KW: dict[str, Any] = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)


def _loaded(folder: Path, path: Path, keep_blocks: bool) -> Any:
    """The folder's ``LoadedModel`` (its tokenizer) with the GGUF file's config and weights."""
    from pagedllm.model.loader import load_gguf_weights, load_model

    hf_loaded = load_model(str(folder))
    cfg, state = load_gguf_weights(path, keep_blocks=keep_blocks)
    cfg.eos_token_ids = hf_loaded.config.eos_token_ids
    cfg.bos_token_id = hf_loaded.config.bos_token_id
    return dataclasses.replace(hf_loaded, config=cfg, state_dict=state, source=path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_experts_run_on_the_files_blocks(arch: str, tmp_path: Path) -> None:
    """Every expert of a Q8_0 MoE file runs as two ``GGUFLinear`` layers (gate/up, down) whose
    outputs equal the dequantized expert weights' product within the kernels' activation
    rounding (so: the expert's own rows, gate before up); the float expert stacks are gone;
    with the blocks kept by the loader the expert tensors are meta entries and the greedy
    tokens equal those of the expanded load (same kernels, same order)."""
    from pagedllm.attention.cpu import load_cpu_ops
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.layers.moe import StackedExperts
    from pagedllm.model.quant.gguf_native import GGUFLinear
    from tests.distributed.tp_utils import greedy_tokens

    if load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    hf = build_tiny_hf_model(arch, tmp_path / "hf")
    path = tmp_path / f"{arch}-q8_0.gguf"
    write_gguf_like_llama_cpp(hf, path, arch, qtype=gguf.GGMLQuantizationType.Q8_0)
    exps = [t for t in gguf.GGUFReader(path).tensors if "_exps" in t.name]
    assert exps and all(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in exps)
    full, kept = _loaded(tmp_path / "hf", path, False), _loaded(tmp_path / "hf", path, True)
    assert kept.state_dict["lm_head.weight"].is_meta  # untied: the head stays in blocks too
    expert_names = [n for n, t in kept.state_dict.items() if t.is_meta and ".experts." in n]
    num_experts = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
    assert len(expert_names) == len(exps) * num_experts  # each stack cut into one per expert
    assert expert_names and not any(t.is_meta for t in full.state_dict.values())

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23)]
    tokens = []
    for loaded in (full, kept):
        llm = LLM(str(tmp_path / "hf"), loaded=loaded, quantization="gguf", **KW)
        model = llm.engine.executor.worker.model
        stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, StackedExperts)]
        assert stacks and not any(p.is_meta for p in model.parameters())
        assert isinstance(model.lm_head_packed, GGUFLinear)
        assert model.lm_head_weight.numel() == (
            0 if loaded is kept else hf.config.vocab_size * hf.config.hidden_size
        )
        for name, experts in stacks:
            assert "gate_up_weight" not in experts._parameters
            assert all(isinstance(m, GGUFLinear) for m in experts.packed_gate_up)
            assert all(isinstance(m, GGUFLinear) for m in experts.packed_down)
            if loaded is not full:
                continue
            # Expert 5's matrices against the dequantized file's (full.state_dict).
            gate_up_names = experts.checkpoint_names(f"{name}.gate_up_weight")
            down_names = experts.checkpoint_names(f"{name}.down_weight")
            per = len(gate_up_names) // experts.num_experts
            w_gu = torch.cat([full.state_dict[n] for n in gate_up_names[5 * per : 6 * per]])
            w_d = full.state_dict[down_names[5]]
            x = torch.randn(3, w_gu.shape[1], generator=g)
            h = torch.randn(3, w_d.shape[1], generator=g)
            for lin, w, a in (
                (experts.packed_gate_up[5], w_gu, x),
                (experts.packed_down[5], w_d, h),
            ):
                scale = (a.abs() @ w.abs().T).clamp_min(1e-6)
                err = (lin(a) - int8_activation_reference(a, w)).abs() / scale
                assert err.max() < 1e-5
        tokens.append(greedy_tokens(llm, prompts, 12))
        llm.engine.shutdown()
    assert tokens[0] == tokens[1]
