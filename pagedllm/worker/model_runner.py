"""SchedulerOutput -> flat input tensors -> forward -> logits of the sampled positions."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.distributed import PipelineGroup
from pagedllm.model.decoder import DecoderForCausalLM
from pagedllm.worker.pipeline_stage import (
    MicroBatch,
    PipelineStats,
    run_pipeline,
    split_micro_batches,
)


@dataclass
class ModelRunnerOutput:
    """Logits the driver needs to sample and to report prompt logprobs.

    Attributes:
        sample_seq_ids: sequences that sample this step, in ``logits`` row order.
        logits: [sum over sample_seq_ids of (1 + num_spec_tokens), V] float32, on the worker's
            device (the sampler works there; it uses its C++ helpers only for CPU logits): one
            row per sequence, or ``num_spec_tokens + 1`` consecutive rows for a sequence
            verifying speculative tokens (its last ``num_spec_tokens + 1`` positions).
        prompt_logits: seq_id -> [n, V] float32 logits (same device) at the step's prompt positions
            (row j predicts the token after position start_pos + j), for sequences that asked
            for prompt logprobs.
        hidden_states: seq_id -> [n, H] final hidden states (after the final norm, model
            dtype, same device) of the step's positions of pooling (embedding) sequences.
    """

    sample_seq_ids: list[int]
    logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


# Block-table entries up to which padding Python lists is cheaper than the buffer's scatter.
_SMALL_TABLES = 1024


class ModelRunner:
    """Turns a step's scheduled sequences into the model's flat batch.

    Batch order: single-token sequences (decodes) first, then multi-token ones, as
    ``AttentionMetadata`` requires. The per-step metadata (positions, slot mapping, padded block
    tables) is computed on the host from the sequences' lists; a large block-table matrix is
    written into a host buffer kept across steps (grown when a step needs more rows or columns)
    with whole-batch tensor ops. The step's tensors (input ids,
    positions, the four ``AttentionMetadata`` index tensors, the logits rows) are then copied to
    ``device`` once (on CPU the copy is a no-op: the same tensors are used).

    Args:
        model: the decoder, its weights on ``device``.
        kv_caches: per layer (key_cache, value_cache), each
            [num_kv_heads, num_blocks, block_size, head_dim] on ``device``.
        block_size: tokens per KV block.
        device: where the step's tensors go (the device of the weights and the KV cache).
        pipeline: this rank's pipeline links (``worker.pipeline_stage``); None = pp 1.
        micro_batches: micro-batches per step under pipeline parallelism
            (``pipeline_micro_batches``); None = the number of stages.

    Attributes:
        pipeline_stats: per-stage busy seconds and wall time (the driver's, under pp > 1).
    """

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device | str = "cpu",
        pipeline: PipelineGroup | None = None,
        micro_batches: int | None = None,
    ) -> None:
        self.model = model
        self.pipeline = pipeline
        self.micro_batches = micro_batches or (pipeline.num_stages if pipeline else 1)
        self.pipeline_stats = PipelineStats()
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self._tables = torch.zeros(0, dtype=torch.long)  # reused flat int64 host buffer

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Pad ``tables`` (one list of block ids per sequence) into [S, max_blocks] int64 with
        zeros: from padded lists when small, else in the reused buffer with one scatter instead
        of a loop over sequences."""
        n, width = len(tables), max(len(t) for t in tables)
        if n * width <= _SMALL_TABLES:  # a few sequences: padded lists, one tensor
            padded = [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables]
            return torch.tensor(padded, dtype=torch.long)
        lens = torch.tensor([len(t) for t in tables], dtype=torch.long)
        if n * width > self._tables.numel():
            self._tables = torch.zeros(max(n * width, 2 * self._tables.numel()), dtype=torch.long)
        out = self._tables[: n * width].view(n, width)  # contiguous, as the kernels want
        out.zero_()
        flat = torch.tensor(list(itertools.chain.from_iterable(tables)), dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(n), lens)
        starts = torch.cumsum(lens, 0) - lens
        col = torch.arange(flat.numel()) - starts[row]
        out[row, col] = flat
        # FREED_BLOCK (-1) entries (behind a sliding window; never read) become block 0 too, a
        # valid index for the backends that gather whole tables.
        out.clamp_(min=0)
        return out

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's forward; under pipeline parallelism in micro-batches
        (``pipeline_stage.run_pipeline``), whose outputs are put back in the step's order."""
        works = [w for _, w in sched.scheduled]
        # Decodes first (stable sort keeps FCFS order within each kind).
        works.sort(key=lambda w: len(w.token_ids) > 1)
        if self.pipeline is not None:
            return self._execute_pipeline(works)
        step = self._prepare(works, reuse_tables=True)
        batch = step.batch
        hidden = None
        if batch.pool_rows is not None:
            h = self.model.run_layers(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            logits = self.model.compute_logits(h, batch.logits_rows)
            with torch.inference_mode():
                hidden = self.model.norm(h[batch.pool_rows])
        else:
            logits = self.model(
                batch.input_ids, batch.positions, self.kv_caches, batch.meta, batch.logits_rows
            )
        return step.output(logits, hidden)

    def _execute_pipeline(self, works: list[ScheduledSequence]) -> ModelRunnerOutput:
        """Split ``works`` into micro-batches, pipeline them through the stages, and merge their
        outputs (sampled rows in ``works`` order, as one batch would give them)."""
        assert self.pipeline is not None
        ranges = split_micro_batches([len(w.token_ids) for w in works], self.micro_batches)
        # Each micro-batch keeps its own block-table matrix: all are prepared before the first
        # runs, so the reused buffer would be overwritten.
        steps = [self._prepare(works[r.start : r.stop], reuse_tables=False) for r in ranges]
        results = run_pipeline(
            self.model, self.pipeline, self.kv_caches, [s.batch for s in steps],
            self.pipeline_stats,
        )  # fmt: skip
        outs = [s.output(lg, hid) for s, (lg, hid) in zip(steps, results, strict=True)]
        return ModelRunnerOutput(
            [sid for o in outs for sid in o.sample_seq_ids],
            torch.cat([o.logits for o in outs]),
            {k: v for o in outs for k, v in o.prompt_logits.items()},
            {k: v for o in outs for k, v in o.hidden_states.items()},
        )

    def _prepare(self, works: list[ScheduledSequence], reuse_tables: bool) -> _PreparedStep:
        """The flat forward inputs of ``works`` (decodes first) and where each output row goes.

        Args:
            reuse_tables: pad the block tables into the buffer kept across steps (valid until
                the next ``_prepare``); False copies them out.
        """
        query_lens = [len(w.token_ids) for w in works]
        start_pos_list = [w.start_pos for w in works]
        seq_lens = [s + n for s, n in zip(start_pos_list, query_lens, strict=True)]
        num_decodes = query_lens.count(1)
        starts = [0, *itertools.accumulate(query_lens)]

        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(w.token_ids for w in works)), dtype=torch.long
        )
        q_start = torch.tensor(starts, dtype=torch.long)
        # Positions and slots from the lists: a few list operations per token beat a dozen
        # tensor ops per step at decode batch sizes, and are negligible next to a prefill.
        bs = self.block_size
        position_list: list[int] = []
        slot_list: list[int] = []
        for w, first, n in zip(works, start_pos_list, query_lens, strict=True):
            table, span = w.block_table, range(first, first + n)
            position_list.extend(span)
            slot_list.extend([table[p // bs] * bs + p % bs for p in span])
        positions = torch.tensor(position_list, dtype=torch.long)
        slot_mapping = torch.tensor(slot_list, dtype=torch.long)

        tables = self._block_tables([w.block_table for w in works])
        if not reuse_tables:
            tables = tables.clone()

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long).to(dev),
            query_start_loc=q_start.to(dev),
            seq_lens_list=seq_lens,
            query_lens_list=query_lens,
            query_start_loc_list=starts,
            num_decodes=num_decodes,
            block_size=bs,
            prompt_lens_list=[
                s if w.num_prompt_tokens is None else w.num_prompt_tokens
                for w, s in zip(works, seq_lens, strict=True)
            ],
        )

        # Rows whose logits are wanted: the last token of each sampling sequence (and the
        # positions before it that verify speculative tokens), then the prompt positions of
        # sequences asking for prompt logprobs.
        sample_rows = [
            r
            for i, w in enumerate(works)
            if w.do_sample
            for r in range(starts[i + 1] - 1 - w.num_spec_tokens, starts[i + 1])
        ]
        sample_ids = [w.seq_id for w in works if w.do_sample]
        prompt_spans: list[tuple[int, int, int]] = []  # (seq_id, first row in logits, count)
        rows = list(sample_rows)
        for i, w in enumerate(works):
            if w.prompt_logprobs:
                prompt_spans.append((w.seq_id, len(rows), query_lens[i]))
                rows.extend(range(starts[i], starts[i + 1]))
        # Pooling sequences want the final hidden state of every position they computed.
        pool_spans: list[tuple[int, int, int]] = []  # (seq_id, first hidden row, count)
        pool_rows: list[int] = []
        for i, w in enumerate(works):
            if w.pool:
                pool_spans.append((w.seq_id, len(pool_rows), query_lens[i]))
                pool_rows.extend(range(starts[i], starts[i + 1]))
        batch = MicroBatch(
            input_ids.to(dev),
            positions.to(dev),
            meta,
            torch.tensor(rows, dtype=torch.long).to(dev),
            torch.tensor(pool_rows, dtype=torch.long).to(dev) if pool_rows else None,
        )
        return _PreparedStep(batch, sample_ids, len(sample_rows), prompt_spans, pool_spans)


@dataclass
class _PreparedStep:
    """A (micro-)batch's forward inputs and how its output rows map back to sequences."""

    batch: MicroBatch
    sample_ids: list[int]
    num_sample_rows: int
    prompt_spans: list[tuple[int, int, int]]  # (seq_id, first logits row, count)
    pool_spans: list[tuple[int, int, int]]  # (seq_id, first hidden row, count)

    def output(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> ModelRunnerOutput:
        """The runner's output from this batch's ``logits`` [rows, V] and pooled ``hidden``."""
        prompt_logits = {sid: logits[lo : lo + n] for sid, lo, n in self.prompt_spans}
        hidden_states: dict[int, torch.Tensor] = {}
        if hidden is not None:
            hidden_states = {sid: hidden[lo : lo + n] for sid, lo, n in self.pool_spans}
        return ModelRunnerOutput(
            self.sample_ids, logits[: self.num_sample_rows], prompt_logits, hidden_states
        )
