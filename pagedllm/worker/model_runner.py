"""SchedulerOutput -> flat input tensors -> forward -> logits of the sampled positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model.llama import LlamaForCausalLM


@dataclass
class ModelRunnerOutput:
    """Logits the driver needs to sample and to report prompt logprobs.

    Attributes:
        sample_seq_ids: sequences that sample this step, in ``logits`` row order.
        logits: [len(sample_seq_ids), V] float32.
        prompt_logits: seq_id -> [n, V] float32 logits at the step's prompt positions
            (row j predicts the token after position start_pos + j), for sequences that asked
            for prompt logprobs.
    """

    sample_seq_ids: list[int]
    logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Turns a step's scheduled sequences into the model's flat batch.

    Batch order: single-token sequences (decodes) first, then multi-token ones, as
    ``AttentionMetadata`` requires.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        works = [w for _, w in sched.scheduled]
        # Decodes first (stable sort keeps FCFS order within each kind).
        order = sorted(range(len(works)), key=lambda i: len(works[i].token_ids) > 1)
        works = [works[i] for i in order]

        query_lens = [len(w.token_ids) for w in works]
        seq_lens = [w.start_pos + n for w, n in zip(works, query_lens, strict=True)]
        num_decodes = sum(1 for n in query_lens if n == 1)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        num_tokens = starts[-1]

        input_ids = torch.tensor([t for w in works for t in w.token_ids], dtype=torch.long)
        seq_idx = torch.repeat_interleave(
            torch.arange(len(works)), torch.tensor(query_lens, dtype=torch.long)
        )
        start_pos = torch.tensor([w.start_pos for w in works], dtype=torch.long)
        q_start = torch.tensor(starts, dtype=torch.long)
        positions = start_pos[seq_idx] + torch.arange(num_tokens) - q_start[seq_idx]

        max_blocks = max(len(w.block_table) for w in works)
        tables = torch.zeros(len(works), max_blocks, dtype=torch.long)
        for i, w in enumerate(works):
            tables[i, : len(w.block_table)] = torch.tensor(w.block_table, dtype=torch.long)
        bs = self.block_size
        slot_mapping = tables[seq_idx, positions // bs] * bs + positions % bs

        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            query_start_loc=q_start,
            seq_lens_list=seq_lens,
            query_lens_list=query_lens,
            query_start_loc_list=starts,
            num_decodes=num_decodes,
            block_size=bs,
        )

        # Rows whose logits are wanted: the last token of each sampling sequence, then the
        # prompt positions of sequences asking for prompt logprobs.
        sample_rows = [starts[i + 1] - 1 for i, w in enumerate(works) if w.do_sample]
        sample_ids = [w.seq_id for w in works if w.do_sample]
        prompt_spans: list[tuple[int, int, int]] = []  # (seq_id, first row in logits, count)
        rows = list(sample_rows)
        for i, w in enumerate(works):
            if w.prompt_logprobs:
                prompt_spans.append((w.seq_id, len(rows), query_lens[i]))
                rows.extend(range(starts[i], starts[i + 1]))
        logits = self.model(
            input_ids, positions, self.kv_caches, meta, torch.tensor(rows, dtype=torch.long)
        )
        prompt_logits = {sid: logits[lo : lo + n] for sid, lo, n in prompt_spans}
        return ModelRunnerOutput(sample_ids, logits[: len(sample_rows)], prompt_logits)
