"""Row-parallel projections and the LM head's vocabulary shard on the own GEMM (tensor
parallelism): float32 partial sums through the all-reduce, one rounding after it, and every row
computed on its own, so a speculative verify pass of k + 1 rows gives each row the bits a
one-row decode gives (ATen's bfloat16 matmul does not: a new user saw greedy output differ
from speculation off under tp 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.model.layers.parallel import (
    PackedRowParallelLinear,
    RowParallelLinear,
    pack_row_parallel_layers,
    vocab_parallel_logits,
)
from pagedllm.model.packed_linear import PackedLinear, cpu_gemm_ops

DTYPES = [torch.float32, torch.bfloat16]


class OneRankGroup:
    """A tensor-parallel group of one rank that records what its collectives were given."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.reduced.append(t)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        self.reduced.append(t)
        return t


def own_gemm(cpu_ops, dtype):
    """The kernels when the own GEMM runs ``dtype``; skips naming the missing CPU flag."""
    if cpu_gemm_ops(cpu_ops, dtype) is None:
        pytest.skip(f"the own GEMM does not run {dtype} here (bfloat16 needs avx512_bf16, "
                    "which this CPU lacks in /proc/cpuinfo)")
    return cpu_ops


def row_parallel(dtype, bias: bool, in_features=96, out_features=80) -> RowParallelLinear:
    g = torch.Generator().manual_seed(5)
    layer = RowParallelLinear(in_features, out_features, OneRankGroup(), dtype, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=g) / 8)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=g))
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_partial_sums_reduce_in_float32_and_round_once(cpu_ops, dtype, bias):
    ops = own_gemm(cpu_ops, dtype)
    layer = row_parallel(dtype, bias)
    packed = PackedRowParallelLinear(layer, ops)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = packed(x)
    (reduced,) = packed.group.reduced
    assert reduced.dtype == torch.float32 and reduced.is_contiguous()
    want = PackedLinear(layer.weight, ops).forward_float32(x)
    if bias:
        want = want + layer.bias.float()
    assert y.dtype == dtype and torch.equal(y, want.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_row_count(cpu_ops, dtype):
    """The property speculation needs: row i of a k + 1-row pass equals row i alone."""
    ops = own_gemm(cpu_ops, dtype)
    packed = PackedRowParallelLinear(row_parallel(dtype, bias=True, in_features=576,
                                                  out_features=576), ops)
    g = torch.Generator().manual_seed(2)
    for rows in (2, 9, 17, 40):
        x = torch.randn(rows, 576, generator=g).to(dtype)
        y = packed(x)
        for i in range(rows):
            assert torch.equal(y[i : i + 1], packed(x[i : i + 1])), (rows, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocabulary_shard_logits_stay_float32(cpu_ops, dtype):
    ops = own_gemm(cpu_ops, dtype)
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(48, 64, generator=g) / 8).to(dtype)  # 48 rows: 45 real + padding
    h = torch.randn(5, 64, generator=g).to(dtype)
    packed = PackedLinear(weight, ops)
    logits = vocab_parallel_logits(h, weight, OneRankGroup(), 45, packed)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, packed.forward_float32(h)[:, :45])
    plain = vocab_parallel_logits(h, weight, OneRankGroup(), 45)  # no packed weight: ATen
    assert plain.dtype == dtype and plain.shape == (5, 45)


def test_only_exact_row_parallel_layers_are_packed(cpu_ops):
    ops = own_gemm(cpu_ops, torch.float32)

    class Subclass(RowParallelLinear):  # e.g. a quantized variant with its own forward
        pass

    model = nn.Module()
    model.o_proj = row_parallel(torch.float32, bias=False)
    model.sub = nn.Module()
    model.sub.down_proj = row_parallel(torch.float32, bias=True)
    model.other = Subclass(8, 8, OneRankGroup(), torch.float32)
    model.plain = nn.Linear(8, 8)
    assert pack_row_parallel_layers(model, ops) == 2
    assert type(model.o_proj) is PackedRowParallelLinear
    assert type(model.sub.down_proj) is PackedRowParallelLinear
    assert model.sub.down_proj.bias is not None
    assert type(model.other) is Subclass and type(model.plain) is nn.Linear
    assert pack_row_parallel_layers(nn.Sequential(row_parallel(torch.float32, False)), None) == 0
