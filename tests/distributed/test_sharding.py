"""Megatron-style sharding rules: slice shapes per rank, KV-head replication, vocab-parallel
embedding and LM head equal the full ones (no processes: partial results are summed by hand)."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import EngineConfig
from pagedllm.model.config import LlamaArchConfig
from pagedllm.model.parallel_layers import VocabParallelEmbedding
from pagedllm.model.sharding import TensorParallelShard, shard_state_dict
from tests.conftest import make_random_state_dict, make_tiny_config


def cfg(**over) -> LlamaArchConfig:
    return make_tiny_config(101, 0, **over)


class NoCommGroup:
    """A stand-in group whose all-reduce does nothing (the test adds the ranks up itself)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t):
        return t


@pytest.mark.parametrize(
    "heads,kv_heads,tp,expect_kv",
    [
        (4, 2, 2, [(0, 1), (1, 2)]),  # KV heads split
        (4, 4, 2, [(0, 2), (2, 4)]),
        (4, 1, 2, [(0, 1), (0, 1)]),  # MQA: the one KV head replicated
        (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # each KV head on two ranks
        (9, 3, 3, [(0, 1), (1, 2), (2, 3)]),  # SmolLM2-135M at tp 3
        (6, 3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_head_assignment(heads, kv_heads, tp, expect_kv):
    c = cfg(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=24 * tp)
    shards = [TensorParallelShard.for_rank(c, r, tp) for r in range(tp)]
    assert [s.kv_heads for s in shards] == expect_kv
    group = heads // kv_heads
    for s in shards:
        assert s.num_heads == heads // tp
        # every query head of the rank reads a KV head the rank holds, in the local GQA layout
        local_group = s.num_heads // s.num_kv_heads
        for i, j in enumerate(range(*s.q_heads)):
            assert j // group == s.kv_heads[0] + i // local_group


def test_weight_slice_shapes():
    c = cfg(num_attention_heads=4, num_key_value_heads=2)  # vocab 101: uneven vocab shards
    sd = make_random_state_dict(c)
    tp, d = 2, c.head_dim
    for r in range(tp):
        sh = TensorParallelShard.for_rank(c, r, tp)
        part = shard_state_dict(sd, sh, d)
        p = "model.layers.0."
        assert part[p + "self_attn.q_proj.weight"].shape == (2 * d, c.hidden_size)
        assert part[p + "self_attn.k_proj.weight"].shape == (1 * d, c.hidden_size)
        assert part[p + "self_attn.v_proj.weight"].shape == (1 * d, c.hidden_size)
        assert part[p + "self_attn.o_proj.weight"].shape == (c.hidden_size, 2 * d)
        assert part[p + "mlp.gate_proj.weight"].shape == (64, c.hidden_size)
        assert part[p + "mlp.up_proj.weight"].shape == (64, c.hidden_size)
        assert part[p + "mlp.down_proj.weight"].shape == (c.hidden_size, 64)
        assert part[p + "input_layernorm.weight"].shape == (c.hidden_size,)
        rows = 51 if r == 0 else 50
        assert part["model.embed_tokens.weight"].shape == (rows, c.hidden_size)
        assert part["lm_head.weight"].shape == (rows, c.hidden_size)
        # the slices tile the full weight
        lo = r * 2 * d
        assert torch.equal(
            part[p + "self_attn.q_proj.weight"], sd[p + "self_attn.q_proj.weight"][lo : lo + 2 * d]
        )
        assert torch.equal(
            part[p + "mlp.down_proj.weight"],
            sd[p + "mlp.down_proj.weight"][:, r * 64 : r * 64 + 64],
        )


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_embedding_and_lm_head_equal_full(tp):
    c = cfg(num_attention_heads=6, num_key_value_heads=1, intermediate_size=96)
    sd = make_random_state_dict(c)
    full_w = sd["model.embed_tokens.weight"]
    ids = torch.tensor([0, 5, 50, 51, 99, 100, 33, 67, 68])
    h_sum = torch.zeros(len(ids), c.hidden_size)
    logits_parts = []
    for r in range(tp):
        sh = TensorParallelShard.for_rank(c, r, tp)
        emb = VocabParallelEmbedding(
            sh.vocab_shard_size, sh.vocab, c.hidden_size, NoCommGroup(r, tp), torch.float32
        )
        rows = shard_state_dict(sd, sh, c.head_dim)["model.embed_tokens.weight"]
        emb.weight.data.zero_()
        emb.weight.data[: rows.shape[0]] = rows
        h_sum += emb(ids)  # the all-reduce, by hand
        logits_parts.append(F.linear(h_sum.new_ones(2, c.hidden_size), emb.weight))
    torch.testing.assert_close(h_sum, F.embedding(ids, full_w), rtol=0, atol=0)
    gathered = torch.cat(logits_parts, dim=-1)[:, : c.vocab_size]
    torch.testing.assert_close(
        gathered, F.linear(torch.ones(2, c.hidden_size), full_w), rtol=1e-6, atol=1e-5
    )


def test_bad_tensor_parallel_size_names_the_field():
    c = cfg(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TensorParallelShard.for_rank(c, 0, 3)  # 4 query heads over 3 ranks
    c6 = cfg(num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TensorParallelShard.for_rank(c6, 0, 3)  # 2 KV heads: neither split nor replicated
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="threads")
    assert EngineConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineConfig().distributed_executor_backend == "uni"


def test_cli_flags_reach_the_engine_config():
    import argparse

    from pagedllm.entrypoints.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--tensor-parallel-size", "3"]))
    assert kw["tensor_parallel_size"] == 3 and kw["distributed_executor_backend"] is None
    config = EngineConfig(**kw)
    assert config.distributed_executor_backend == "mp"
    kw = engine_kwargs(p.parse_args(["-tp", "2", "--distributed-executor-backend", "ray"]))
    assert EngineConfig(**kw).distributed_executor_backend == "ray"
