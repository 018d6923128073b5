"""Pooling of final hidden states into one embedding per prompt (mean or last token).

The model runner returns, for every pooling sequence scheduled in a step, the final hidden
states (after the final norm) of the positions it computed: ``[n, H]``. A prompt may take several
steps (chunked prefill), so the sum and the last row are accumulated here, keyed by the chunk's
start position: a chunk starting at position 0 (a first step, or a recompute after preemption)
restarts the sums. Pooling requests never take prefix-cache hits (``Sequence.use_cached_prefix``
is False), so every position passes through here.

Mean pooling: ``e = (1 / L) * sum_t h_t`` over the ``L`` prompt positions; last-token pooling:
``e = h_{L-1}``; then ``e / ||e||_2`` when ``normalize`` (Sentence-BERT's mean pooling,
Reimers & Gurevych 2019, section 3; last-token pooling as in E5-Mistral, Wang et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.pooling_params import PoolingParams


@dataclass
class PoolingState:
    """The running pool of one prompt.

    Attributes:
        total: [H] float32 sum of the hidden states seen so far.
        last: [H] float32 the hidden state of the latest position seen.
        count: positions seen.
    """

    total: torch.Tensor
    last: torch.Tensor
    count: int


def accumulate(state: PoolingState | None, start_pos: int, hidden: torch.Tensor) -> PoolingState:
    """Add one step's hidden states ``hidden`` ([n, H], any float dtype) of positions
    ``start_pos .. start_pos + n - 1``; a chunk at position 0 starts a new pool.

    Raises:
        ValueError: a chunk that does not continue the pool (a position skipped or repeated).
    """
    h = hidden.to(torch.float32)
    if state is None or start_pos == 0:
        if start_pos != 0:
            raise ValueError(f"pooling needs every position: first chunk starts at {start_pos}")
        return PoolingState(h.sum(0), h[-1].clone(), h.shape[0])
    if start_pos != state.count:
        raise ValueError(f"pooling chunk at {start_pos} does not continue {state.count} positions")
    return PoolingState(state.total + h.sum(0), h[-1].clone(), state.count + h.shape[0])


def pooled_embedding(state: PoolingState, params: PoolingParams) -> list[float]:
    """The embedding of a complete pool: mean or last, L2-normalized when asked.

    Returns:
        ``H`` floats (a Python list, ready for the API).
    """
    e = state.total / state.count if params.pooling_type == "mean" else state.last
    if params.normalize:
        e = torch.nn.functional.normalize(e, p=2.0, dim=0)
    return [float(x) for x in e.tolist()]
