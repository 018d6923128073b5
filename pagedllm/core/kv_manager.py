"""The KV-memory manager interface: what the scheduler and the engine call on the KV pool.

Two implementations satisfy ``KVManager``:

- ``core.block_manager.BlockManager``: the paper's paged manager (block tables, sharing by
  reference count, copy-on-write, prefix caching, swapping; sections 4.2-4.5);
- ``core.contiguous_kv_manager.ContiguousKVManager``: the re-implemented Orca baselines of section
  6.1 (one contiguous reservation per request; no sharing, prefix caching or swapping).

``create_kv_manager`` picks one by ``EngineConfig.kv_manager``, so nothing else branches on the
manager's kind: what differs (admission limits, the figure 2 waste breakdown) sits behind methods.

Units: blocks are physical block ids (ints, ``0 .. num_blocks - 1``); one block holds the K/V of
``block_size`` tokens; a "slot" is one token's K/V in a block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.kv_waste import KVWaste
    from pagedllm.core.prefix_cache import PrefixCache
    from pagedllm.sequence import Sequence


class ContextLengthExceededError(ValueError):
    """The prompt (plus ``max_tokens``) does not fit in ``max_model_len`` or in the KV pool.

    Attributes:
        param: the request field to blame ("prompt" or "max_tokens").
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# A block-table entry whose block went back to the pool because it lies wholly before the
# sliding window of every query still to come (``BlockManager`` with ``sliding_window``). The
# table keeps its length, so positions and slot mapping are unchanged; kernels never read it.
FREED_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the blocks of ``b`` tokens that hold ``a`` tokens."""
    return -(-a // b)


def rollback_computed(seq: Sequence, num_tokens: int) -> None:
    """Lower ``seq.num_computed_tokens`` by ``num_tokens`` (the KV managers' ``rollback_slots``).

    Raises:
        ValueError: naming ``num_tokens`` when negative or more than the tokens computed.
    """
    if not 0 <= num_tokens <= seq.num_computed_tokens:
        raise ValueError(f"num_tokens must be in [0, {seq.num_computed_tokens}], got {num_tokens}")
    seq.num_computed_tokens -= num_tokens


def check_pool_fits(
    num_blocks: int,
    block_size: int,
    prompt_len: int,
    max_tokens: int,
    num_samples: int,
    samples_field: str = "n",
    min_output_tokens: int = 1,
) -> None:
    """Refuse a request that could never make progress in the whole pool.

    One sample must fit at its longest: ``cdiv(prompt_len + max_tokens, block_size)`` blocks.
    Several samples are admitted when each can hold its prompt and ``min_output_tokens``,
    sharing the prompt's full blocks (paper figure 8): more does not have to fit at once, since a
    group that later cannot grow even alone in the pool is finished by length (the scheduler).

    Args:
        samples_field: the request field to blame for too many samples ("n" or "best_of").
        min_output_tokens: output tokens every sample must have room for at once (beams pass
            ``max_tokens``: a beam search is never cut short by the pool).

    Raises:
        ContextLengthExceededError: (param "prompt") when the prompt and, unless ``max_tokens``
            is 0 (a pooling request), one output token do not fit; (param "max_tokens") when
            one sample does not fit; (param ``samples_field``) when the samples' prompts and
            first tokens do not.
    """
    min_output_tokens = min(min_output_tokens, max_tokens)  # max_tokens 0 generates nothing
    if cdiv(prompt_len + min(1, max_tokens), block_size) > num_blocks:
        first = " and a first output token" if max_tokens else ""
        raise ContextLengthExceededError(
            f"prompt: a prompt of {prompt_len} tokens{first} needs more KV blocks than the "
            f"whole pool ({num_blocks} blocks of {block_size} tokens)",
            "prompt",
        )
    total = prompt_len + max_tokens
    if cdiv(total, block_size) > num_blocks:
        raise ContextLengthExceededError(
            f"max_tokens: a sample of up to {total} tokens needs more KV blocks than the whole "
            f"pool ({num_blocks} blocks of {block_size} tokens)",
            "max_tokens",
        )
    per_seq = cdiv(prompt_len + min_output_tokens, block_size)
    need = per_seq + (num_samples - 1) * (per_seq - prompt_len // block_size)
    if need > num_blocks:
        raise ContextLengthExceededError(
            f"{samples_field}: the request's {num_samples} samples need at least {need} KV "
            f"blocks (a prompt of {prompt_len} tokens shared, {min_output_tokens} output "
            f"token(s) each), more than the whole pool ({num_blocks} blocks of {block_size} "
            "tokens)",
            samples_field,
        )


@runtime_checkable
class KVManager(Protocol):
    """What the scheduler, the engine and the KV dashboard use of a KV-memory manager.

    Attributes:
        block_size: tokens per block.
        num_blocks: physical blocks in the device pool.
        num_swap_blocks: blocks of host swap space (0: this manager never swaps).
        block_tables: seq_id -> physical block ids of its logical blocks, for every sequence
            holding device blocks (the tables the kernels read; paper figure 6).
        swapped_tables: seq_id -> host block ids, for swapped-out sequences.
        prefix_cache: the content-addressed cache of full blocks, or None without prefix caching.
    """

    block_size: int
    num_blocks: int
    num_swap_blocks: int
    block_tables: dict[int, list[int]]
    swapped_tables: dict[int, list[int]]
    prefix_cache: PrefixCache | None

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Device blocks no sequence owns."""
        ...

    @property
    def num_used_blocks(self) -> int:
        """Device blocks some sequence owns (a shared block counts once)."""
        ...

    def usage(self) -> float:
        """Fraction of the device pool owned by sequences, 0..1."""
        ...

    def ref_counts(self) -> list[int]:
        """Per device block (index = block id) the number of owners (for the dashboard)."""
        ...

    def swap_ref_counts(self) -> list[int] | None:
        """Per host swap block the number of owners; None when there is no swap space."""
        ...

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The physical blocks the kernels read for ``seq`` this step."""
        ...

    def check_request_fits(
        self, prompt_len: int, max_tokens: int, num_samples: int, use_beam_search: bool,
        samples_field: str = "n",
    ) -> None:
        """Admission check of a new request against what this manager can ever hold.

        Args:
            prompt_len: prompt tokens.
            max_tokens: the request's effective output-token limit.
            num_samples: ``max(n, best_of)`` sequences the request will run.
            use_beam_search: whether its sequences are beams (they share blocks).
            samples_field: the field that asked for ``num_samples`` ("n" or "best_of").

        Raises:
            ContextLengthExceededError: (param "max_tokens") when one sequence could never fit;
                (param ``samples_field``) when its sequences' prompts could never fit together.
            ValueError: (message starting with ``samples_field``) when the manager cannot
                share blocks and the request needs several sequences.
        """
        ...

    def waste(self, holders: list[Sequence], waiting_head: Sequence | None) -> KVWaste:
        """The paper's figure 2 breakdown of the KV memory now (see ``core.kv_waste``).

        Args:
            holders: the sequences holding device blocks.
            waiting_head: the first waiting sequence, or None (for stranded free memory).
        """
        ...

    # ---- admission ---------------------------------------------------------------------------
    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Device blocks holding the longest cached prefix of ``seq`` (prefix caching)."""
        ...

    def group_shared_blocks(self, seqs: list[Sequence]) -> int:
        """Full prompt blocks the sequences of a readmitted group can share."""
        ...

    def can_allocate(self, seqs: list[Sequence], watermark: bool = True) -> bool:
        """Whether a waiting group (no blocks yet) can be admitted now."""
        ...

    def first_chunk_room(self, seqs: list[Sequence]) -> int:
        """New blocks the first chunk of a waiting group's lead may take now, the group
        recomputed chunk by chunk with a sliding window (0: none fit, or no window, so whole
        sequences must fit: ``can_allocate``)."""
        ...

    def allocate_prefix(self, seq: Sequence) -> int:
        """Admit a waiting sequence; returns the tokens already cached for it."""
        ...

    def can_share_prefix(self, lead: Sequence, num_blocks: int) -> bool:
        """Whether ``lead`` still holds the first ``num_blocks`` blocks another would read."""
        ...

    def share_prefix(self, lead: Sequence, other: Sequence, num_blocks: int) -> int:
        """Point ``other`` at ``lead``'s first ``num_blocks`` blocks; returns their tokens."""
        ...

    # ---- growth ------------------------------------------------------------------------------
    def num_blocks_needed(self, plan: list[tuple[Sequence, int]]) -> int:
        """Blocks ``allocate_slots`` takes for every (sequence, new tokens) of ``plan`` in order,
        a copy-on-write counted once per copy actually made."""
        ...

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``num_new_tokens`` more tokens; returns (src, dst) copy-on-write pairs.

        Raises:
            NoFreeBlocksError: when the pool (or the reservation) is too small.
        """
        ...

    def rollback_slots(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Un-compute ``seq``'s last ``num_tokens`` tokens (rejected speculative tokens); returns
        the blocks given back to the pool."""
        ...

    def mark_computed(self, seq: Sequence) -> None:
        """After a step: register ``seq``'s newly full blocks (prefix caching)."""
        ...

    # ---- sharing and release -----------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (paper figure 8).

        Raises:
            ValueError: when the manager cannot share blocks.
        """
        ...

    def free(self, seq: Sequence) -> None:
        """Release every block ``seq`` holds (device and swap)."""
        ...

    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes no sequence holds; returns the blocks dropped."""
        ...

    # ---- swapping (paper section 4.5) --------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """Whether the host pool can take the group's blocks (False: preempt by recompute)."""
        ...

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the group's blocks to host memory; returns (device, host) block pairs."""
        ...

    def can_swap_in(self, seqs: list[Sequence], reserve: bool = True) -> bool:
        """Whether the device pool can take a swapped group back."""
        ...

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns (host, device) block pairs."""
        ...

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the manager's bookkeeping is consistent.

        Raises:
            AssertionError: describing the first violation.
        """
        ...


def uniform_sliding_window(layer_windows: list[int | None]) -> int | None:
    """The window shared by every layer when all layers are windowed (Mistral), else None.

    Only then can a sequence's old blocks be freed: one full-attention layer (Gemma 2 / 3 global
    layers) needs every token, and all layers share one block table (docs/sliding_window.md).
    """
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(w for w in layer_windows if w is not None)


def create_kv_manager(
    config: EngineConfig,
    num_blocks: int,
    num_swap_blocks: int,
    max_model_len: int,
    sliding_window: int | None = None,
) -> KVManager:
    """The KV manager ``config.kv_manager`` names.

    Args:
        config: engine options (``kv_manager``, ``block_size``, ``enable_prefix_caching``).
        num_blocks: physical blocks in the device pool.
        num_swap_blocks: host swap blocks offered (the Orca baselines take none: read the
            manager's ``num_swap_blocks`` for what it uses).
        max_model_len: longest sequence in tokens.
        sliding_window: every layer's window when all layers are windowed (see
            ``uniform_sliding_window``): the paged manager then frees blocks before the window.

    Raises:
        ValueError: naming ``kv_manager`` when unknown; see the managers' own errors.
    """
    # Imported here: both managers import this module (the error and the helpers above).
    from pagedllm.core.block_manager import BlockManager
    from pagedllm.core.contiguous_kv_manager import ORCA_POLICIES, ContiguousKVManager

    if config.kv_manager == "paged":
        return BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_swap_blocks=num_swap_blocks,
            sliding_window=sliding_window,
        )
    if config.kv_manager in ORCA_POLICIES:
        return ContiguousKVManager(num_blocks, config.block_size, config.kv_manager, max_model_len)
    raise ValueError(
        f"kv_manager must be 'paged' or one of {ORCA_POLICIES}, got {config.kv_manager!r}"
    )
