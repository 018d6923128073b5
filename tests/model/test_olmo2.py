"""OLMo 2's own rules (``pagedllm/model/olmo2.py``): the full-width q/k norms under tensor
parallelism (weights cut with the heads, the mean square over every rank's heads, replicated key
heads included) and the options refused with an error naming them. Its tokens against
transformers are checked by ``test_architectures.py``."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layers.norm import RMSNorm, rms_norm_across_ranks
from pagedllm.model.olmo2 import Olmo2ForCausalLM
from pagedllm.model.sharding import TensorParallelShard

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _config(full_width: bool = True) -> ModelArchConfig:
    return ModelArchConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        architecture="Olmo2ForCausalLM", qk_norm=True, qk_norm_full_width=full_width,
    )  # fmt: skip


class _SummingGroup:
    """Stands in for a tensor-parallel group: ``all_reduce`` returns the sum of every rank's
    tensor, recorded by a first pass over the ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.parts: list[torch.Tensor] = []
        self.total: torch.Tensor | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.total is None:
            self.parts.append(t.clone())
            return t
        return self.total.clone()


@pytest.mark.parametrize("tp", [2, 4])  # tp 4 > 2 KV heads: each key head on two ranks
def test_full_width_qk_norm_across_ranks_equals_whole(tp):
    g = torch.Generator().manual_seed(0)
    t = 5
    q, k = (
        torch.randn(t, HEADS * HEAD_DIM, generator=g),
        torch.randn(t, KV_HEADS * HEAD_DIM, generator=g),
    )
    wq, wk = (
        torch.randn(HEADS * HEAD_DIM, generator=g),
        torch.randn(KV_HEADS * HEAD_DIM, generator=g),
    )
    whole_q, whole_k = (
        RMSNorm(q.shape[1], 1e-5, torch.float32),
        RMSNorm(k.shape[1], 1e-5, torch.float32),
    )
    whole_q.weight.copy_(wq)
    whole_k.weight.copy_(wk)
    config = _config()
    shards = [TensorParallelShard.for_rank(config, r, tp) for r in range(tp)]
    group = _SummingGroup(tp)

    def run_rank(shard: TensorParallelShard) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        parts = []
        for full, w, name in ((q, wq, "q_norm"), (k, wk, "k_norm")):
            cut = shard.weight_slice(f"model.layers.0.self_attn.{name}.weight", HEAD_DIM)
            assert cut is not None and cut[0] == 0
            norm = RMSNorm(cut[2] - cut[1], 1e-5, torch.float32)
            norm.weight.copy_(w[cut[1] : cut[2]])
            parts.append((norm, full[:, cut[1] : cut[2]], cut))
        outs = rms_norm_across_ranks([p[0] for p in parts], [p[1] for p in parts], group)
        return [(o, p[2]) for o, p in zip(outs, parts, strict=True)]

    for shard in shards:  # first pass: every rank's sums of squares
        run_rank(shard)
    group.total = torch.stack(group.parts).sum(0)
    ref_q, ref_k = whole_q(q), whole_k(k)
    for shard in shards:
        (oq, cq), (ok, ck) = run_rank(shard)
        torch.testing.assert_close(oq, ref_q[:, cq[1] : cq[2]], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ok, ref_k[:, ck[1] : ck[2]], atol=1e-6, rtol=1e-5)


def test_per_head_qk_norms_stay_whole():
    """Only full-width norms are cut: Qwen3 / Gemma 3's per-head ones are whole on every rank."""
    per_head = TensorParallelShard.for_rank(_config(full_width=False), 1, 2)
    full = TensorParallelShard.for_rank(_config(), 1, 2)
    name = "model.layers.0.self_attn.{}_norm.weight"
    assert per_head.weight_slice(name.format("q"), HEAD_DIM) is None
    assert full.weight_slice(name.format("q"), HEAD_DIM) == (0, 16, 32)
    assert full.weight_slice(name.format("k"), HEAD_DIM) == (0, 8, 16)


def test_refused_options_are_named():
    with pytest.raises(ValueError, match="clip_qkv"):
        Olmo2ForCausalLM.hf_config_fields({"clip_qkv": 8.0})
    assert Olmo2ForCausalLM.hf_config_fields({"attention_bias": True})["o_proj_bias"] is True
    meta = {"attention.sliding_window": 4096}
    with pytest.raises(ValueError, match="attention.sliding_window"):
        Olmo2ForCausalLM.gguf_config_fields(meta.get)
    assert Olmo2ForCausalLM.gguf_config_fields({}.get)["qk_norm_full_width"] is True
