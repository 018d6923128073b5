"""The sparse MoE block (``pagedllm/model/layers/moe.py``) on a tiny random Mixtral / Qwen3-MoE:
every routed expert runs once per step over all its tokens (counted at the expert call site),
routing equal to transformers' router, outputs equal to transformers' MoE block, and the config
and loading rules (dense layers of Qwen3-MoE, expert shards under tensor parallelism, missing
experts named).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedllm.model.layers.moe import SparseMoeBlock
from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model

STEPS = 6


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    return folder, build_tiny_hf_model("mixtral", folder)


def _moe_blocks(model) -> list[tuple[int, SparseMoeBlock]]:
    return [(i, layer.mlp) for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")]


def test_each_routed_expert_runs_once_per_step(tiny_mixtral):
    """Four sequences batched (prefill, then decode steps of 4 tokens x top-2 = 8 assignments
    over 8 experts, so tokens share experts): per layer and step, one expert call per distinct
    routed expert, with exactly the rows transformers' router sends it."""
    from pagedllm.entrypoints.llm import LLM

    folder, hf = tiny_mixtral
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    model = llm.engine.executor.worker.model
    blocks = _moe_blocks(model)
    assert [i for i, _ in blocks] == [0, 1]
    calls: list[tuple[int, torch.Tensor, list[tuple[int, int]]]] = []  # (layer, x, calls)

    for index, block in blocks:

        def record_input(module, args, index=index):
            calls.append((index, args[0].clone(), []))

        def counted(expert, rows, run=block.experts.forward):
            calls[-1][2].append((expert, rows.shape[0]))
            return run(expert, rows)

        block.register_forward_pre_hook(record_input)
        block.experts.forward = counted

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 14, 20)]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)

    shared_steps = 0
    for index, x, expert_calls in calls:
        router = hf.model.layers[index].mlp.gate  # transformers' MixtralTopKRouter
        with torch.no_grad():
            _, _, ref_ids = router(x)
        want = Counter(ref_ids.flatten().tolist())
        experts = [e for e, _ in expert_calls]
        assert len(experts) == len(set(experts)), f"an expert ran twice: {experts}"
        assert dict(expert_calls) == dict(want)  # the routed experts, each with all its rows
        if x.shape[0] > 1 and len(experts) < ref_ids.numel():
            shared_steps += 1
    decode_calls = [c for c in calls if c[1].shape[0] == len(prompts)]
    assert len(decode_calls) == 2 * (STEPS - 1)  # both layers, every batched decode step
    assert shared_steps >= len(decode_calls)  # 8 assignments over 8 experts: some share


def test_block_equals_transformers_and_per_token_loop(tiny_mixtral):
    """The loaded (CPU-packed) block gives transformers' MoE output, and the naive per-token
    loop (the benchmark's baseline) gives the same."""
    from pagedllm.entrypoints.llm import LLM

    folder, hf = tiny_mixtral
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    (_, block), *_ = _moe_blocks(llm.engine.executor.worker.model)
    x = torch.randn(13, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(x[None])[0]
    torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block.forward_per_token(x), ref, atol=1e-5, rtol=1e-5)
    residual = torch.ones_like(x)
    out = block(x, residual=residual)
    assert out is residual
    torch.testing.assert_close(out, ref + 1, atol=1e-5, rtol=1e-5)


