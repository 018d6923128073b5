"""Granite MoE's own rules (``pagedllm/model/granite_moe.py``): top-k-then-softmax routing equal
to transformers' router, the MoE block (with the residual multiplier folded into the experts'
down projections; Granite MoE Shared's ungated shared expert) equal to transformers' block times
that multiplier, the fused expert tensors split per expert, and the config refusals. Greedy
tokens against transformers, GGUF and tensor parallelism: ``test_architectures.py``."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.granite_moe import GraniteMoeForCausalLM
from pagedllm.model.layers.moe import route_top_k
from tests.model.arch_utils import build_tiny_hf_model


def _model(folder):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    return llm.engine.executor.worker.model


@pytest.fixture(scope="module", params=["granitemoe", "granitemoe_shared"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_tiny_hf_model(request.param, folder)


def test_routing_equals_transformers_router(tiny):
    """The experts and weights of pagedllm's router equal transformers' GraniteMoeTopKRouter
    (top-k of the logits, softmax over those k); the top k of the softmax over all experts
    without renormalising (Qwen-style routing) gives other weights."""
    _, folder, hf = tiny
    block = _model(folder).layers[0].mlp
    assert block.gate.softmax_after_top_k
    x = torch.randn(29, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ref_weights, ref_ids = hf.model.layers[0].block_sparse_moe.router(x)
        weights, ids = block.gate(x)
        logits = block.gate.linear(x)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    wrong, wrong_ids = route_top_k(logits, 2, normalize=False)
    assert torch.equal(wrong_ids, ids)  # the same experts ...
    assert float((wrong - weights).abs().max()) > 0.05  # ... weighted otherwise


def test_moe_block_equals_transformers_times_residual_multiplier(tiny):
    """The loaded (CPU-packed) block gives transformers' block output (routed experts, plus the
    shared MLP unscaled for Granite MoE Shared) times ``residual_multiplier``, which load time
    folded into the experts' (and shared expert's) down projections."""
    arch, folder, hf = tiny
    layer = _model(folder).layers[0]
    block = layer.mlp
    assert (getattr(block, "shared_expert", None) is not None) == (arch == "granitemoe_shared")
    assert getattr(block, "shared_expert_gate", None) is None  # Granite's is ungated
    x = torch.randn(13, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ref_layer = hf.model.layers[0]
    with torch.no_grad():
        ref = ref_layer.block_sparse_moe(x[None])[0]
        if arch == "granitemoe_shared":
            ref = ref + ref_layer.shared_mlp(x[None])[0]
    ref = ref * hf.config.residual_multiplier
    torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block.forward_per_token(x), ref, atol=1e-5, rtol=1e-5)


def test_fused_experts_split_per_expert(tiny):
    """``input_linear`` [E, 2I, d] becomes each expert's w1 (gate rows) and w3 (up rows),
    ``output_linear`` its w2, the router ``gate``; Granite MoE Shared's ``shared_mlp`` becomes
    ``mlp.shared_expert``; tensor parallelism then cuts the per-expert tensors as Mixtral's."""
    from pagedllm.model.loader import load_hf_weights
    from pagedllm.model.sharding import TensorParallelShard

    arch, folder, hf = tiny
    config, state = load_hf_weights(folder)
    assert config.num_experts == 8 and config.router_top_k_then_softmax
    fused = hf.model.layers[1].block_sparse_moe.experts
    inter = config.intermediate_size
    for e in (0, 7):
        ex = f"model.layers.1.block_sparse_moe.experts.{e}."
        torch.testing.assert_close(state[ex + "w1.weight"], fused.gate_up_proj[e, :inter])
        torch.testing.assert_close(state[ex + "w3.weight"], fused.gate_up_proj[e, inter:])
        torch.testing.assert_close(state[ex + "w2.weight"], fused.down_proj[e])
    router = hf.model.layers[1].block_sparse_moe.router.weight
    torch.testing.assert_close(state["model.layers.1.block_sparse_moe.gate.weight"], router)
    shared = "model.layers.0.mlp.shared_expert."
    assert (shared + "gate_proj.weight" in state) == (arch == "granitemoe_shared")
    if arch == "granitemoe_shared":
        assert config.shared_expert_intermediate_size == 48 and not config.shared_expert_gated
        torch.testing.assert_close(
            state[shared + "up_proj.weight"], hf.model.layers[0].shared_mlp.input_linear.weight[48:]
        )
    shard = TensorParallelShard.for_rank(config, 1, 2)
    ex = "model.layers.0.block_sparse_moe.experts.3."
    assert shard.weight_slice(ex + "w1.weight", 16) == (0, 16, 32)
    assert shard.weight_slice(ex + "w2.weight", 16) == (1, 16, 32)


def test_config_refusals_and_bad_expert_tensor():
    """No experts, Granite's ``mlp_bias`` and a fused expert tensor of the wrong shape are
    refused with errors naming them."""
    base = {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 4}
    fields = GraniteMoeForCausalLM.hf_config_fields(base)
    assert fields["norm_topk_prob"] and fields["shared_expert_intermediate_size"] is None
    assert fields["attention_scale"] == 1.0  # transformers' default attention_multiplier
    with pytest.raises(ValueError, match="num_local_experts"):
        GraniteMoeForCausalLM.hf_config_fields({**base, "num_local_experts": 0})
    with pytest.raises(ValueError, match="mlp_bias"):
        GraniteMoeForCausalLM.hf_config_fields({**base, "mlp_bias": True})
    from pagedllm.model.config import ModelArchConfig

    config = ModelArchConfig(
        vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=4,
    )  # fmt: skip
    name = "model.layers.0.block_sparse_moe.input_linear.weight"
    with pytest.raises(ValueError, match="input_linear"):
        GraniteMoeForCausalLM.split_hf_weight(name, torch.zeros(3, 16, 16), config)
