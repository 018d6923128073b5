"""The engine core: add / abort requests and run one step = schedule -> execute -> update.

One step (paper section 4.5, iteration-level scheduling):

1. the scheduler picks the sequences and token counts of this step and their block tables;
2. the executor runs the model on them (writing their K/V into the paged cache);
3. the core updates the sequences: prompt logprobs; for every sequence that reached its end a
   sampled token (after forking parallel samples, ``parallel_sampling``) or a beam step
   (``beam_stepper``), or for a pooling request its embedding (``pooling``); detokenization and stop checks (``OutputProcessor``); then it frees the
   blocks of finished requests.

The core returns the requests that made progress; ``LLMEngine`` turns them into
``RequestOutput`` (``OutputProcessor.make_output``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.core.kv_manager import KVManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine import pooling
from pagedllm.engine.beam_stepper import beam_step, finish_beam_by_length
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fork_samples
from pagedllm.engine.stats import EngineStats, KVStatsObserver
from pagedllm.model.step_interrupt import StepInterrupt, StepInterrupted
from pagedllm.sampling.by_request import sample_by_request
from pagedllm.sampling.sampler import Sampler, SamplingBatch
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the live requests and runs the steps.

    Args:
        scheduler: the scheduler (with ``kv``, its KV manager).
        kv: the KV manager.
        executor: runs the model (``execute_model(SchedulerOutput)`` -> logits).
        sampler: samples one token per row of logits.
        output_processor: detokenizes, checks stops and records logprobs.
        stats: the counters to keep (the cheap ones always; see ``engine.stats``).
        eos_token_ids: the model's end-of-sequence ids (the sampler's ``min_tokens``).
        seq_ids: the engine's sequence-id counter (shared with the input processor).
        check_invariants: run ``kv.check_invariants()`` after every step (tests).
        structured: the structured-output manager (grammar compiles and matchers), or None.
        speculator: speculative decoding (``spec_decode.speculator``: proposals before the
            step, verification and rollback after it), or None.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVManager,
        executor: Any,
        sampler: Sampler,
        output_processor: OutputProcessor,
        stats: EngineStats,
        eos_token_ids: list[int],
        seq_ids: Iterator[int],
        check_invariants: bool = False,
        structured: StructuredOutputManager | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.executor = executor
        self.sampler = sampler
        self.output_processor = output_processor
        self.stats = stats
        self.stats_observer: KVStatsObserver | None = None
        self.eos_token_ids = eos_token_ids
        self._seq_ids = seq_ids
        self._check_invariants = check_invariants
        self.requests: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        self.structured = structured
        self.speculator = speculator
        if structured is not None:
            scheduler.is_ready = structured.is_ready
        if speculator is not None:
            speculator.structured = structured  # checks and masks constrained proposals
        # interrupt_decode_for_prefill (model.step_interrupt): the flag the model checks between
        # layers; (start monotonic s, decode only) of the forward pass in flight, read by the
        # thread that may set the flag; a moving average of decode-only steps' seconds.
        self.step_interrupt: StepInterrupt | None = None
        self.step_in_flight: tuple[float, bool] | None = None
        self.decode_step_seconds = 0.0
        self.last_step_interrupted = False

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, group: SequenceGroup) -> None:
        """Queue a built request (``InputProcessor.process``); its id must be unused.

        Raises:
            ValueError: the request id is already live.
        """
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.requests[group.request_id] = group
        for seq in group.seqs:
            self._seqs[seq.seq_id] = (seq, group)
        if self.structured is not None:
            self.structured.submit(group)  # compiles off this thread; scheduled once ready
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it was not live."""
        group = self.scheduler.abort(request_id)
        if group is None:
            return False
        self.forget(group)
        group.metrics.finished_time = time.monotonic()
        return True

    def forget(self, group: SequenceGroup) -> None:
        """Drop a request (already out of the scheduler) from the live maps; idempotent."""
        self.requests.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
        if self.structured is not None:
            self.structured.release(group)
        if self.speculator is not None:
            self.speculator.on_request_finished(group)

    def _new_seq_id(self) -> int:
        return next(self._seq_ids)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[SequenceGroup]:
        """Run one iteration; returns every request that made progress, in batch order, after
        those the scheduler finished by length (the finished ones are already freed and
        forgotten). An empty list: nothing could be scheduled."""
        touched: dict[str, SequenceGroup] = {}
        if self.structured is not None:
            self._fail_bad_grammars(touched)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        for request_id in sched.length_capped:
            # Finished by length by the scheduler (no room to grow even alone in the pool).
            group = self.requests[request_id]
            finish_beam_by_length(group)
            self.output_processor.release_text(group)
            touched[request_id] = group
        if sched.is_empty:
            if touched:
                self._free_finished()
            elif self.structured is not None and self.structured.has_pending:
                self.structured.wait_pending(0.01)  # idle until a grammar is ready, no spinning
            return list(touched.values())
        if self.speculator is not None:
            self.speculator.after_schedule(sched, self._seqs)  # a draft model drafts here
        now = time.monotonic()
        if self.step_interrupt is None:
            result = self.executor.execute_model(sched)
        else:
            decode_only = all(len(work.token_ids) == 1 for _, work in sched.scheduled)
            self.step_interrupt.clear()
            # The run again of an interrupted step may not be stopped: every other step at
            # least completes, however often requests arrive.
            self.step_in_flight = (now, decode_only and not self.last_step_interrupted)
            try:
                result = self.executor.execute_model(sched)
            except StepInterrupted:
                # Discarded whole: the next schedule() plans the same work again.
                self.last_step_interrupted = True
                self.stats.num_interrupted_steps += 1
                if touched:
                    self._free_finished()
                return list(touched.values())
            finally:
                self.step_in_flight = None
            self.last_step_interrupted = False
            if decode_only:
                took = time.monotonic() - now
                avg = self.decode_step_seconds
                self.decode_step_seconds = took if avg == 0.0 else 0.9 * avg + 0.1 * took
        if self.speculator is not None:
            self.speculator.observe_step(sched, time.monotonic() - now)
        self.scheduler.on_step_done(sched)
        for request_id, work in sched.scheduled:
            seq, group = self._seqs[work.seq_id]
            touched[request_id] = group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            n_prompt_part = max(0, min(seq.num_prompt_tokens - work.start_pos, len(work.token_ids)))
            self.stats.prompt_tokens += n_prompt_part
        if result.prompt_logits:
            starts = {work.seq_id: work.start_pos for _, work in sched.scheduled}
            for seq_id, logits in result.prompt_logits.items():
                self.output_processor.add_prompt_logprobs(
                    *self._seqs[seq_id], logits, self.sampler.raw_logsumexp(logits),
                    starts[seq_id],
                )
        if result.hidden_states:
            self._process_pooling(sched, result.hidden_states, now)
        sample_ids, logits = result.sample_seq_ids, result.logits
        if self.speculator is not None and sample_ids:
            sample_ids, logits = self.speculator.verify(
                sched, sample_ids, logits, self._seqs, self.sampler, self.output_processor,
                self.scheduler, self.stats, self.eos_token_ids, self._fail_request,
            )
        if sample_ids:
            self._process_samples(sample_ids, logits)

        st = self.stats
        used = self.kv.num_used_blocks
        st.num_steps += 1
        st.peak_blocks_used = max(st.peak_blocks_used, used)
        st.num_preemptions = self.scheduler.num_preemptions
        if self.stats_observer is not None:
            # Finished sequences still hold their blocks until free_finished() right after this.
            self.stats_observer.after_step(self.kv, self.scheduler, sched)
        self._free_finished()
        return list(touched.values())

    def _fail_request(self, group: SequenceGroup, exc: Exception) -> None:
        """Abort one request whose own part of the step raised (its blocks freed, its samples
        finished "abort", ``group.error`` set, so its output carries the error), so that the
        step goes on for the others: one bad request never fails the batch."""
        logger.error(
            "request %s failed in its own part of the step, aborted: %r", group.request_id, exc
        )
        self.scheduler.abort(group.request_id)
        self.forget(group)
        group.metrics.finished_time = time.monotonic()
        group.error = f"{type(exc).__name__}: {exc}"

    def _fail_bad_grammars(self, touched: dict[str, SequenceGroup]) -> None:
        """Finish (as aborted) the requests whose grammar failed to compile; the error is
        logged, the engine goes on. (Front ends validate first, so this is a fallback.)"""
        assert self.structured is not None
        for request_id, exc in self.structured.take_failed():
            group = self.scheduler.abort(request_id)
            if group is None:
                continue
            logger.warning("request %s: structured output rejected: %s", request_id, exc)
            self.forget(group)
            group.metrics.finished_time = time.monotonic()
            touched[request_id] = group

    def _free_finished(self) -> None:
        """Free and forget the finished requests, then check the pool (``check_invariants``)."""
        for group in self.scheduler.free_finished():
            group.metrics.finished_time = time.monotonic()
            self.forget(group)
        if self._check_invariants:
            self.kv.check_invariants()

    def _process_pooling(
        self, sched: SchedulerOutput, hidden_states: dict[int, torch.Tensor], now: float
    ) -> None:
        """Pool the step's final hidden states of pooling requests (``engine.pooling``); a
        request whose whole prompt is computed gets its embedding and finishes ("stop"), so
        its blocks are freed after this step."""
        start_of = {w.seq_id: w.start_pos for _, w in sched.scheduled}
        for seq_id, hidden in hidden_states.items():
            seq, group = self._seqs[seq_id]
            group.pooling_state = pooling.accumulate(group.pooling_state, start_of[seq_id], hidden)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                params = group.sampling_params.pooling
                assert params is not None
                group.embedding = pooling.pooled_embedding(group.pooling_state, params)
                group.pooling_state = None
                group.metrics.first_token_time = now
                seq.status = SequenceStatus.FINISHED_STOPPED

    def _process_samples(self, seq_ids: list[int], logits: torch.Tensor) -> None:
        """Sample a token for every sequence in ``seq_ids`` (row ``i`` of ``logits``, ``[len(
        seq_ids), vocab]``), after the beam steps of beam requests and the forks of parallel
        samples."""
        pairs = [self._seqs[s] for s in seq_ids]
        beam_rows: dict[str, list[int]] = {}
        for i, (_, group) in enumerate(pairs):
            if group.beam is not None:
                beam_rows.setdefault(group.request_id, []).append(i)
        if beam_rows:
            for rows_of_group in beam_rows.values():
                group = pairs[rows_of_group[0]][1]
                # Rows in the group's beam order (BeamSearch.step relies on it).
                row_of = {pairs[i][0].seq_id: i for i in rows_of_group}
                ordered = [row_of[s.seq_id] for s in group.seqs]
                try:
                    step = beam_step(
                        group,
                        logits[torch.tensor(ordered)],
                        self.kv,
                        self._new_seq_id,
                        self.output_processor.beam_logprob_entry(group.sampling_params.logprobs),
                    )
                except Exception as exc:  # noqa: BLE001 - this request's failure alone
                    self._fail_request(group, exc)
                    continue
                for child in step.forked:
                    self._seqs[child.seq_id] = (child, group)
                for seq in step.dropped:
                    self._seqs.pop(seq.seq_id, None)
                self.stats.generation_tokens += step.num_new_tokens
            keep = [i for i, (_, g) in enumerate(pairs) if g.beam is None]
            if not keep:
                return
            pairs = [pairs[i] for i in keep]
            logits = logits[torch.tensor(keep)]
        # Parallel sampling: a group's forks sample from its logits row (rows[k] = row of pair k).
        rows = list(range(len(pairs)))
        for i in range(len(pairs)):
            seq, group = pairs[i]
            for child in fork_samples(seq, group, self.kv, self._new_seq_id):
                self._seqs[child.seq_id] = (child, group)
                pairs.append((child, group))
                rows.append(i)
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows)]
        batch = SamplingBatch(
            params=[g.sampling_params for _, g in pairs],
            seeds=[s.seed for s, _ in pairs],
            output_token_ids=[s.output_token_ids for s, _ in pairs],
            prompt_token_ids=[s.prompt_token_ids for s, _ in pairs],
            eos_token_ids=self.eos_token_ids,
            token_bitmask=self.structured.fill_bitmask(pairs) if self.structured else None,
        )
        out = sample_by_request(
            self.sampler, logits, batch, [g for _, g in pairs], self._fail_request
        )
        now = time.monotonic()
        for i, (seq, group) in enumerate(pairs):
            if group.error is not None:
                continue  # failed in this step (its sampling or an earlier sample's output)
            try:
                seq.append_token(out.sampled_token_ids[i], out.sampled_logprobs[i])
                self.stats.generation_tokens += 1
                if group.metrics.first_token_time is None:
                    group.metrics.first_token_time = now
                self.output_processor.process_sample(seq, group, out, i)
            except Exception as exc:  # noqa: BLE001 - this request's failure alone
                self._fail_request(group, exc)
                continue
            if seq.is_finished() and len(group.seqs) > 1:
                self.scheduler.free_seq(seq)  # a finished sample gives its blocks back at once