def test_qwen3_moe_sparse_and_dense_layers():
    """``decoder_sparse_step`` / ``mlp_only_layers`` pick the MoE layers as transformers does;
    ``num_experts`` (Qwen's name) and ``num_local_experts`` (what transformers 5 saves) both
    read."""
    from pagedllm.model.qwen3_moe import Qwen3MoeForCausalLM

    base = {"num_hidden_layers": 6, "intermediate_size": 256, "moe_intermediate_size": 32}
    f = Qwen3MoeForCausalLM.hf_config_fields(
        {**base, "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert f["moe_layers"] == [1, 5] and f["num_experts"] == 8
    assert f["norm_topk_prob"] is False and f["moe_intermediate_size"] == 32
    f = Qwen3MoeForCausalLM.hf_config_fields({**base, "num_local_experts": 4})
    assert f["moe_layers"] == list(range(6)) and f["num_experts"] == 4


def test_expert_shards_and_missing_expert_named(tiny_mixtral):
    """Tensor parallelism cuts every expert's intermediate width (gate/up rows, down columns;
    the router whole) and refuses a width it cannot split; a missing expert tensor is named."""
    import dataclasses

    from pagedllm.model.loader import load_hf_weights
    from pagedllm.model.mixtral import MixtralForCausalLM
    from pagedllm.model.sharding import TensorParallelShard

    folder, _ = tiny_mixtral
    config, state = load_hf_weights(folder)
    assert config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.sliding_window == 8 and config.intermediate_size == 128
    shard = TensorParallelShard.for_rank(config, 1, 2)
    assert shard.expert_intermediate == (64, 128)
    ex = "model.layers.0.block_sparse_moe.experts.3."
    assert shard.weight_slice(ex + "w1.weight", 16) == (0, 64, 128)
    assert shard.weight_slice(ex + "w3.weight", 16) == (0, 64, 128)
    assert shard.weight_slice(ex + "w2.weight", 16) == (1, 64, 128)
    assert shard.weight_slice("model.layers.0.block_sparse_moe.gate.weight", 16) is None
    odd = dataclasses.replace(config, moe_intermediate_size=36)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TensorParallelShard.for_rank(odd, 0, 8)
    from pagedllm.attention import get_attention_backend

    model = MixtralForCausalLM(config, torch.float32, get_attention_backend("reference", "cpu"))
    missing = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    del state[missing]
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        model.load_weights(state)


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2-moe")
    return folder, build_tiny_hf_model("qwen2_moe", folder)


def test_qwen2_moe_block_with_shared_expert_equals_transformers(tiny_qwen2_moe):
    """Qwen2-MoE's block (routed experts + the shared expert scaled by its sigmoid gate, packed
    on the CPU) gives transformers' output; the per-token loop adds the shared expert too."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.layers.moe import SharedExpertMoeBlock

    folder, hf = tiny_qwen2_moe
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    blocks = _moe_blocks(llm.engine.executor.worker.model)
    assert [i for i, _ in blocks] == [0]  # mlp_only_layers=[1]
    block = blocks[0][1]
    assert isinstance(block, SharedExpertMoeBlock)
    x = torch.randn(13, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(x[None])[0]
        gate = torch.sigmoid(hf.model.layers[0].mlp.shared_expert_gate(x))
    assert float(gate.min()) > 0.05 and float(gate.max()) < 0.95  # the gate does scale
    torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block.forward_per_token(x), ref, atol=1e-5, rtol=1e-5)
    out = block(x, residual=torch.ones_like(x))
    torch.testing.assert_close(out, ref + 1, atol=1e-5, rtol=1e-5)


def test_qwen2_moe_config_and_shared_expert_shards(tiny_qwen2_moe):
    """``qkv_bias`` and ``shared_expert_intermediate_size`` are read; tensor parallelism cuts the
    shared expert like a dense MLP (its gate whole) and refuses a width it cannot split;
    ``use_sliding_window`` without ``layer_types`` is refused, naming the field."""
    import dataclasses

    from pagedllm.model.loader import load_hf_weights
    from pagedllm.model.qwen2_moe import Qwen2MoeForCausalLM
    from pagedllm.model.sharding import TensorParallelShard

    folder, _ = tiny_qwen2_moe
    config, _ = load_hf_weights(folder)
    assert config.architecture == "Qwen2MoeForCausalLM"
    assert config.shared_expert_intermediate_size == 48 and config.moe_layers == [0]
    assert config.attention_bias and not config.o_proj_bias and not config.qk_norm
    assert config.norm_topk_prob is False and config.sliding_window is None
    shard = TensorParallelShard.for_rank(config, 1, 2)
    ex = "model.layers.0.mlp.shared_expert."
    assert shard.weight_slice(ex + "gate_proj.weight", 16) == (0, 24, 48)
    assert shard.weight_slice(ex + "up_proj.weight", 16) == (0, 24, 48)
    assert shard.weight_slice(ex + "down_proj.weight", 16) == (1, 24, 48)
    assert shard.weight_slice("model.layers.0.mlp.shared_expert_gate.weight", 16) is None
    assert shard.weight_slice("model.layers.1.mlp.gate_proj.weight", 16) == (0, 64, 128)
    odd = dataclasses.replace(config, shared_expert_intermediate_size=36)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        TensorParallelShard.for_rank(odd, 0, 8)
    base = {"num_hidden_layers": 2, "intermediate_size": 128, "num_experts": 4}
    fields = Qwen2MoeForCausalLM.hf_config_fields({**base, "qkv_bias": False})
    assert fields["attention_bias"] is False and fields["shared_expert_intermediate_size"] is None
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2MoeForCausalLM.hf_config_fields({**base, "use_sliding_window": True})


def test_qwen2_moe_sliding_window_equals_transformers(tmp_path):
    """``use_sliding_window`` with transformers' ``layer_types`` (layer 0 windowed, layer 1 full
    with ``max_window_layers`` 1): greedy tokens equal transformers' past the 8-token window."""
    from pagedllm.entrypoints.llm import LLM
    from tests.model.arch_utils import WINDOW, compare_to_reference, greedy_reference

    hf = build_tiny_hf_model(
        "qwen2_moe", tmp_path, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    config = llm.engine.model_config
    assert [config.layer_window(i) for i in range(2)] == [WINDOW, None]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    counted = 0
    for p, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, greedy_reference(hf, p, 12))
    assert counted >= 18
