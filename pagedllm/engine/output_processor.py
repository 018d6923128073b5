"""Output processing: detokenize, check stop conditions, record logprobs, build ``RequestOutput``.

The engine core calls ``process_sample`` for every sampled token (so a finished sample can give
its blocks back in the same step) and ``add_prompt_logprobs`` for every prompt chunk whose logits
were asked for; the ``LLMEngine`` facade calls ``make_output`` for every request that made
progress in a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.engine.detokenizer import find_stop_string
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagedllm.sampling.prompt_logprobs import compute_prompt_logprobs
from pagedllm.sampling.sampler import SamplerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


class OutputProcessor:
    """Turns sampled tokens into text, finish decisions, logprobs and ``RequestOutput``.

    Args:
        tokenizer: the model's Hugging Face tokenizer (``decode``).
        eos_token_ids: the model's end-of-sequence ids.
        max_model_len: longest sequence in tokens (a sequence reaching it finishes by length).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    # ---- per sampled token -------------------------------------------------------------------
    def process_sample(
        self, seq: Sequence, group: SequenceGroup, out: SamplerOutput, row: int
    ) -> None:
        """After ``out.sampled_token_ids[row]`` was appended to ``seq``: record its logprobs (when
        the request asks for them), detokenize it and apply the stop conditions (which may set
        ``seq.status`` to a finished state)."""
        token = out.sampled_token_ids[row]
        if group.sampling_params.logprobs is not None:
            entry: PositionLogprobs = {
                token: Logprob(
                    out.sampled_logprobs[row], out.sampled_ranks[row], self.token_text(token)
                )
            }
            for rank, (tid, lp) in enumerate(out.top_logprobs[row] or [], start=1):
                entry.setdefault(tid, Logprob(lp, rank, self.token_text(tid)))
            seq.output_logprobs.append(entry)
        self.check_stop(seq, group, token)

    def beam_logprob_entry(
        self, k: int | None
    ) -> Callable[[torch.Tensor, int], PositionLogprobs] | None:
        """For a beam request asking for ``k`` logprobs (None: not asking, and None is
        returned): ``(logprob row [V] float32, token) ->`` the token's entry, shaped as a
        sampled token's (its logprob and rank, then the ``k`` best)."""
        if k is None:
            return None

        def entry(row: torch.Tensor, token: int) -> PositionLogprobs:
            lp = float(row[token])
            rank = int((row > row[token]).sum()) + 1
            out: PositionLogprobs = {token: Logprob(lp, rank, self.token_text(token))}
            if k:
                vals, idx = row.topk(k)
                for r, (tid, v) in enumerate(zip(idx.tolist(), vals.tolist(), strict=True), 1):
                    out.setdefault(tid, Logprob(v, r, self.token_text(tid)))
            return out

        return entry

    def check_stop(self, seq: Sequence, group: SequenceGroup, token: int) -> None:
        """Apply the stop conditions after ``token`` was appended to ``seq`` (order as in vLLM):
        EOS / ``stop_token_ids`` once ``min_tokens`` are out, then stop strings on the new text
        (cutting it), then ``max_tokens`` / ``max_model_len``. A finished sequence's
        ``status`` and ``stop_reason`` are set; its pending text is flushed unless a stop
        matched."""
        params = group.sampling_params
        n_out = seq.num_output_tokens
        stopped_by_token = False
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.status = SequenceStatus.FINISHED_STOPPED
                stopped_by_token = True
            elif params.stop_token_ids and token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                stopped_by_token = True
        # A stop token's text is left out unless the user asks for stop strings in the output.
        if seq.detokenizer is not None and (
            not stopped_by_token or params.include_stop_str_in_output
        ):
            new_text = seq.detokenizer.append(token)
            seq.output_text += new_text
            # Not on the min_tokens-th token either: its cut would leave fewer (case C06).
            if params.stop and not stopped_by_token and n_out > params.min_tokens:
                cut = find_stop_string(
                    seq.output_text,
                    len(new_text),
                    list(params.stop),
                    params.include_stop_str_in_output,
                )
                if cut is not None:
                    matched = self._matched_stop(seq.output_text, cut, params)
                    seq.output_text = seq.output_text[:cut]
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    seq.stop_reason = matched
        if not seq.is_finished() and (
            n_out >= group.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.status = SequenceStatus.FINISHED_LENGTH
        if (
            seq.is_finished()
            and seq.detokenizer is not None
            and seq.status != SequenceStatus.FINISHED_STOPPED
        ):
            seq.output_text += seq.detokenizer.flush()

    @staticmethod
    def _matched_stop(text: str, cut: int, params: SamplingParams) -> str | None:
        """The stop string that ``find_stop_string`` cut ``text`` at ``cut`` for."""
        stops = params.stop or []
        for s in stops:
            if params.include_stop_str_in_output and text[:cut].endswith(s):
                return s
            if not params.include_stop_str_in_output and text.startswith(s, cut):
                return s
        return stops[0] if stops else None

    def add_prompt_logprobs(
        self,
        seq: Sequence,
        group: SequenceGroup,
        logits: torch.Tensor,
        lse: torch.Tensor | None,
        start: int,
    ) -> None:
        """Append the logprobs of a prompt chunk to ``group.prompt_logprobs``.

        Args:
            seq: the group's (first) sequence.
            group: its request, asking for ``prompt_logprobs``.
            logits: ``[chunk tokens, vocab]`` float logits; row ``j`` of a chunk starting at
                prompt position ``start`` predicts prompt token ``start + j + 1``.
            lse: [chunk tokens] logsumexp of ``logits`` (``Sampler.raw_logsumexp``) or None.
            start: the chunk's first position. Rows predicting positions already kept (a
                prompt recomputed after preemption) are skipped.
        """
        plp = group.prompt_logprobs
        if plp is None or len(plp) >= seq.num_prompt_tokens:
            return  # not asked, or already complete (a recompute after preemption)
        skip = len(plp) - 1 - start  # rows whose positions were kept before a recompute
        # Chunks come in order and a prompt_logprobs request takes no prefix-cache hits.
        assert skip >= 0, f"prompt chunk at {start} follows a gap in prompt_logprobs"
        logits = logits[skip:]
        lse = None if lse is None else lse[skip:]
        start = len(plp) - 1
        targets = seq.token_ids[start + 1 : start + 1 + logits.shape[0]]
        n = min(len(targets), seq.num_prompt_tokens - len(plp))
        if n <= 0:
            return
        k = group.sampling_params.prompt_logprobs or 0
        lps, ranks, tops = compute_prompt_logprobs(
            logits[:n], torch.tensor(targets[:n], dtype=torch.long), k,
            None if lse is None else lse[:n],
        )  # fmt: skip
        for j in range(n):
            tid = targets[j]
            entry: PositionLogprobs = {tid: Logprob(lps[j], ranks[j], self.token_text(tid))}
            for rank, (alt, lp) in enumerate(tops[j], start=1):
                entry.setdefault(alt, Logprob(lp, rank, self.token_text(alt)))
            plp.append(entry)

    def release_text(self, group: SequenceGroup) -> None:
        """After the scheduler finished a group by length (``SchedulerOutput.length_capped``):
        append the text its sequences' detokenizers still hold back."""
        for seq in group.seqs:
            if seq.status == SequenceStatus.FINISHED_LENGTH and seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()

    def token_text(self, token_id: int) -> str:
        """One token's text as the tokenizer decodes it alone (for ``Logprob.decoded_token``)."""
        return str(self.tokenizer.decode([token_id]))

    # ---- per request -------------------------------------------------------------------------
    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The request's cumulative output now: its ``n`` samples (the ``n`` best by cumulative
        logprob once finished when ``best_of > n``), or its beams. While a sample runs, its text
        is held back by ``len(longest stop string) - 1`` characters that could still start a
        stop string, so the text of successive outputs only grows."""
        params = group.sampling_params
        if group.beam is not None:
            return self._make_beam_output(group)
        finished = group.is_finished()
        holdback = max((len(s) for s in params.stop or []), default=1) - 1
        seqs = group.seqs
        if finished and len(seqs) > params.n:
            # best_of > n: keep the n samples with the highest cumulative logprob (vLLM's rule).
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            seqs = seqs[: params.n]
        completions = []
        for i, seq in enumerate(seqs):
            text = seq.output_text
            if not seq.is_finished() and holdback:
                text = text[: max(0, len(text) - holdback)]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=_complete_prompt_logprobs(group),
            outputs=completions,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
            embedding=group.embedding,
            error=group.error,
        )

    def _make_beam_output(self, group: SequenceGroup) -> RequestOutput:
        """Beam search: the best ``n`` hypotheses once done (before that, the live beams; the
        live beams with finish reason "abort" when the request was aborted before it was done)."""
        params = group.sampling_params
        eos = set(self.eos_token_ids)
        aborted = group.beam_results is None and all(s.is_finished() for s in group.seqs)
        items: list[tuple[list[int], float, bool, list[PositionLogprobs] | None]]
        if group.beam_results is not None:
            items = [
                (h.token_ids, h.cum_logprob, h.finished_by_eos, h.logprobs)
                for h in group.beam_results
            ]
        else:
            items = [
                (s.output_token_ids, s.cumulative_logprob, False, s.output_logprobs)
                for s in group.seqs[: params.n]
            ]
        completions = []
        for i, (tokens, cum, by_eos, entries) in enumerate(items):
            shown = tokens[:-1] if by_eos and tokens and tokens[-1] in eos else tokens
            completions.append(
                CompletionOutput(
                    index=i,
                    text=str(
                        self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
                    ),
                    token_ids=list(tokens),
                    cumulative_logprob=float(cum),
                    logprobs=list(entries or []) if params.logprobs is not None else None,
                    finish_reason=("abort" if aborted else None)
                    if group.beam_results is None
                    else ("stop" if by_eos else "length"),
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=_complete_prompt_logprobs(group),
            outputs=completions,
            finished=group.beam_results is not None or aborted,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
            error=group.error,
        )


def _complete_prompt_logprobs(group: SequenceGroup) -> list[PositionLogprobs | None] | None:
    """The request's prompt logprobs once every prompt position has them, else None."""
    plp = group.prompt_logprobs
    if plp and len(plp) >= len(group.prompt_token_ids):
        return list(plp)
    return None
