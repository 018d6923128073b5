"""Linear layers of a decoder block, with optional bias, plain or tensor-parallel.

Megatron-LM sharding (Shoeybi et al. 2019, section 3): the first linear of a block is
column-parallel (a plain ``nn.Linear`` over this rank's output rows, no communication), the
second row-parallel (``RowParallelLinear``: an all-reduce of the partial sums). On the CPU in
float32 the plain ones are later replaced by prepacked ones (``model.packed_linear``), bias
included.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers.parallel import RowParallelLinear

_M = TypeVar("_M", bound=nn.Module)


def uninitialized(cls: type[_M], *args: Any, **kwargs: Any) -> _M:
    """``cls(*args, **kwargs)`` for a linear layer, without its random weight init
    (``torch.nn.utils.skip_init``): every weight is overwritten by ``load_weights``, and drawing
    the random numbers cost ~1 s of SmolLM2-135M's start-up. The weight goes to the current
    default device (``with torch.device(...)``, as the worker builds the model), like every other
    tensor the model allocates, not to skip_init's default, the CPU."""
    kwargs.setdefault("device", torch.get_default_device())
    return nn.utils.skip_init(cls, *args, **kwargs)


def column_linear(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False
) -> nn.Linear:
    """The first linear of a block (fused QKV, fused gate/up): ``out_features`` are this rank's
    output rows, so tensor parallelism needs no communication here.

    Returns:
        an uninitialized ``nn.Linear`` (weight [out, in], bias [out] when ``bias``).
    """
    return uninitialized(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)


def row_linear(
    in_features: int,
    out_features: int,
    group: TensorParallelGroup | None,
    dtype: torch.dtype,
    bias: bool = False,
) -> nn.Linear:
    """The second linear of a block (o_proj, down_proj): row-parallel (all-reduce) under tensor
    parallelism, a plain ``nn.Linear`` without a group. ``in_features`` is this rank's share."""
    if group is None:
        return uninitialized(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)
    return uninitialized(RowParallelLinear, in_features, out_features, group, dtype, bias=bias)
