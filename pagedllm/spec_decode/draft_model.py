"""The draft-model proposer: a small model that shares the target's tokenizer proposes ``k``
tokens per sequence and step by running ``k`` autoregressive steps of its own (Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding", section 2; Chen et al. 2023,
algorithm 2).

Its KV cache is paged and mirrors the target's (``docs/spec_decode.md``, "Draft model"):

* The draft has its own KV tensors (a second ``CacheEngine``, with as many device and swap blocks
  as the target) indexed by the *target's* block ids. Every block the block manager hands out
  therefore holds the target's K/V in the target cache and the draft's K/V in the draft cache, so
  allocation, copy-on-write, rollback, free, swap and prefix sharing of a sequence apply to both
  with no second block manager. The engine splits its KV byte budget between the two by their
  per-token KV bytes (``draft_kv_split``).
* The draft's block moves are the target's: each step the scheduler's swap-out / swap-in /
  copy-on-write pairs are applied to the draft cache too, before the draft runs.
* Which positions of a sequence hold valid draft K/V is tracked per sequence (``_computed``): it
  drops to the sequence's computed tokens when the target rolls back rejected proposals, and to 0
  when the sequence is preempted by recompute (its blocks were freed). The next draft run first
  prefills what the draft lacks ("catch up"), then decodes its proposals.

Proposals are made *after* scheduling: ``propose`` only reserves ``k`` placeholder tokens (the
scheduler needs the count to plan ``1 + k`` slots and may drop them when the pool is short);
``after_schedule`` then runs the draft on the block tables the scheduler just allocated and
writes the real tokens into the step's work, so the draft's K/V for positions ``L - 1 .. L + k -
2`` goes into slots the target also owns. Greedy requests propose the draft's argmax; sampled ones
draw from the draft's processed distribution ``q`` with the request's own counter-seeded stream and
keep ``q`` (``draft_probs``) for rejection sampling (``spec_decode.draft_verify``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.sampling.by_request import by_request
from pagedllm.sampling.sampler import Sampler, SamplingBatch
from pagedllm.sampling_params import SamplingType

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.model.loader import LoadedModel
    from pagedllm.sequence import Sequence as Seq
    from pagedllm.sequence import SequenceGroup
    from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

#: Stand-in token of a reserved proposal until ``after_schedule`` writes the draft's token.
PLACEHOLDER_TOKEN = 0


def load_draft_model(config: EngineConfig, target: LoadedModel) -> LoadedModel:
    """Load (or take) ``config.speculative.model`` and check that it can draft for ``target``.

    Raises:
        ValueError: naming ``speculative_config.model`` when the draft's vocabulary size or
            tokenizer differs from the target's or its learned position table is shorter than
            ``max_model_len``, or the path it names does not exist (nor is it a bundled
            model's name); naming ``speculative_config.method`` under tensor / pipeline
            parallelism (the draft runs in the driver, one rank).
    """
    from pagedllm.model.loader import LoadedModel, load_model

    spec = config.speculative
    assert spec is not None and spec.method == "draft_model"
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ValueError(
            "speculative_config.method 'draft_model' needs tensor_parallel_size and "
            "pipeline_parallel_size 1"
        )
    model = spec.model
    try:
        draft = model if isinstance(model, LoadedModel) else load_model(model, config.torch_dtype)
    except FileNotFoundError as e:
        raise ValueError(f"speculative_config.model: {e}") from e
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config.model must share the target's tokenizer: its vocab_size is "
            f"{draft.config.vocab_size}, the target's {target.config.vocab_size}"
        )
    if draft.tokenizer is not target.tokenizer and (
        draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
    ):
        raise ValueError(
            "speculative_config.model must share the target's tokenizer: the vocabularies "
            "differ (token -> id maps)"
        )
    dc = draft.config
    if (
        dc.position_offset is not None
        and config.max_model_len is not None
        and config.max_model_len > dc.max_position_embeddings
    ):
        raise ValueError(
            f"speculative_config.model has learned positions up to {dc.max_position_embeddings}, "
            f"fewer than max_model_len ({config.max_model_len})"
        )
    return draft


def draft_kv_split(kv_cache_memory: int, target_block_bytes: int, draft_block_bytes: int) -> int:
    """The target's share of ``kv_cache_memory`` (bytes) when a draft mirrors its blocks.

    Both caches hold the same number of blocks, so the budget is split in proportion to the
    bytes of one block of each: ``num_blocks = kv_cache_memory // (target + draft)``.
    """
    return kv_cache_memory * target_block_bytes // (target_block_bytes + draft_block_bytes)


class DraftModelProposer:
    """Proposes with a draft model whose paged KV cache mirrors the target's block ids.

    Args:
        worker: the draft's worker (its model and a ``CacheEngine`` with the target's
            ``num_blocks`` / ``num_swap_blocks`` / ``block_size``), in this process.
        sampler: the target's sampler (the draft's logits are cut to its vocabulary).
        eos_token_ids: the model's EOS ids (``min_tokens`` masking while drafting).

    Attributes:
        draft_probs: seq_id -> [k, V] float32 draft distributions ``q`` of the current step's
            proposals, for sampled (non-greedy) sequences only.
        failed: seq_ids whose draft sampling raised in the current step (placeholder drafts,
            no ``q``; see :meth:`_sample`).
    """

    def __init__(self, worker: Worker, sampler: Sampler, eos_token_ids: list[int]) -> None:
        self.worker = worker
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.draft_probs: dict[int, torch.Tensor] = {}
        self.failed: set[int] = set()  # seq_ids whose draft sampling raised this step
        self._computed: dict[int, int] = {}  # seq_id -> positions with valid draft K/V
        self._request_of: dict[int, str] = {}  # seq_id -> request id

    # ---- Proposer interface ----------------------------------------------------------------
    def propose(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> list[int]:
        """Reserve ``k`` proposals; the draft fills them in after scheduling."""
        return [PLACEHOLDER_TOKEN] * k

    def on_request_finished(
        self, token_ids: Sequence[int], num_prompt_tokens: int, request_id: str
    ) -> None:
        """Forget the request's sequences (their blocks are freed with the target's)."""
        for seq_id in [s for s, r in self._request_of.items() if r == request_id]:
            self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)
        self._request_of.pop(seq_id, None)
        self.draft_probs.pop(seq_id, None)

    # ---- after scheduling ------------------------------------------------------------------
    def after_schedule(
        self, sched: SchedulerOutput, seqs: dict[int, tuple[Seq, SequenceGroup]]
    ) -> None:
        """Mirror the step's block moves in the draft cache, then draft the reserved proposals
        of every scheduled sequence (``work.token_ids[-num_spec_tokens:]`` are overwritten)."""
        cache = self.worker.cache
        cache.swap_out(sched.blocks_to_swap_out)
        cache.swap_in(sched.blocks_to_swap_in)
        cache.copy_blocks(sched.blocks_to_copy)
        preempted = set(sched.preempted)  # by recompute: their blocks were freed
        for seq_id in [s for s, r in self._request_of.items() if r in preempted]:
            self._computed.pop(seq_id, None)
        self.draft_probs.clear()
        self.failed.clear()
        spec = [(rid, w) for rid, w in sched.scheduled if w.num_spec_tokens > 0]
        if spec:
            with torch.inference_mode():
                self._draft(spec, seqs)

    def _draft(
        self,
        spec: list[tuple[str, ScheduledSequence]],
        seqs: dict[int, tuple[Seq, SequenceGroup]],
    ) -> None:
        """Run ``max k`` draft steps over the speculating sequences (step 0 also prefills what
        the draft lacks of each sequence) and write the proposals into their work."""
        drafts: dict[int, list[int]] = {w.seq_id: [] for _, w in spec}
        probs: dict[int, list[torch.Tensor]] = {w.seq_id: [] for _, w in spec}
        k_max = max(w.num_spec_tokens for _, w in spec)
        for j in range(k_max):
            works: list[tuple[str, ScheduledSequence]] = []
            for rid, w in spec:
                if w.num_spec_tokens <= j:
                    continue
                seq = seqs[w.seq_id][0]
                last = w.start_pos  # position of the sequence's last real token (L - 1)
                if j == 0:
                    self._request_of[w.seq_id] = rid
                    done = min(self._computed.get(w.seq_id, 0), last)
                    token_ids, start = seq.token_ids[done : last + 1], done
                else:
                    token_ids, start = [drafts[w.seq_id][-1]], last + j
                works.append((rid, ScheduledSequence(
                    seq_id=w.seq_id, token_ids=token_ids, start_pos=start,
                    block_table=w.block_table, do_sample=True,
                    num_prompt_tokens=w.num_prompt_tokens,
                )))  # fmt: skip
            result = self.worker.runner.execute(SchedulerOutput(scheduled=works))
            self._sample(result.sample_seq_ids, result.logits, seqs, drafts, probs)
        for _, w in spec:
            k = w.num_spec_tokens
            w.token_ids[-k:] = drafts[w.seq_id]
            self._computed[w.seq_id] = w.start_pos + k  # positions 0 .. L + k - 2
            if probs[w.seq_id] and w.seq_id not in self.failed:
                self.draft_probs[w.seq_id] = torch.stack(probs[w.seq_id])

    def _sample(
        self,
        seq_ids: list[int],
        logits: torch.Tensor,
        seqs: dict[int, tuple[Seq, SequenceGroup]],
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """One draft token per row of ``logits`` ([len(seq_ids), V]): the ordinary sampler with
        the request's parameters and seed at the token's own output position (so a draft token
        follows ``q`` exactly); ``q`` itself is kept for sampled rows.

        A request whose rows raise (:func:`~pagedllm.sampling.by_request.by_request`) drafts
        ``PLACEHOLDER_TOKEN`` for the rest of the step, without ``q`` (:attr:`failed`; not
        sampled again until the next step): its verification compares the target's own samples
        with them, which is exact for any sampling, and its own error, if the target's sampler
        raises too, fails the request there. The other requests draft what they would alone."""
        live_ids = [seq_id for seq_id in seq_ids if seq_id not in self.failed]
        if len(live_ids) < len(seq_ids):
            live = [i for i, seq_id in enumerate(seq_ids) if seq_id not in self.failed]
            logits = logits[torch.tensor(live, device=logits.device)]
        batch = SamplingBatch([], [], [], [], self.eos_token_ids)
        groups: list[SequenceGroup] = []
        for seq_id in live_ids:
            seq, group = seqs[seq_id]
            groups.append(group)
            batch.params.append(group.sampling_params)
            batch.seeds.append(seq.seed)
            batch.output_token_ids.append(seq.output_token_ids + drafts[seq_id])
            batch.prompt_token_ids.append(seq.prompt_token_ids)

        def fail(group: SequenceGroup, exc: Exception) -> None:
            logger.warning("draft sampling failed for request %s: %r", group.request_id, exc)
            self.failed.update(s.seq_id for s in group.seqs)

        if live_ids:
            for rows, (tokens, q) in by_request(self._sample_rows, logits, batch, groups, fail):
                ids = live_ids if rows is None else [live_ids[i] for i in rows]
                for j, seq_id in enumerate(ids):
                    drafts[seq_id].append(tokens[j])
                    if j in q:
                        probs[seq_id].append(q[j])
        for seq_id in seq_ids:
            if seq_id in self.failed:  # now or at an earlier draft step of this step
                drafts[seq_id].append(PLACEHOLDER_TOKEN)

    def _sample_rows(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], dict[int, torch.Tensor]]:
        """The sampled token of every row, and ``q`` ([V] float32) of each sampled row by row."""
        out = self.sampler(logits, batch)
        sampled = [
            i for i, p in enumerate(batch.params) if p.sampling_type != SamplingType.GREEDY
        ]
        q: dict[int, torch.Tensor] = {}
        if sampled:
            sub = batch.select(sampled)
            rows = self.sampler.probs(logits[torch.tensor(sampled, device=logits.device)], sub)
            q = {i: rows[r] for r, i in enumerate(sampled)}
        return list(out.sampled_token_ids), q


def build_draft_worker(
    config: EngineConfig, draft: LoadedModel, num_blocks: int, num_swap_blocks: int
) -> Worker:
    """The draft's worker in this process: its model and a KV cache of the target's shape in
    blocks (``num_blocks`` device, ``num_swap_blocks`` host), on ``config.device``."""
    from pagedllm.worker.worker import Worker

    assert config.max_model_len is not None
    kwargs: dict[str, Any] = {}
    if config.num_threads:
        kwargs["num_threads"] = config.num_threads
    return Worker(
        draft.config,
        draft.state_dict,
        config.torch_dtype,
        num_blocks,
        config.block_size,
        config.max_model_len,
        attention_backend=config.attention_backend,
        num_swap_blocks=num_swap_blocks,
        device=config.device,
        kv_cache_dtype=config.torch_kv_cache_dtype,
        **kwargs,
    )
