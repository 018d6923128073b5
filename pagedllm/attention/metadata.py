"""Attention metadata: how the flat token batch maps onto sequences and KV-cache slots."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Per-step description of the batch, passed explicitly to every attention layer.

    The batch is flat: the new tokens of all scheduled sequences are concatenated, sequences
    whose query is a single token (decodes) first, then the multi-token ones (prefills or prefill
    chunks). ``T`` = total new tokens, ``S`` = sequences.

    The tensors are int64 and live on the engine's device (the one the KV cache is on: the
    ``ModelRunner`` builds them on the host and copies them there once per step); the ``*_list``
    fields are the same values as Python ints on the host.

    Attributes:
        slot_mapping: [T] int64, KV-cache slot of each new token
            (``block_table[pos // block_size] * block_size + pos % block_size``); a negative slot
            is skipped by the Triton and C++ writers.
        block_tables: [S, max_blocks] int64, contiguous, physical block ids per sequence, padded
            with 0 (block 0 is a real block: kernels read only the first ``seq_lens[i]`` tokens).
        seq_lens: [S] int64, tokens of context per sequence after this step (cached + new).
        query_start_loc: [S + 1] int64, offsets of each sequence's new tokens in the flat batch
            (``cu_seqlens_q``).
        seq_lens_list / query_lens_list / query_start_loc_list: the same values as Python ints
            (for loops on the host without a device -> host copy per layer).
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
        block_size: tokens per KV block.
        prompt_lens_list: [S] prompt length of each sequence, for the RoPE types whose
            frequencies depend on the length (``layers.rope_scaling.frequency_length``); None
            (as where a caller builds metadata without them): each sequence's length after the
            step stands in.
        backend_cache: scratch space for a backend's per-step precomputation (filled by the
            first layer, reused by the others).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_list: list[int]
    query_lens_list: list[int]
    query_start_loc_list: list[int]
    num_decodes: int
    block_size: int
    prompt_lens_list: list[int] | None = None
    # Per-step values a backend derives once and reuses in every layer (index lists, masks).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def device(self) -> torch.device:
        """The device of the index tensors."""
        return self.slot_mapping.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionMetadata:
        """A copy with the four index tensors on ``device`` (the same object when they already
        are there); ``backend_cache`` starts empty. ``non_blocking`` as in ``Tensor.to`` (only
        asynchronous from pinned host memory)."""
        dev = torch.device(device)
        if self.device == dev:
            return self
        return dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping.to(dev, non_blocking=non_blocking),
            block_tables=self.block_tables.to(dev, non_blocking=non_blocking),
            seq_lens=self.seq_lens.to(dev, non_blocking=non_blocking),
            query_start_loc=self.query_start_loc.to(dev, non_blocking=non_blocking),
            backend_cache={},
        )
